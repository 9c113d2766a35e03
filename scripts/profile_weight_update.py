"""GPU kernels of the first batch-128 inference after a weight change: every parameter written through
p.data.copy_ from fp32 master weights (the RL optimizer's pattern), then one forward, which finds the change and
repacks (packed layouts, the unrolled dense filter, the squeeze projection). Runs on the GPU machine:
    bash scripts/gpu_run.sh --exec "python3 scripts/profile_weight_update.py [N] [--timeline]"
The writes' own copy kernels are listed too (torch's elementwise kernels); kfuse's are the rest."""
import sys

import torch

import kfuse
from kernel_profile import kernel_times, print_timeline


def main():
    args = [a for a in sys.argv[1:] if a != "--timeline"]
    batch = int(args[0]) if args else 128
    model = kfuse.ResNetEncoder.default_network(3).cuda().half().eval()
    x = torch.randn(batch, 3, 64, 64, device="cuda").half()
    params = list(model.parameters())
    # Two sets of masters, used in turn: every write changes every parameter's bytes.
    masters = [[p.detach().float() + d * 1e-3 * torch.randn_like(p, dtype=torch.float32) for p in params]
               for d in (1.0, -1.0)]
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed: the prepared filters exist from the first
            model(x)
    turn = [0]

    def step():
        with torch.no_grad():
            for p, m in zip(params, masters[turn[0] % 2]):
                p.data.copy_(m)
            turn[0] += 1
            model(x)

    intervals = [] if "--timeline" in sys.argv else None
    total, rows = kernel_times(step, intervals=intervals)
    print(f"[weight update] batch {batch}: {total:.1f} us of kernels per (write of every parameter + forward)")
    for name, us, launches in rows[:16]:
        print(f"  {us:8.1f} us  x{launches:<3} {name[:100]}")
    if intervals is not None:
        print_timeline(intervals)


if __name__ == "__main__":
    main()
