"""CPU tier: fp8 scaling (kfuse/fp8.py): the saturating cast, scales from amax, the delayed-scaling history (a forced
spike saturates one step and lowers the scale from the next), per-channel state, and the quantized reference."""

import pytest
import torch

from kfuse import fp8


@pytest.mark.parametrize("fmt,mantissa_bits", [("e4m3", 3), ("e5m2", 2)])
def test_quantize_rounds_to_half_an_ulp_and_saturates(fmt, mantissa_bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10000, generator=gen, dtype=torch.float64) * 3
    scale = torch.tensor(4.0)
    q = fp8.quantize(x, scale, fmt)
    normal = (x * 4).abs() >= 2.0 ** (-6 if fmt == "e4m3" else -14)  # normal range of the format
    rel = ((q - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-12  # round to nearest: half an ulp
    assert rel.max() > 2.0 ** -(mantissa_bits + 2)  # and it does round (not a no-op)
    fmax = fp8.FORMATS[fmt][1]
    big = torch.tensor([1e9, -1e9, fmax / 4 * 1.5], dtype=torch.float64)
    assert torch.equal(fp8.quantize(big, scale, fmt), torch.tensor([fmax / 4, -fmax / 4, fmax / 4], dtype=torch.float64))


def test_scale_from_amax_keeps_the_previous_scale_where_amax_is_useless():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    prev = torch.tensor([5.0, 6.0, 7.0, 8.0])
    s = fp8.scale_from_amax(amax, "e4m3", margin=1, previous=prev)
    assert torch.allclose(s, torch.tensor([448.0 / 2 / 2, 6.0, 7.0, 8.0]))
    with pytest.raises(ValueError, match="fp8 format"):
        fp8.scale_from_amax(amax, "e3m4")


def test_delayed_scaling_follows_a_spike_one_step_late_and_forgets_it_after_the_history():
    ds = fp8.DelayedScaling(history=4)
    x = torch.full((8,), 2.0)
    ds.update(x, "e4m3")
    assert torch.isclose(ds.scale, torch.tensor(448.0 / 2))
    spike = x.clone()
    spike[3] = 1000.0
    q, used = ds.quantize(spike, "e4m3")  # this step: the old scale; the spike saturates, no NaN
    assert torch.isfinite(q).all() and q[3] == 448.0 / used and q[0] == 2.0
    ds.update(spike, "e4m3")
    assert torch.isclose(ds.scale, torch.tensor(448.0 / 1000.0))  # the next step covers it
    for _ in range(3):
        ds.update(x, "e4m3")
    assert torch.isclose(ds.scale, torch.tensor(448.0 / 1000.0))  # still in the 4-entry history
    ds.update(x, "e4m3")
    assert torch.isclose(ds.scale, torch.tensor(448.0 / 2))  # gone


def test_per_channel_scales_scale_dimension_zero():
    ds = fp8.DelayedScaling(history=2, channels=3)
    w = torch.stack([torch.full((2, 3, 3), v) for v in (1.0, 10.0, 100.0)])
    ds.update(w, "e4m3")
    assert torch.allclose(ds.scale, 448.0 / torch.tensor([1.0, 10.0, 100.0]))
    q, _ = ds.quantize(w, "e4m3")
    assert torch.allclose(q, w)  # each channel's maximum maps onto 448 exactly


def test_conv2d_quantized_reference_is_the_conv_of_the_quantized_operands():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, 6, generator=gen)
    w = torch.randn(5, 4, 3, 3, generator=gen)
    xs = fp8.scale_from_amax(x.abs().amax(), "e4m3")
    ws = fp8.scale_from_amax(w.abs().reshape(5, -1).amax(1), "e4m3")
    y = fp8.conv2d_quantized_reference(x, w, xs, ws)
    want = torch.nn.functional.conv2d(fp8.quantize(x.double(), xs.double(), "e4m3"),
                                      fp8.quantize(w.double(), ws.double().view(-1, 1, 1, 1), "e4m3"), padding=1)
    assert y.dtype == torch.float64 and torch.equal(y, want)
    full = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    err = ((y - full).norm() / full.norm()).item()
    assert 1e-3 < err < 0.1  # fp8 rounding is visible, and bounded (~2^-4 per operand, averaged over 36 terms)
