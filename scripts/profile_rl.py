"""Where one DD-PPO iteration's time goes (kfuse.rl at the benchmark's size), per configuration of kfuse.bench_rl:
wall time of the rollout and the update against the GPU's busy time in each (a loop whose GPU idles is bound by the
host: launches, Python, synchronizations), and the ops that take the most host and device time.
Usage: python scripts/profile_rl.py [impl ...] (default: kfuse torch-jit-fp16)
       python scripts/profile_rl.py --ddp WORLD [impl]: the update on each of WORLD ranks (one per GPU, NCCL, the
       trainer's DistributedDataParallel), every rank's wall and busy time, rank 0's tables (default impl: kfuse)"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kfuse.bench_rl import RL_ENVS, RL_STEPS, _trainer


def busy_us(prof) -> float:
    """Device time covered by at least one kernel or copy (overlaps counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def phase(trainer, name, label=""):
    fn = getattr(trainer, name)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    print(f"  {label}{name}: wall {wall:.1f} ms, GPU busy {busy_us(prof) / 1e3:.1f} ms", flush=True)
    return prof


def tables(prof) -> None:
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


def _rank(rank: int, world: int, impl: str, store: str) -> None:
    """One rank of --ddp: three iterations, then the update profiled, the ranks started together (a barrier)."""
    import torch.distributed as dist

    from kfuse.bench_rl import nvlink_multicast_off, quiesce_process_group

    nvlink_multicast_off()
    torch.cuda.set_device(rank)
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    try:
        trainer = _trainer(impl, device, RL_ENVS, RL_STEPS, seed=0)
        for _ in range(3):
            trainer.iteration()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            pass  # the profiler's first start takes a different time on each rank: before the barrier
        trainer.rollout()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        prof = phase(trainer, "update", f"rank {rank} of {world}: ")
        if rank == 0:
            tables(prof)
        trainer = None
        quiesce_process_group()
    finally:
        dist.destroy_process_group()


def ddp_main(world: int, impl: str) -> None:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, impl, f"{tmp}/store"), nprocs=world)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp":
        if len(sys.argv) < 3:
            raise SystemExit("usage: python scripts/profile_rl.py --ddp WORLD [impl]")
        ddp_main(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "kfuse")
        return
    impls = sys.argv[1:] or ["kfuse", "torch-jit-fp16"]
    torch.backends.cudnn.benchmark = True
    for impl in impls:
        trainer = _trainer(impl, "cuda", RL_ENVS, RL_STEPS, seed=0)
        for _ in range(3):
            trainer.iteration()
        print(f"== {impl} ({torch.cuda.get_device_name()})")
        for name in ("rollout", "update"):
            tables(phase(trainer, name))
        trainer = None
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
