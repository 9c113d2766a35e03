"""GPU tier: the DD-PPO loop (kfuse.rl) trains alike with kfuse's encoder and with plain PyTorch's, both fp16 on CUDA
(skipped without a CUDA GPU).

Tolerance, from the data: two plain-PyTorch runs that differ only in cuDNN's algorithms (NCHW with the heuristics'
choice; channels-last with cudnn.benchmark: cudnn.benchmark alone picked the very same kernels on an H200) give the
fp16 noise of this loop (rounding in other orders, and the sampled actions that a logit moved by that
rounding flips). kfuse's run must stay within 3x that noise of the first plain run, losses per iteration and
weights after the run, with a floor of 1e-3 relative for losses (two fp16 roundings of an O(1) value: 2 x 2^-11) and
1e-3 for the weights (the Adam steps of a few iterations, each ~lr = 5e-4 per element, rounded to fp16)."""

import pytest

import kfuse
from kfuse.bench_rl import agreement

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")

ITERATIONS, ENVS, STEPS, SEED = 4, 16, 8, 11


def test_kfuse_and_plain_pytorch_encoders_train_alike_in_fp16():
    a = agreement(ITERATIONS, ENVS, STEPS, SEED)
    noise_loss = max(a["loss_noise"])
    for i, err in enumerate(a["loss_diff"]):
        assert err <= max(3 * noise_loss, 1e-3), (f"iteration {i}: loss {a['loss_kfuse'][i]} against "
                                                   f"{a['loss_torch'][i]} (relative {err:.2e}; plain-PyTorch noise "
                                                   f"{noise_loss:.2e})")
    err_w, noise_w = a["weight_diff"], a["weight_noise"]
    assert err_w <= max(3 * noise_w, 1e-3), f"weights off by {err_w:.2e} (plain-PyTorch noise {noise_w:.2e})"
    # The comparison means something only where the updates moved the weights by more than the discrepancy allowed.
    assert a["weight_moved"] >= 3 * max(err_w, noise_w), f"the updates moved the weights by {a['weight_moved']:.2e} only"
