"""GPU tier: every parameter gradient of the fused training step is as accurate as PyTorch's own mixed precision
(skipped without a CUDA GPU).

On random problems (in_channels C in {1, 3, 11}, batch N in {1, 33, 100}, inputs 64 x 64 and 96 x 64, fp16 and bf16)
each parameter's gradient, separately, must be within 3x of the error of plain PyTorch in the same dtype, both
measured normwise against float64 PyTorch; or within TOL (the floor of test_gpu_training, 2e-2: fp16 / bf16
activations and activation gradients with fp32 accumulation, which that file justifies), whichever is larger.
PyTorch's error is the largest of three realizations (cuDNN NCHW, cuDNN channels_last, PyTorch's native
convolutions), which round differently (torch_mixed_grads). Unlike test_gpu_training.assert_grads_close, the FixUp
scalars get the same 3x (not TORCH_FACTOR_SCALAR = 10x).

At N = 1 one problem's errors are a lottery of ReLU decisions, so those cases compare medians over SEEDS_N1 problems:
block 4 holds 3072 (96 x 64) conv1 pre-activations per image, a few of them within rounding of zero, and one decision
taken the other way moves the gradient of fixup_bias1b by up to 3e-2 and conv1.weight's by up to 5e-2 (measured,
dev/scalar_grad_diag/relu_decisions.py on an H100). Which of them a realization flips depends on its rounding: over 24
problems of bf16, 96 x 64, C = 11, N = 1, fixup_bias1b's error was 2.6e-3 .. 8.4e-1 for PyTorch's worst realization
and 1.5e-3 .. 5.4e-1 for kfuse, medians 1.8e-2 and 2.4e-2, with kfuse beyond 3x PyTorch on single problems and
PyTorch beyond 3x kfuse on others. In fp16 (24 problems of the same shape) the lottery is rarer but as wide:
fixup_bias1b's error exceeded 1e-2 on 4 problems for kfuse (largest 1.0e-1) and on 7 for PyTorch's worst realization
(largest 3.1e-1), and which problems they were differs (kfuse 2.7e-2 where PyTorch has 4.4e-4, PyTorch 3.0e-2 where
kfuse has 6.2e-5). The median over problems compares the arithmetic; larger N averages the decisions within one
problem. A median still hides up to 4 of 9 problems, so each one must also be finite and within FACTOR x PyTorch's
worst over all of them or LOTTERY_CAP, whichever is larger: 9 problems are too few for PyTorch's worst to bound a
lottery (on the fp16 case's 9, PyTorch never exceeded 6.7e-3 while kfuse reached 3.5e-2, within the 24-problem range
above), so the cap catches what no rounding explains: a gradient further from float64 than zero is.

fp16: float32 parameters computed in fp16 (like autocast); bf16: bfloat16 parameters (the float64 reference then runs
on the same rounded parameters). dL/dy is random with mean 1 (loss_gradient) and zeroed near the last ReLU's threshold
(away_from_kinks), as in test_gpu_training.
"""

import pytest
import torch
from conftest import rel_err

import kfuse
from test_gpu_training import (TOL, away_from_kinks, kfuse_grads, loss_gradient, reference_grads,
                               torch_mixed_grads)

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")

FACTOR = 3.0  # kfuse's error may be at most FACTOR x PyTorch's own (or TOL)
OUT_TOL = 1e-2  # the output, as in test_gpu_training
DEVICE = "cuda"
SEEDS_N1 = 9  # problems per N = 1 case (module docstring)
LOTTERY_CAP = 1.0  # one N = 1 problem's error may reach this (module docstring); 0.84 was PyTorch's largest in bf16


