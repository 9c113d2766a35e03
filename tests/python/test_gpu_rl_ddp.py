"""GPU tier, two GPUs: the DD-PPO loop (kfuse.rl) data-parallel over two processes with NCCL, fp16 on CUDA, as
test_rl_ddp.py checks it on the CPU with gloo: every rank holds the same weights after each update (rank 0's
broadcast into every rank's parameter storage, then all-reduced gradients), with kfuse's encoder and with plain
PyTorch's, eager and compiled as the rl benchmark compiles them (the update through the DDP wrapper). Skipped without
two CUDA GPUs."""

import pytest
import torch

import kfuse
from test_rl_ddp import check_ranks_agree

pytestmark = pytest.mark.skipif(not kfuse.cuda_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs and a CUDA build of kfuse")


@pytest.mark.parametrize("impl", ["kfuse", "torch", "torch-jit-fp16", "kfuse-compile"])
def test_every_rank_holds_the_same_weights_after_each_update_on_two_gpus(impl, tmp_path):
    check_ranks_agree(impl, tmp_path, device_type="cuda")


def _release_worker(rank: int, store: str, out: str) -> None:
    """The encoder alone under DDP (NCCL, bucket views), its gradients released at the end and per block (2 MB
    buckets, so that the all-reduce starts inside the backward); two steps each (the second on DDP's rebuilt
    buckets). Rank 0 saves every rank's flat gradients per release."""
    import torch.distributed as dist

    from kfuse.bench_rl import nvlink_multicast_off, quiesce_process_group

    nvlink_multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device)
    try:
        grads = {}
        for release, bucket_mb in (("at_end", 25), ("per_block", 2)):
            enc = kfuse.ResNetEncoder.default_network(3).to(device, torch.float16).train()
            enc.gradient_release = release
            ddp = torch.nn.parallel.DistributedDataParallel(enc, device_ids=[rank], gradient_as_bucket_view=True,
                                                            bucket_cap_mb=bucket_mb)
            gen = torch.Generator().manual_seed(70 + rank)  # each rank its own data
            for _ in range(2):
                enc.zero_grad(set_to_none=True)
                x = torch.rand(6, 3, 64, 64, generator=gen).to(device)
                ddp(x).float().square().sum().backward()
            grads[release] = torch.cat([p.grad.flatten() for p in enc.parameters()]).cpu()
            ddp = enc = None
        gathered = [None, None]
        dist.all_gather_object(gathered, grads)
        if rank == 0:
            torch.save(gathered, out)
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


def test_per_block_gradient_release_under_ddp_on_two_gpus(tmp_path):
    """Released per block, DDP's all-reduce gives every rank the same gradients, bitwise those of the release at the
    end (the all-reduce is elementwise: the buckets' sizes do not change a sum)."""
    from kfuse.bench_rl import spawn_with_deadline

    out = str(tmp_path / "out.pt")
    spawn_with_deadline(_release_worker, (str(tmp_path / "store"), out), 2, timeout_s=300)
    ranks = torch.load(out)
    for release in ("at_end", "per_block"):
        assert torch.isfinite(ranks[0][release]).all()
        assert torch.equal(ranks[0][release], ranks[1][release]), release
    assert torch.equal(ranks[0]["at_end"], ranks[0]["per_block"])
