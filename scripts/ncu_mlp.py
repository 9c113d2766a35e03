"""A few forward and training steps of the mlp workload's MLP with given kernel variants, for Nsight Compute:
  ncu --kernel-name regex:'kfuse_mlp_(forward|backward)$' --launch-skip 2 --launch-count 2 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section WarpStateStats python scripts/ncu_mlp.py [width] [--times]
Variants: the inference forward (1, 16, True, 64, False, True) at width 64, the training step's wgmma backward
(1, 8, True, 64, True, True, 4, True) at widths 64 and 128, else the heuristic defaults (KFUSE_TUNE is off here: no
candidate runs). --times (without ncu): the training step's per-kernel GPU times instead."""
import sys

import torch

from kfuse.bench_mlp import MLP_BATCH, MLP_IN, MLP_OUT, _sequential
from kfuse.mlp import FusedMLP


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    width = int(args[0]) if args else 64
    fused = FusedMLP.from_torch(_sequential(width, seed=1000 + width).cuda().half())
    if width <= 64:
        fused.variant = (1, 16, True, 64, False, True)
    if width <= 128:
        fused.backward_variant = (1, 8, True, 64, True, True, 4, True)
    x = torch.randn(MLP_BATCH, MLP_IN, device="cuda", dtype=torch.float16)
    dy = torch.randn(MLP_BATCH, MLP_OUT, device="cuda", dtype=torch.float16)
    params = list(fused.parameters())
    for _ in range(3):
        with torch.no_grad():
            fused(x)
        torch.autograd.grad(fused(x), params, dy)
    torch.cuda.synchronize()
    if "--times" in sys.argv:
        from kernel_profile import kernel_times
        total, rows = kernel_times(lambda: torch.autograd.grad(fused(x), params, dy), warmup=3)
        print(f"== width {width}, training variant {fused.backward_variant}: {total / 1e3:.3f} ms of kernel time")
        for name, us, cnt in rows[:12]:
            print(f"{us:9.1f} us  x{cnt:<3} {name[:100]}")


if __name__ == "__main__":
    main()
