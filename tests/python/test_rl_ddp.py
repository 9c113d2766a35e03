"""CPU tier: the DD-PPO loop (kfuse.rl) data-parallel over two processes (gloo on the CPU, as NCCL runs it on GPUs):
DistributedDataParallel's construction broadcasts rank 0's parameters into every rank's storage (a write kfuse must
follow), and after every update every rank holds the same weights, with both encoders. Each rank starts from other
weights (another seed) and simulates its own environments."""

import pytest
import torch
import torch.distributed as dist
from kfuse import rl
from kfuse.bench_rl import nvlink_multicast_off, quiesce_process_group, spawn_with_deadline

WORLD = 2


def _worker(rank: int, impl: str, store: str, out: str, device_type: str = "cpu") -> None:
    """impl: a configuration of the rl benchmark (kfuse.bench_rl.IMPLS), or an encoder ("kfuse", "torch") eager."""
    from kfuse import bench_rl

    cuda = device_type == "cuda"
    if cuda:
        nvlink_multicast_off()
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            device_id=device if cuda else None)
    try:
        torch.manual_seed(rank)
        encoder = "kfuse" if impl.startswith("kfuse") else "torch"
        policy = rl.Policy(encoder=encoder, seed=3 + rank)  # rank 1 starts elsewhere: DDP's broadcast fixes that
        if cuda:
            policy = policy.to(device, torch.float16)
        trainer = bench_rl.configure(rl.PPOTrainer(policy, num_envs=8 if cuda else 2, steps=4 if cuda else 2, seed=5),
                                     impl)
        start = torch.cat([p.detach().float().flatten() for p in policy.parameters()]).cpu()
        rows = []
        for _ in range(2):
            stats = trainer.iteration()
            flat = torch.cat([p.detach().float().flatten() for p in policy.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(WORLD)]
            dist.all_gather(gathered, flat)
            rows.append((stats["loss"], [g.cpu().clone() for g in gathered]))
        if rank == 0:
            torch.save({"start": start, "rows": rows}, out)
        trainer = policy = gathered = None
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


def check_ranks_agree(impl: str, tmp_path, device_type: str = "cpu") -> None:
    store, out = str(tmp_path / "store"), str(tmp_path / "out.pt")
    spawn_with_deadline(_worker, (impl, store, out, device_type), WORLD, timeout_s=300)
    result = torch.load(out)
    ref = rl.Policy(encoder="torch", seed=3)
    rank0_init = torch.cat([p.detach().flatten() for p in ref.parameters()])
    if device_type == "cuda":
        rank0_init = rank0_init.half().float()
    assert torch.equal(result["start"], rank0_init)
    previous = rank0_init
    for loss, weights in result["rows"]:
        assert torch.equal(weights[0], weights[1]), "the ranks' weights differ after an update"
        assert not torch.equal(weights[0], previous), "the update did not move the weights"
        previous = weights[0]


@pytest.mark.parametrize("impl", ["kfuse", "torch", "torch-jit-fp16"])
def test_every_rank_holds_the_same_weights_after_each_update(impl, tmp_path):
    check_ranks_agree(impl, tmp_path)


def test_compiled_configurations_compile_the_data_parallel_wrapper(tmp_path):
    """With a process group up, the rl benchmark's compiled configurations compile the update through the
    DistributedDataParallel wrapper: compiling the bare policy would skip the gradients' all-reduce, and each rank
    would train alone."""
    from kfuse import bench_rl

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for impl in ("kfuse-compile", "torch-compile"):
            trainer = bench_rl._trainer(impl, "cpu", num_envs=2, steps=2, seed=0, dtype=torch.float32)
            assert trainer.ddp is not None
            assert trainer.evaluate._orig_mod is trainer.ddp, impl
            trainer = None
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


def _wait_forever(rank: int) -> None:
    import time
    while True:
        time.sleep(1)


def test_a_hung_process_group_is_terminated_with_an_error():
    """The data-parallel runs (tests and kfuse bench) spawn through spawn_with_deadline: a process that never returns
    (a collective waiting for a dead peer) is terminated and reported, not waited for."""
    with pytest.raises(TimeoutError, match="still ran after"):
        spawn_with_deadline(_wait_forever, (), 2, timeout_s=3)
