"""How much of a bf16 gradient's error against float64 is ReLU decisions (GPU; run from the repository root):
    PYTHONPATH=python:tests/python python3 dev/scalar_grad_diag/relu_decisions.py [seeds...]
    PYTHONPATH=python:tests/python python3 dev/scalar_grad_diag/relu_decisions.py --sweep FIRST COUNT [fp16]

For the gradient-accuracy test's problem bf16, 96 x 64, C = 11, N = 1 (seed 2111, the known failing case) and other
seeds of the same shape: a functional float64 forward whose ReLUs (stem, each block's conv1, squeeze-excite hidden
and output) can take their decisions from elsewhere. It prints, per seed,
  - kfuse's and PyTorch's three bf16 realizations' errors against float64 (block 4's conv1.weight and fixup_bias1b,
    and the whole gradient);
  - how many ReLU decisions PyTorch's bf16 forward takes differently from float64, per site;
  - the same errors against float64 run with PyTorch bf16's decisions: if rounding elsewhere is benign, PyTorch's own
    error collapses there, and the decisions are what the comparison measures;
  - block 4's conv1.weight / fixup_bias1b gradients' change when single near-threshold decisions of float64 flip.
"""
import copy
import sys

import torch
import torch.nn.functional as F
from conftest import randomize, rel_err

import kfuse
from kfuse import reference
from test_gpu_training import away_from_kinks, kfuse_grads, reference_grads, torch_mixed_grads

H, W, C, N = 96, 64, 11, 1
WATCH = ["layers.3.0.conv1.weight", "layers.3.0.fixup_bias1b"]


def forward(m, x, masks=None, record=None):
    """m's forward with ReLU decisions from masks[site] where given; record[site] = pre-activation."""
    def relu(site, pre):
        if record is not None:
            record[site] = pre.detach()
        if masks is not None and site in masks:
            return pre * masks[site].to(pre.dtype)
        return torch.relu(pre)

    h = relu("stem", m.stem[1](m.stem[0](x)))
    blocks = [b for stage in m.layers for b in stage]
    for i, b in enumerate(blocks):
        a = h + b.fixup_bias1a
        t = relu(f"{i}.h", b.conv1(a) + b.fixup_bias1b)
        o = b.conv2(t + b.fixup_bias2a) * b.fixup_scale + b.fixup_bias2b
        ident = h if b.downsample is None else b.downsample(a)
        fc1, fc2 = b.se.excite[0], b.se.excite[2]
        z = relu(f"{i}.se", fc1(o.mean((2, 3))))
        g = torch.sigmoid(fc2(z)).view(o.shape[0], -1, 1, 1)
        h = relu(f"{i}.out", o * g + ident)
    return h


def grads(m, x, dy, masks=None):
    names, params = zip(*m.named_parameters())
    y = forward(m, x, masks)
    return dict(zip(names, torch.autograd.grad(y, list(params), dy)))


def flat(d, names):
    return torch.cat([d[k].detach().double().flatten().cpu() for k in names])


