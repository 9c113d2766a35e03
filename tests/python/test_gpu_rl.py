"""GPU tier: the DD-PPO loop (kfuse.rl) trains alike with kfuse's encoder and with plain PyTorch's, both fp16 on CUDA
(skipped without a CUDA GPU).

Tolerance, from the data: two plain-PyTorch runs that differ only in cuDNN's algorithms (cudnn.benchmark on / off)
give the fp16 noise of this loop (rounding in other orders, and the sampled actions that a logit moved by that
rounding flips). kfuse's run must stay within 3x that noise of the first plain run, losses per iteration and
weights after the run, with a floor of 1e-3 relative for losses (two fp16 roundings of an O(1) value: 2 x 2^-11) and
1e-3 for the weights (the Adam steps of a few iterations, each ~lr = 5e-4 per element, rounded to fp16)."""

import pytest
import torch

import kfuse
from kfuse import rl

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")

ITERATIONS, ENVS, STEPS, SEED = 4, 16, 8, 11


def _run(encoder: str, benchmark: bool):
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = benchmark
    try:
        policy = rl.Policy(encoder=encoder, seed=SEED).to("cuda", torch.float16)
        trainer = rl.PPOTrainer(policy, num_envs=ENVS, steps=STEPS, seed=SEED)
        losses = [trainer.iteration()["loss"] for _ in range(ITERATIONS)]
        weights = torch.cat([m.detach().flatten() for m in trainer.masters])  # fp32 masters
        return losses, weights
    finally:
        torch.backends.cudnn.benchmark = previous


def test_kfuse_and_plain_pytorch_encoders_train_alike_in_fp16():
    (la, wa), (lb, wb), (lk, wk) = _run("torch", False), _run("torch", True), _run("kfuse", False)
    noise_loss = max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(la, lb))
    noise_w = ((wa - wb).norm() / wa.norm()).item()
    for i, (a, k) in enumerate(zip(la, lk)):
        err = abs(k - a) / max(1.0, abs(a))
        assert err <= max(3 * noise_loss, 1e-3), (f"iteration {i}: loss {k} against {a} (relative {err:.2e}; "
                                                   f"plain-PyTorch noise {noise_loss:.2e})")
    err_w = ((wk - wa).norm() / wa.norm()).item()
    assert err_w <= max(3 * noise_w, 1e-3), f"weights off by {err_w:.2e} (plain-PyTorch noise {noise_w:.2e})"
    # The comparison means something only where the updates moved the weights by more than the discrepancy allowed.
    start = torch.cat([p.detach().float().flatten() for p in rl.Policy(encoder="torch", seed=SEED).parameters()])
    moved = ((wa.cpu() - start).norm() / start.norm()).item()
    assert moved >= 3 * max(err_w, noise_w), f"the updates moved the weights by {moved:.2e} only"
