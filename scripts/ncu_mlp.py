"""A few forward and training steps of the mlp workload's MLP with given kernel variants, for Nsight Compute:
  ncu --kernel-name regex:'kfuse_mlp_(forward|backward)$' --launch-skip 2 --launch-count 2 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section WarpStateStats python scripts/ncu_mlp.py [width]
Variants: the inference forward (1, 16, True, 64, False, True) and the training step's wgmma backward at width 64,
else the heuristic defaults (KFUSE_TUNE is off here: no candidate runs)."""
import sys

import torch

from kfuse.bench_mlp import MLP_BATCH, MLP_IN, MLP_OUT, _sequential
from kfuse.mlp import FusedMLP


def main():
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    fused = FusedMLP.from_torch(_sequential(width, seed=1000 + width).cuda().half())
    if width <= 64:
        fused.variant = (1, 16, True, 64, False, True)
        fused.backward_variant = (1, 8, True, 64, True, True, 4, True)
    x = torch.randn(MLP_BATCH, MLP_IN, device="cuda", dtype=torch.float16)
    dy = torch.randn(MLP_BATCH, MLP_OUT, device="cuda", dtype=torch.float16)
    params = list(fused.parameters())
    for _ in range(3):
        with torch.no_grad():
            fused(x)
        torch.autograd.grad(fused(x), params, dy)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
