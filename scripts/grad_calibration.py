"""How close can fp16 / bf16 storage get to float64 gradients? Per parameter: kfuse's error and PyTorch's own
(half / bfloat16 modules, cuDNN) against the float64 reference, on the GPU tests' random networks. Diagnostic tool
for choosing the gradient tolerances of tests/python/test_gpu_training.py."""
import copy
import sys

import torch

sys.path.insert(0, "tests/python")
from conftest import randomize, rel_err  # noqa: E402

import kfuse  # noqa: E402
from kfuse import reference  # noqa: E402


def grads(model, x, dy):
    names, params = zip(*model.named_parameters())
    y = model(x)
    return dict(zip(names, torch.autograd.grad(y, list(params), dy.to(y.dtype))))


def main():
    for c, n, seed in [(3, 33, 2063), (11, 1, 2111), (3, 256, 31)]:
        torch.manual_seed(seed)
        ref = randomize(reference.ResNetEncoder(c), seed + 1)
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(n, c, 64, 64, generator=gen)
        dy = torch.randn(n, 512, 2, 2, generator=gen)
        g64 = grads(copy.deepcopy(ref).cuda().double(), x.cuda().double(), dy.cuda().double())
        rows = {}
        for label, dt in [("fp16", torch.float16), ("bf16", torch.bfloat16)]:
            tm = copy.deepcopy(ref).cuda().to(dt)
            gt = grads(tm, x.cuda().to(dt), dy.cuda())
            km = kfuse.ResNetEncoder.from_torch(ref).cuda().to(torch.float32 if dt == torch.float16 else dt)
            gk = grads(km, x.cuda().to(torch.float32 if dt == torch.float16 else dt), dy.cuda())
            # the torch reference of the same rounded parameters for bf16
            g64b = g64 if dt == torch.float16 else grads(copy.deepcopy(ref).to(dt).cuda().double(),
                                                         x.cuda().double(), dy.cuda().double())
            for name in g64:
                rows.setdefault(name, []).extend([rel_err(gt[name], g64b[name]), rel_err(gk[name], g64b[name])])
        print(f"\nC={c} N={n}: normwise relative error vs float64   torch-fp16  kfuse-fp16  torch-bf16  kfuse-bf16")
        worst = [0.0] * 4
        for name, v in rows.items():
            worst = [max(a, b) for a, b in zip(worst, v)]
            print(f"{name:<34}" + "".join(f"{e:12.2e}" for e in v))
        print(f"{'worst':<34}" + "".join(f"{e:12.2e}" for e in worst))


if __name__ == "__main__":
    main()