def _loss_gradient(n: int, h: int, w: int, gen: torch.Generator) -> torch.Tensor:
    """loss_gradient (random, mean 1) for an output of n x 512 x h/32 x w/32."""
    if (h, w) == (64, 64):
        return loss_gradient(n, gen)
    return torch.randn(n, 512, h // 32, w // 32, generator=gen) + 1.0


def _cases():
    for precision in (torch.float16, torch.bfloat16):
        for h, w in ((64, 64), (96, 64)):
            for c in (1, 3, 11):
                for n in (1, 33, 100):
                    name = f"{'fp16' if precision == torch.float16 else 'bf16'}-{h}x{w}-c{c}-n{n}"
                    yield pytest.param(precision, h, w, c, n, id=name)


def _errors(make_reference, precision, h, w, c, n, seed):
    """({gradient name: (kfuse's error, PyTorch's worst realization's error)}, whole gradient's pair) of one problem;
    asserts its output."""
    ref = make_reference(in_channels=c, seed=seed)
    if precision == torch.bfloat16:
        ref = ref.to(torch.bfloat16)  # the reference then runs on the same (rounded) parameters, in float64
    enc = kfuse.ResNetEncoder.from_torch(ref).to(DEVICE).train()
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, c, h, w, generator=gen)
    dy = away_from_kinks(ref, x, _loss_gradient(n, h, w, gen))
    y_ref, g_ref, _ = reference_grads(ref, x, dy)
    y, g, _ = kfuse_grads(enc, x.to(DEVICE, ref.stem[1].weight.dtype), dy.to(DEVICE))
    assert y.shape == y_ref.shape
    out_err = rel_err(y, y_ref)
    assert out_err <= OUT_TOL, f"output off by {out_err:.2e} (seed {seed})"
    mixed = torch_mixed_grads(ref, x, dy, precision, realizations=3)
    errs = {}
    for name, want in g_ref.items():
        assert g[name].shape == want.shape, name
        errs[name] = (rel_err(g[name], want), max(rel_err(m[name], want) for m in mixed))

    def flat(d):
        return torch.cat([d[k].detach().double().flatten().cpu() for k in g_ref])

    whole = (rel_err(flat(g), flat(g_ref)), max(rel_err(flat(m), flat(g_ref)) for m in mixed))
    return errs, whole


@pytest.mark.parametrize("precision,h,w,c,n", list(_cases()))
def test_every_gradient_within_3x_of_pytorch_mixed_precision(make_reference, precision, h, w, c, n):
    seed = 2000 + 10 * c + n  # test_gpu_training's (and scripts/grad_calibration.py's) problems at 64 x 64
    seeds = [seed] if n > 1 else [seed + 1000 * i for i in range(SEEDS_N1)]
    runs = [_errors(make_reference, precision, h, w, c, n, s) for s in seeds]
    what = "" if n > 1 else f" (medians over {len(seeds)} problems)"

    def median(values):
        return float(torch.tensor(values).median())

    bad = []
    for name in runs[0][0]:
        err, torch_err = (median([r[0][name][i] for r in runs]) for i in (0, 1))
        bound = max(TOL, FACTOR * torch_err)
        if not err <= bound:  # NaN fails
            bad.append(f"{name}: kfuse {err:.2e}, torch {torch_err:.2e}, bound {bound:.1e}")
        # A median hides a few problems: each must still be finite and within the cap (module docstring).
        worst = max(LOTTERY_CAP, FACTOR * max(r[0][name][1] for r in runs))
        for s, r in zip(seeds, runs):
            if not r[0][name][0] <= worst:
                bad.append(f"{name}, seed {s}: kfuse {r[0][name][0]:.2e}, beyond {worst:.1e}")
    whole, whole_torch = (median([r[1][i] for r in runs]) for i in (0, 1))
    whole_bound = max(TOL, FACTOR * whole_torch)
    if not whole <= whole_bound:
        bad.append(f"whole gradient: kfuse {whole:.2e}, torch {whole_torch:.2e}, bound {whole_bound:.1e}")
    assert not bad, f"{len(bad)} gradients beyond {FACTOR:g}x PyTorch's error (or {TOL}){what}:\n  " + "\n  ".join(bad)
