"""CPU tier: the digits accuracy proxy of the low-bit paths (kfuse.digits) on a synthetic stand-in (no scikit-learn
needed): training moves the loss down, the report holds both accuracies and per-block errors against float64 in
fp8's range (e4m3 keeps 3 mantissa bits: a few percent per layer, not more) and in float32's."""

import pytest
import torch

import kfuse
from kfuse import digits


def _synthetic(n=96, classes=4, seed=0):
    """Four classes of 64x64 images told apart by which quadrant is bright, with noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.rand(n, 3, 64, 64, generator=gen) * 0.3
    for i, c in enumerate(y.tolist()):
        r, q = divmod(c, 2)
        x[i, :, 32 * r:32 * r + 32, 32 * q:32 * q + 32] += 0.7
    return digits.split(x, y, 0.25, seed)


def test_training_and_the_fp8_report_on_a_small_task():
    torch.manual_seed(0)
    data = _synthetic()
    model = digits.Classifier(kfuse.ResNetEncoder(3), classes=4)
    losses = digits.train(model, data, steps=12, batch=16, lr=2e-3)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    report = digits.fp8_report(model, data, calibration_batches=2, batch=16)
    assert 0 <= report["accuracy_fp8"] <= 1 and 0 <= report["accuracy"] <= 1
    blocks = set(report["layer_error_fp8"])
    assert "stem" in blocks and "layers.3.0" in blocks
    for name in blocks:
        assert report["layer_error_own_dtype"][name] < 1e-5, name  # float32 against float64
        assert 1e-4 < report["layer_error_fp8"][name] < 0.2, (name, report["layer_error_fp8"][name])


def test_fp8_training_report_trains_both_ways_from_one_seed():
    data = _synthetic()
    report = digits.fp8_training_report(data, steps=3, batch=4, window=2)
    assert len(report["losses_float32"]) == len(report["losses_fp8"]) == 3
    assert report["losses_float32"][0] == pytest.approx(report["losses_fp8"][0], rel=0.2)  # same start, other numerics
    assert report["losses_float32"] != report["losses_fp8"]
    assert 0 <= report["accuracy_fp8"] <= 1 and report["loss_gap_max"] >= 0
