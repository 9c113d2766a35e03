"""GPU time of a weight change in an engine that keeps prepared filters (the inference forward's unrolled dense filter
and its squeeze projection, remade after every change: a training step's optimizer update pays it too). Runs on the
GPU machine: bash scripts/gpu_run.sh --exec "python3 scripts/profile_weight_update.py".
Usage: python scripts/profile_weight_update.py [N]"""
import sys

import torch

import kfuse
from kernel_profile import kernel_times


def main():
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    model = kfuse.ResNetEncoder.default_network(3).cuda().half().eval()
    x = torch.randn(batch, 3, 64, 64, device="cuda").half()
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed: the prepared filters exist from the first
            model(x)
    param = next(model.parameters())

    def step():
        with torch.no_grad():
            param.mul_(1.0)  # a new version: the next call re-packs the weights and remakes the prepared filters
            model(x)

    total, rows = kernel_times(step)
    print(f"[weight update] batch {batch}: {total:.1f} us of kernels per (weight change + forward)")
    for name, us, launches in rows[:12]:
        print(f"  {us:8.1f} us  x{launches:<3} {name[:100]}")


if __name__ == "__main__":
    main()