def run(seed):
    torch.manual_seed(seed)
    ref = randomize(reference.ResNetEncoder(C, 64, (1, 1, 1, 1)), seed + 1).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(N, C, H, W, generator=gen)
    dy = away_from_kinks(ref, x, torch.randn(N, 512, H // 32, W // 32, generator=gen) + 1.0)
    _, g64, _ = reference_grads(ref, x, dy)
    names = list(g64)
    enc = kfuse.ResNetEncoder.from_torch(ref).cuda().train()
    _, gk, _ = kfuse_grads(enc, x.cuda().to(torch.bfloat16), dy.cuda())
    mixed = torch_mixed_grads(ref, x, dy, torch.bfloat16, realizations=3)

    m64 = copy.deepcopy(ref).cuda().double()
    m16 = copy.deepcopy(ref).cuda().bfloat16()
    x64, dy64 = x.cuda().double(), dy.cuda().double()
    pre64, pre16 = {}, {}
    with torch.no_grad():
        forward(m64, x64, record=pre64)
        forward(m16, x.cuda().bfloat16(), record=pre16)
    masks16 = {s: pre16[s] > 0 for s in pre64}
    flips = {s: int(((pre64[s] > 0) != masks16[s]).sum()) for s in pre64}
    g64_d = grads(m64, x64, dy64, masks16)  # float64 with PyTorch bf16's decisions

    def errs(g, ref_g):
        return [rel_err(g[k], ref_g[k]) for k in WATCH] + [rel_err(flat(g, names), flat(ref_g, names))]

    print(f"\n== seed {seed}: errors (conv1.weight, fixup_bias1b of block 4, whole) against float64 | against "
          "float64 with PyTorch bf16's ReLU decisions")
    for label, g in [("kfuse", gk), ("torch nchw", mixed[0]), ("torch nhwc", mixed[1]), ("torch native", mixed[2])]:
        a, b = errs(g, g64), errs(g, g64_d)
        print(f"  {label:13s} " + " ".join(f"{v:.1e}" for v in a) + "  |  " + " ".join(f"{v:.1e}" for v in b))
    print("  decisions bf16 != float64: " + ", ".join(f"{s} {n}/{pre64[s].numel()}" for s, n in flips.items() if n))

    # Single flips of block 4's decisions nearest their threshold (conv1's ReLU and the squeeze-excite's).
    base = grads(m64, x64, dy64)
    for site in ("3.h", "3.se", "2.out"):
        p = pre64[site].flatten()
        order = p.abs().argsort()[:5]
        changes = []
        for idx in order.tolist():
            mask = (pre64[site] > 0).flatten().clone()
            mask[idx] = ~mask[idx]
            g = grads(m64, x64, dy64, {site: mask.view_as(pre64[site])})
            changes.append((p[idx].item() / p.pow(2).mean().sqrt().item(), [rel_err(g[k], base[k]) for k in WATCH]))
        print(f"  flip one {site} decision (|pre|/rms; change of conv1.weight, fixup_bias1b): " +
              "; ".join(f"{r:+.1e}: {c[0]:.1e} {c[1]:.1e}" for r, c in changes))


def sweep(first, count, dtype=torch.bfloat16):
    """One line per seed: block 4's fixup_bias1b and conv1.weight errors of kfuse and of PyTorch's worst realization,
    the output errors, and PyTorch's decision flips in block 4's conv1 ReLU; then the medians. dtype as in the
    gradient-accuracy test: bf16 rounds the parameters (the reference runs on them), fp16 keeps them float32."""
    rows = []
    print("seed   kfuse b1b  torch b1b | kfuse w1   torch w1  | kfuse y    torch y   | flips 3.h")
    for seed in range(first, first + count):
        torch.manual_seed(seed)
        ref = randomize(reference.ResNetEncoder(C, 64, (1, 1, 1, 1)), seed + 1)
        if dtype == torch.bfloat16:
            ref = ref.to(torch.bfloat16)
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(N, C, H, W, generator=gen)
        dy = away_from_kinks(ref, x, torch.randn(N, 512, H // 32, W // 32, generator=gen) + 1.0)
        y64, g64, _ = reference_grads(ref, x, dy)
        enc = kfuse.ResNetEncoder.from_torch(ref).cuda().train()
        yk, gk, _ = kfuse_grads(enc, x.cuda().to(ref.stem[1].weight.dtype), dy.cuda())
        y16 = reference_grads(ref, x, dy, dtype=dtype)[0]
        mixed = torch_mixed_grads(ref, x, dy, dtype, realizations=3)
        pre64, pre16 = {}, {}
        with torch.no_grad():
            forward(copy.deepcopy(ref).cuda().double(), x.cuda().double(), record=pre64)
            forward(copy.deepcopy(ref).cuda().to(dtype), x.cuda().to(dtype), record=pre16)
        flips = int(((pre64["3.h"] > 0) != (pre16["3.h"] > 0)).sum())
        r = [rel_err(gk[WATCH[1]], g64[WATCH[1]]), max(rel_err(m[WATCH[1]], g64[WATCH[1]]) for m in mixed),
             rel_err(gk[WATCH[0]], g64[WATCH[0]]), max(rel_err(m[WATCH[0]], g64[WATCH[0]]) for m in mixed),
             rel_err(yk, y64), rel_err(y16, y64)]
        rows.append(r)
        print(f"{seed}  " + "  ".join(f"{v:.2e}" for v in r) + f"  {flips}")
    med = torch.tensor(rows).median(0).values.tolist()
    print("median " + "  ".join(f"{v:.2e}" for v in med))


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--sweep":
        sweep(int(sys.argv[2]), int(sys.argv[3]), torch.float16 if sys.argv[4:] == ["fp16"] else torch.bfloat16)
        sys.exit(0)
    for s in [int(a) for a in sys.argv[1:]] or [2111, 2112, 2113, 2114, 2115]:
        run(s)
