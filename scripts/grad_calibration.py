"""How close can fp16 / bf16 storage get to float64 gradients? Per parameter: kfuse's error and PyTorch's own
(half / bfloat16 modules, cuDNN) against the float64 reference, on the networks, inputs and dL/dy of
tests/python/test_gpu_training.py::test_gradients_match_float64_reference before the test zeroes dL/dy near the
output ReLU's threshold (away_from_kinks: this script shows why it does), plus the conditioning of each FixUp
scalar's gradient (conftest.scalar_gradient_conditioning). Diagnostic tool for the gradient tolerances.

    python scripts/grad_calibration.py [C:N ...] [--dtype fp16|bf16|both] [--all]

Columns: the error of PyTorch (module in fp16 / bf16, cuDNN) and of kfuse against the float64 oracle; then each
against the oracle that takes the output's last ReLU decisions from that implementation's own output ("own mask":
with a few outputs near the threshold, which side rounding puts them on decides much of the error at N = 1); the
conditioning of the FixUp scalars. --all prints every parameter, else the scalars and the parameters where kfuse is
more than 2x off PyTorch. Environment switches worth comparing: KFUSE_CUDNN=off (CUTLASS only), KFUSE_TUNE=off."""
import argparse
import copy
import sys

import torch

sys.path.insert(0, "tests/python")
from conftest import final_pre_activation, randomize, rel_err, scalar_gradient_conditioning  # noqa: E402

import kfuse  # noqa: E402
from kfuse import reference  # noqa: E402


def grads(model, x, dy):
    names, params = zip(*model.named_parameters())
    y = model(x)
    return dict(zip(names, torch.autograd.grad(y, list(params), dy.to(y.dtype))))


def grads_with_mask(model, x, dy, mask):
    """Gradients of the float64 model with the output's last ReLU replaced by a fixed 0/1 mask."""
    names, params = zip(*model.named_parameters())
    z = final_pre_activation(model, x)
    return dict(zip(names, torch.autograd.grad(z, list(params), dy * mask)))


def problem(c: int, n: int):
    """The test's problem for (C, N): same seeds, same random network, dL/dy with mean 1."""
    seed = 2000 + 10 * c + n
    torch.manual_seed(seed)
    ref = randomize(reference.ResNetEncoder(c), seed + 1)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, c, 64, 64, generator=gen)
    dy = torch.randn(n, 512, 2, 2, generator=gen) + 1.0
    return ref, x, dy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["3:1", "11:1", "1:33"])
    ap.add_argument("--dtype", default="both", choices=["fp16", "bf16", "both"])
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    dtypes = {"fp16": [torch.float16], "bf16": [torch.bfloat16], "both": [torch.float16, torch.bfloat16]}[args.dtype]
    for case in args.cases:
        c, n = map(int, case.split(":"))
        ref, x, dy = problem(c, n)
        for dt in dtypes:
            base = ref if dt == torch.float16 else copy.deepcopy(ref).to(dt)  # bf16: the rounded parameters
            r64 = copy.deepcopy(base).cuda().double()
            x64, dy64 = x.cuda().double(), dy.cuda().double()
            g64 = grads(r64, x64, dy64)
            cond = scalar_gradient_conditioning(r64, x64, dy64)
            tm = copy.deepcopy(base).cuda().to(dt)
            yt = tm(x.cuda().to(dt)).detach()
            gt = grads(tm, x.cuda().to(dt), dy.cuda())
            pdt = torch.float32 if dt == torch.float16 else dt
            km = kfuse.ResNetEncoder.from_torch(base).cuda().to(pdt).train()
            yk = km(x.cuda().to(pdt)).detach()
            gk = grads(km, x.cuda().to(pdt), dy.cuda())
            gt_own = grads_with_mask(r64, x64, dy64, (yt > 0).double())
            gk_own = grads_with_mask(r64, x64, dy64, (yk > 0).double())
            label = "fp16" if dt == torch.float16 else "bf16"
            y64 = r64(x64).detach()
            print(f"\nC={c} N={n} {label}: normwise relative error vs float64; output ReLU decisions unlike float64's: "
                  f"PyTorch {int(((yt > 0) != (y64 > 0)).sum())}, kfuse {int(((yk > 0) != (y64 > 0)).sum())} "
                  f"of {y64.numel()}")
            print(f"{'parameter':<34}{'torch':>10}{'kfuse':>10}{'ratio':>8}{'torch|own':>11}{'kfuse|own':>11}"
                  f"{'cond':>10}{'exact':>12}")
            for name in g64:
                et, ek = rel_err(gt[name], g64[name]), rel_err(gk[name], g64[name])
                scalar = name in cond
                if args.all or scalar or ek > 2 * et and ek > 1e-2:
                    extra = f"{cond[name]:10.1e}{g64[name].item():12.3e}" if scalar else ""
                    print(f"{name:<34}{et:10.2e}{ek:10.2e}{ek / max(et, 1e-30):8.1f}"
                          f"{rel_err(gt[name], gt_own[name]):11.2e}{rel_err(gk[name], gk_own[name]):11.2e}{extra}")


if __name__ == "__main__":
    main()
