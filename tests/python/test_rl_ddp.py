"""CPU tier: the DD-PPO loop (kfuse.rl) data-parallel over two processes (gloo on the CPU, as NCCL runs it on GPUs):
DistributedDataParallel's construction broadcasts rank 0's parameters into every rank's storage (a write kfuse must
follow), and after every update every rank holds the same weights, with both encoders. Each rank starts from other
weights (another seed) and simulates its own environments."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kfuse import rl

WORLD = 2


def _worker(rank: int, encoder: str, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(rank)
        policy = rl.Policy(encoder=encoder, seed=3 + rank)  # rank 1 starts elsewhere: DDP's broadcast fixes that
        trainer = rl.PPOTrainer(policy, num_envs=2, steps=2, seed=5)
        start = torch.cat([p.detach().flatten() for p in policy.parameters()])
        rows = []
        for _ in range(2):
            stats = trainer.iteration()
            flat = torch.cat([p.detach().flatten() for p in policy.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(WORLD)]
            dist.all_gather(gathered, flat)
            rows.append((stats["loss"], [g.clone() for g in gathered]))
        if rank == 0:
            torch.save({"start": start, "rows": rows}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("encoder", ["kfuse", "torch"])
def test_every_rank_holds_the_same_weights_after_each_update(encoder, tmp_path):
    store, out = str(tmp_path / "store"), str(tmp_path / "out.pt")
    mp.spawn(_worker, args=(encoder, store, out), nprocs=WORLD, join=True)
    result = torch.load(out)
    ref = rl.Policy(encoder="torch", seed=3)
    rank0_init = torch.cat([p.detach().flatten() for p in ref.parameters()])
    assert torch.equal(result["start"], rank0_init)
    previous = rank0_init
    for loss, weights in result["rows"]:
        assert torch.equal(weights[0], weights[1]), "the ranks' weights differ after an update"
        assert not torch.equal(weights[0], previous), "the update did not move the weights"
        previous = weights[0]
