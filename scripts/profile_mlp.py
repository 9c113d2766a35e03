"""The fused MLP of the mlp workload (batch 2^21, in 32, 4 hidden layers, ReLU, out 16, fp16) per width: every
kernel variant's forward and backward time as the autotuner measured them (retuned), then the per-kernel GPU time
of one training step (forward + backward) with the chosen variants, from torch.profiler's CUDA activity.
Usage: python scripts/profile_mlp.py [width ...]   (default: 64 128)"""
import sys

import torch
from kernel_profile import kernel_times

from kfuse.bench_mlp import MLP_BATCH, MLP_IN, MLP_OUT, _sequential
from kfuse.encoder import format_tuning_table
from kfuse.mlp import FusedMLP


def main():
    widths = [int(a) for a in sys.argv[1:]] or [64, 128]
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


if __name__ == "__main__":
    main()
