"""The fused MLP of the mlp workload (batch 2^21, in 32, 4 hidden layers, ReLU, out 16, fp16) per width: every
kernel variant's forward and backward time as the autotuner measured them (retuned), then the per-kernel GPU time
of one training step (forward + backward) with the chosen variants, from torch.profiler's CUDA activity.
Usage: python scripts/profile_mlp.py [width ...] [--host]   (default: 64 128; --host: back-to-back GPU time against host
time per call, and the Python profile of the training step)"""
import cProfile
import sys
import time

import torch
from kernel_profile import kernel_times, print_host_profile

from kfuse.bench_mlp import MLP_BATCH, MLP_IN, MLP_OUT, _sequential
from kfuse.tuning_table import format_tuning_table
from kfuse.mlp import FusedMLP


def main():
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    widths = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 128]
    for width in widths:
        fused = FusedMLP.from_torch(_sequential(width, seed=1000 + width).cuda().half())
        rows = fused.tune(MLP_BATCH, mode="retune")
        print(f"== width {width}: variants (retuned)\n" + format_tuning_table(rows))
        for r in rows:
            for c in r["candidates"]:
                t = "rejected" if c["rejected"] else f"median {c['median_ms']:.4f} ms, min {c['min_ms']:.4f}"
                print(f"   {r['op']:<14} {c['name']:<28} {t}")
        x = torch.randn(MLP_BATCH, MLP_IN, device="cuda", dtype=torch.float16)
        dy = torch.randn(MLP_BATCH, MLP_OUT, device="cuda", dtype=torch.float16)
        params = list(fused.parameters())

        def step():
            return torch.autograd.grad(fused(x), params, dy)

        total, rows = kernel_times(step, warmup=3)
        print(f"== width {width}: training step {total / 1e3:.3f} ms of kernel time")
        for name, us, cnt in rows[:15]:
            print(f"{us:9.1f} us  x{cnt:<3} {name[:110]}")
        if "--host" in flags:
            host_profile(fused, x, step)


def host_profile(fused, x, step, calls=30):
    """Back-to-back GPU time per call (CUDA events) beside the host time per call (the calls queued without a
    synchronization): where the host is the slower of the two, back-to-back time is host-bound. Then the Python
    profile of the training step's calls."""
    def forward():
        with torch.no_grad():
            return fused(x)

    for label, call in (("forward", forward), ("training step", step)):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        host = (time.perf_counter() - t0) / calls * 1e3
        torch.cuda.synchronize()
        print(f"   {label}: {start.elapsed_time(end) / calls:.4f} ms per call back to back, host {host:.4f} ms per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print_host_profile(prof, f"host profile of {calls} training steps", 14)


if __name__ == "__main__":
    main()
