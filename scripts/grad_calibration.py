"""How close can fp16 / bf16 storage get to float64 gradients? Per parameter: kfuse's error and PyTorch's own
(half / bfloat16 modules, cuDNN) against the float64 reference, on exactly the problems of
tests/python/test_gpu_training.py::test_gradients_match_float64_reference, plus the conditioning of each FixUp
scalar's gradient (conftest.scalar_gradient_conditioning). Diagnostic tool for the gradient tolerances.

    python scripts/grad_calibration.py [C:N ...] [--dtype fp16|bf16|both] [--all]

--all prints every parameter, else the scalars and the parameters where kfuse is more than 2x off PyTorch's error.
Environment switches worth comparing: KFUSE_CUDNN=off (CUTLASS only), KFUSE_TUNE=off (heuristic kernels)."""
import argparse
import copy
import sys

import torch

sys.path.insert(0, "tests/python")
from conftest import randomize, rel_err, scalar_gradient_conditioning  # noqa: E402

import kfuse  # noqa: E402
from kfuse import reference  # noqa: E402


def grads(model, x, dy):
    names, params = zip(*model.named_parameters())
    y = model(x)
    return dict(zip(names, torch.autograd.grad(y, list(params), dy.to(y.dtype))))


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
            g64 = grads(r64, x.cuda().double(), dy.cuda().double())
            cond = scalar_gradient_conditioning(r64, x.cuda().double(), dy.cuda().double())
            gt = grads(copy.deepcopy(base).cuda().to(dt), x.cuda().to(dt), dy.cuda())
            pdt = torch.float32 if dt == torch.float16 else dt
            km = kfuse.ResNetEncoder.from_torch(base).cuda().to(pdt).train()
            gk = grads(km, x.cuda().to(pdt), dy.cuda())
            label = "fp16" if dt == torch.float16 else "bf16"
            print(f"\nC={c} N={n} {label}: normwise relative error vs float64; cond = ||terms|| / |sum| of a scalar")
            print(f"{'parameter':<34}{'torch':>10}{'kfuse':>10}{'ratio':>8}{'cond':>10}{'exact':>12}")
            for name in g64:
                et, ek = rel_err(gt[name], g64[name]), rel_err(gk[name], g64[name])
                scalar = name in cond
                if args.all or scalar or ek > 2 * et and ek > 1e-2:
                    extra = f"{cond[name]:10.1e}{g64[name].item():12.3e}" if scalar else ""
                    print(f"{name:<34}{et:10.2e}{ek:10.2e}{ek / max(et, 1e-30):8.1f}{extra}")
            for i, st in enumerate(km.layers):
                # d scale recomputed from kfuse's own conv2 weight gradient: <W2, dW2 / scale> in float64
                b = st[0]
                w2 = b.conv2.weight.detach().double()
                pre = f"layers.{i}.0."
                alt = (w2 * gk[pre + "conv2.weight"].double() / b.fixup_scale.detach().double()).sum()
                print(f"  {pre}fixup_scale from kfuse's dW2: rel err {abs(alt - g64[pre + 'fixup_scale'].double()).item() / abs(g64[pre + 'fixup_scale'].item()):.2e}")


if __name__ == "__main__":
    main()
