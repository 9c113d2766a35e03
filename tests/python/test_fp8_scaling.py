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


def _small_encoder():
    from kfuse import reference
    torch.manual_seed(0)
    enc = reference.ResNetEncoder(3).double().eval()
    for name, p in enc.named_parameters():  # FixUp starts some scalars at 0: random ones exercise every path
        if "fixup" in name:
            p.data.normal_(0, 0.1)
    return enc


def test_calibrate_records_every_convolutions_input_range():
    enc = _small_encoder()
    xs = [torch.rand(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    amax = fp8.calibrate(enc, xs)
    convs = [n for n, m in enc.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert sorted(amax) == sorted(convs)
    stem = next(n for n in convs if n.startswith("stem"))
    assert amax[stem] == max(x.abs().max() for x in xs).float()  # the stem's input is the image (space-to-depth moves it)
    p50 = fp8.calibrate(enc, xs, percentile=50)
    assert all(p50[n] <= amax[n] for n in convs) and any(p50[n] < amax[n] for n in convs)
    with pytest.raises(ValueError, match="percentile"):
        fp8.calibrate(enc, xs, percentile=0)


def test_fp8_convolutions_compute_the_quantized_reference_and_restore_the_model():
    """Inside the context a convolution is conv2d_quantized_reference of its operands (the fp8 kernels' reference);
    the whole encoder's output moves by fp8's rounding (a few percent, not more), and leaves unchanged afterwards."""
    enc = _small_encoder()
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    amax = fp8.calibrate(enc, [x])
    want = enc(x)
    conv = enc.layers[1][0].conv1
    a = torch.rand(2, conv.in_channels, 8, 8, dtype=torch.float64) * amax["layers.1.0.conv1"]
    w_amax = conv.weight.abs().float().reshape(conv.out_channels, -1).amax(1)
    with fp8.fp8_convolutions(enc, amax):
        got = enc(x)
        one = conv(a)
    ref = fp8.conv2d_quantized_reference(a, conv.weight, fp8.scale_from_amax(amax["layers.1.0.conv1"], "e4m3"),
                                         fp8.scale_from_amax(w_amax, "e4m3"), stride=conv.stride[0])
    torch.testing.assert_close(one, ref, rtol=1e-6, atol=1e-6)  # fp32 sums of the exact fp8 products
    err = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < err < 0.1, err
    assert torch.equal(enc(x), want)
    with pytest.raises(ValueError, match="no calibrated range"):
        with fp8.fp8_convolutions(enc, {}):
            pass


def test_fp8_training_convolution_is_the_quantized_reference_forward_and_backward():
    """Under fp8_training a convolution's output, data gradient and weight gradient are those of the quantized
    operands (input e4m3 per tensor, filter e4m3 per output channel, dL/dy e5m2 per tensor), summed in float64 here;
    the first step scales from the tensors' own amax, the second from the recorded history."""
    gen = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=True).double()
    model = torch.nn.Sequential(conv)
    for step in range(2):
        x = (torch.randn(2, 4, 9, 9, generator=gen, dtype=torch.float64) * (1 + step)).requires_grad_()
        dy = torch.randn(2, 6, 5, 5, generator=gen, dtype=torch.float64) * 1e-4
        with fp8.fp8_training(model) as states:
            if step == 1:
                states["0"]["x"].update(x_prev, "e4m3")  # noqa: F821  (the history of step 0's input)
                states["0"]["dy"].update(dy_prev, "e5m2")  # noqa: F821
            y = model(x)
            y.backward(dy)
        xs = fp8.scale_from_amax((x_prev if step else x).abs().amax(), "e4m3")  # noqa: F821
        gs = fp8.scale_from_amax((dy_prev if step else dy).abs().amax(), "e5m2")  # noqa: F821
        ws = fp8.scale_from_amax(conv.weight.abs().reshape(6, -1).amax(1), "e4m3").view(-1, 1, 1, 1)
        xq, wq, dyq = fp8.quantize(x, xs, "e4m3"), fp8.quantize(conv.weight, ws, "e4m3"), fp8.quantize(dy, gs, "e5m2")
        # The convolution sums in fp32 (as the kernels will): <= 50 terms per sum, so within 50 * 2^-24 ~ 3e-6 of the
        # largest value; 1e-5 of it below.
        for got, want in ((y, torch.nn.functional.conv2d(xq, wq, conv.bias, 2, 1)),
                          (x.grad, torch.nn.grad.conv2d_input(x.shape, wq, dyq, 2, 1)),
                          (conv.weight.grad, torch.nn.grad.conv2d_weight(xq, wq.shape, dyq, 2, 1))):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert not torch.equal(conv.weight.grad, torch.nn.grad.conv2d_weight(x.detach(), wq.shape, dy, 2, 1))
        assert "forward" not in conv.__dict__  # the module's own forward again
        conv.weight.grad = conv.bias.grad = None
        x_prev, dy_prev = x.detach(), dy  # noqa: F841


def test_fp8_training_saturates_a_gradient_spike_and_rescales_after_it():
    """A dL/dy 1e6 times larger than the history's saturates at e5m2's largest value on its own step (finite
    gradients, no NaN) and sets the next step's scale from the spike."""
    conv = torch.nn.Conv2d(2, 3, 3, padding=1, bias=False)
    x = torch.randn(1, 2, 6, 6)
    with fp8.fp8_training(conv) as states:
        for scale in (1e-3, 1e-3, 1e3):
            conv(x).backward(torch.randn(1, 3, 6, 6) * scale)
            assert torch.isfinite(conv.weight.grad).all()
            conv.weight.grad = None
        next_scale = states[""]["dy"].scale
    assert torch.isclose(next_scale, 57344.0 / states[""]["dy"].amax_history.amax(), rtol=1e-6)
    assert states[""]["dy"].amax_history.amax() > 100
