"""Where one DD-PPO iteration's time goes (kfuse.rl at the benchmark's size), per configuration of kfuse.bench_rl:
wall time of the rollout and the update against the GPU's busy time in each (a loop whose GPU idles is bound by the
host: launches, Python, synchronizations), and the ops that take the most host and device time.
Usage: python scripts/profile_rl.py [impl ...] (default: kfuse torch-jit-fp16)"""
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


def phase(trainer, name):
    fn = getattr(trainer, name)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    print(f"  {name}: wall {wall:.1f} ms, GPU busy {busy_us(prof) / 1e3:.1f} ms")
    return prof


def main():
    impls = sys.argv[1:] or ["kfuse", "torch-jit-fp16"]
    torch.backends.cudnn.benchmark = True
    for impl in impls:
        trainer = _trainer(impl, "cuda", RL_ENVS, RL_STEPS, seed=0)
        for _ in range(3):
            trainer.iteration()
        print(f"== {impl} ({torch.cuda.get_device_name()})")
        for name in ("rollout", "update"):
            prof = phase(trainer, name)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50)
            print(table)
            kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50)
            print(kernels)
        trainer = None
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
