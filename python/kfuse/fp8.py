"""fp8 scaling for kfuse's low-bit paths, in the style of Transformer Engine's delayed scaling: every tensor that is
cast to fp8 (e4m3 for weights and activations, e5m2 for gradients) has a scale, computed on the device from a history
of its absolute maxima (amax) so that no step waits for the host; the cast saturates at the format's largest finite
value instead of overflowing to NaN. Also the float64 reference of the quantized math that the fp8 kernels are
tested against: the same scales, the same roundings, then exact arithmetic.

    scaling = DelayedScaling(history=16, margin=0)
    q, s = scaling.quantize(x, "e4m3")       # q: the dequantized values the kernel sees (x's dtype), s: the scale used
    scaling.update(x)                         # amax of x into the history; the next scale from it
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FORMATS", "DelayedScaling", "quantize", "scale_from_amax", "conv2d_quantized_reference", "calibrate",
           "fp8_convolutions", "fp8_training"]

# format name -> (torch dtype, largest finite value)
FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}


def _format(fmt: str):
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0, previous: torch.Tensor | None = None):
    """The scale that maps |x| <= amax onto the format's range, divided by 2**margin: fmax / amax / 2**margin.
    Where amax is 0 or not finite (an all-zero tensor, an overflow upstream) the previous scale is kept (1 without
    one). Elementwise on the device: amax may hold one value per channel."""
    _, fmax = _format(fmt)
    amax = amax.float()
    fresh = fmax / amax / (2.0 ** margin)
    keep = previous.float() if previous is not None else torch.ones_like(amax)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, fresh, keep)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded as the fp8 kernels see it, in x's dtype: q = cast_fp8(clamp(x * scale, +-fmax)) / scale. `scale` is a
    scalar tensor or broadcasts against x (per-output-channel weight scales: shape (K, 1, 1, 1) for a KCRS filter).
    Saturating: a value beyond the range becomes +-fmax (torch's cast would give NaN)."""
    dtype, fmax = _format(fmt)
    s = scale.to(torch.float32)
    y = (x.float() * s).clamp(-fmax, fmax).to(dtype).float() / s
    return y.to(x.dtype)


class DelayedScaling:
    """One tensor's scale from the amax of its last `history` casts (the largest of them), with a `margin` of 2**margin
    headroom. State lives on the tensor's device; update() and quantize() never synchronize with the host, so they can
    run inside a captured CUDA graph (the history is updated in place).

    The current cast uses the scale from earlier steps: a spike beyond them saturates this step (the values clamp to
    the format's maximum, not NaN) and lowers the scale from the next step on."""

    def __init__(self, history: int = 16, margin: int = 0, device=None, channels: int | None = None):
        if history < 1:
            raise ValueError(f"the amax history needs at least one entry, got {history}")
        shape = (history,) if channels is None else (history, channels)
        self.margin = margin
        self.amax_history = torch.zeros(shape, device=device)
        self.scale = torch.ones(shape[1:], device=device)

    def quantize(self, x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x as the fp8 kernel sees it, the scale used). Per-channel state scales dimension 0 of x. Before any amax
        was recorded (an empty history) the scale comes from x's own amax instead of the default 1, so that a first
        step's gradients (amax ~1e-4) do not flush to zero; on the device, without a host synchronisation."""
        scale = torch.where(self.amax_history.amax(0) > 0, self.scale, scale_from_amax(self._amax(x), fmt))
        s = scale if scale.dim() == 0 else scale.view(-1, *([1] * (x.dim() - 1)))
        return quantize(x, s, fmt), scale

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().abs().float()
        return a.amax() if self.scale.dim() == 0 else a.reshape(a.shape[0], -1).amax(1)

    def update(self, x: torch.Tensor, fmt: str) -> None:
        """Rolls x's amax (per channel: over every dimension but 0) into the history, then sets the next scale."""
        with torch.no_grad():
            amax = self._amax(x)
            rolled = torch.roll(self.amax_history, 1, dims=0)
            rolled[0] = amax
            self.amax_history.copy_(rolled)
            self.scale.copy_(scale_from_amax(self.amax_history.amax(0), fmt, self.margin, self.scale))


def conv2d_quantized_reference(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                               stride: int = 1, padding: int = 1, fmt: str = "e4m3") -> torch.Tensor:
    """The float64 reference of an fp8 convolution: x quantized with its per-tensor scale, w (KCRS) with its per-
    output-channel scales (shape (K,)), then the convolution in float64 (exact against the kernels' fp32 sums up to
    their rounding)."""
    xq = quantize(x.double(), x_scale.double(), fmt)
    wq = quantize(w.double(), w_scale.double().view(-1, 1, 1, 1), fmt)
    return F.conv2d(xq, wq, stride=stride, padding=padding)


@torch.no_grad()
def calibrate(model: nn.Module, batches, percentile: float | None = None) -> dict[str, torch.Tensor]:
    """Per-tensor activation ranges for fp8 inference: the input of every nn.Conv2d of `model` (a plain-PyTorch
    network such as kfuse.reference.ResNetEncoder), over the calibration `batches` (an iterable of inputs). The range
    is the largest |x| seen, or with `percentile` (e.g. 99.99) the largest over batches of that percentile of |x|
    (outliers saturate instead of costing the rest of the tensor its resolution). Returns {conv name: amax}."""
    if percentile is not None and not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, inputs):
            a = inputs[0].detach().abs().float()
            if percentile is None or percentile == 100:
                v = a.amax()
            else:  # (torch.quantile is limited to 2^24 elements: kthvalue on the flattened tensor)
                flat = a.flatten()
                v = flat.kthvalue(max(1, int(round(flat.numel() * percentile / 100)))).values
            amax[name] = torch.maximum(amax[name], v) if name in amax else v
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if not handles:
        raise ValueError("calibrate: the model has no nn.Conv2d")
    try:
        seen = 0
        for x in batches:
            model(x)
            seen += 1
        if seen == 0:
            raise ValueError("calibrate: no calibration batch was given")
    finally:
        for h in handles:
            h.remove()
    return amax


@contextlib.contextmanager
def fp8_convolutions(model: nn.Module, amax: dict[str, torch.Tensor], fmt: str = "e4m3"):
    """Inside the context every nn.Conv2d of `model` computes as an fp8 tensor-core convolution does: its input
    quantized with the per-tensor scale from `amax` (calibrate's), its filter with per-output-channel scales from the
    filter's own ranges, products summed in fp32 or wider, the output in the model's dtype. Everything else (FixUp
    scalars, squeeze-excite, residual) stays as it is. The accuracy of fp8 inference before (and as the reference of)
    the fp8 kernels."""
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    missing = sorted(set(convs) - set(amax))
    if missing:
        raise ValueError(f"fp8_convolutions: no calibrated range for {missing[:3]}{'...' if len(missing) > 3 else ''}")
    originals = {}

    def quantized_forward(conv: nn.Conv2d, a: torch.Tensor):
        def forward(x):
            w = conv.weight
            w_amax = w.detach().abs().float().reshape(w.shape[0], -1).amax(1)
            w_scale = scale_from_amax(w_amax, fmt).view(-1, 1, 1, 1)
            xq = quantize(x.float(), scale_from_amax(a.to(x.device), fmt), fmt)
            wq = quantize(w.float(), w_scale.to(w.device), fmt)
            y = F.conv2d(xq, wq, None if conv.bias is None else conv.bias.float(), conv.stride, conv.padding,
                         conv.dilation, conv.groups)
            return y.to(x.dtype)
        return forward

    try:
        for name, conv in convs.items():
            originals[name] = conv.forward
            conv.forward = quantized_forward(conv, amax[name])
        yield model
    finally:
        for name, conv in convs.items():
            if name in originals:
                del conv.forward  # the class's forward again


class _Fp8Conv2d(torch.autograd.Function):
    """nn.Conv2d as an fp8 training step computes it (Transformer Engine's recipe): the input in e4m3 with its
    delayed per-tensor scale, the filter in e4m3 with per-output-channel scales from its current values, dL/dy in
    e5m2 with its delayed scale; the forward, the data gradient and the weight gradient each from those quantized
    operands with fp32 sums; the results in the module's dtype."""

    @staticmethod
    def forward(ctx, x, w, bias, conv, state, fmts):
        act_fmt, weight_fmt, _ = fmts
        xq, _ = state["x"].quantize(x.float(), act_fmt)
        state["x"].update(x, act_fmt)
        w_amax = w.detach().abs().float().reshape(w.shape[0], -1).amax(1)
        wq = quantize(w.float(), scale_from_amax(w_amax, weight_fmt).view(-1, 1, 1, 1), weight_fmt)
        ctx.save_for_backward(xq, wq)
        ctx.conv, ctx.state, ctx.fmts, ctx.dtypes = conv, state, fmts, (x.dtype, w.dtype)
        ctx.has_bias = bias is not None
        y = F.conv2d(xq, wq, None if bias is None else bias.float(), conv.stride, conv.padding, conv.dilation,
                     conv.groups)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        conv, grad_fmt = ctx.conv, ctx.fmts[2]
        dyq, _ = ctx.state["dy"].quantize(dy.float(), grad_fmt)
        ctx.state["dy"].update(dy, grad_fmt)
        args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        dx = torch.nn.grad.conv2d_input(xq.shape, wq, dyq, *args) if ctx.needs_input_grad[0] else None
        dw = torch.nn.grad.conv2d_weight(xq, wq.shape, dyq, *args) if ctx.needs_input_grad[1] else None
        db = dyq.sum((0, 2, 3)).to(ctx.dtypes[1]) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (None if dx is None else dx.to(ctx.dtypes[0]), None if dw is None else dw.to(ctx.dtypes[1]), db,
                None, None, None)


@contextlib.contextmanager
def fp8_training(model: nn.Module, history: int = 16, margin: int = 0, act_fmt: str = "e4m3",
                 weight_fmt: str = "e4m3", grad_fmt: str = "e5m2"):
    """Inside the context every nn.Conv2d of `model` trains as an fp8 tensor-core convolution would (_Fp8Conv2d):
    the reference of kfuse's fp8 training, and its accuracy before the kernels. Each convolution keeps a delayed-
    scaling state for its input and for its output gradient (`history` amaxes, 2**margin headroom), on the device.
    Yields {conv name: {"x": DelayedScaling, "dy": DelayedScaling}}."""
    for fmt in (act_fmt, weight_fmt, grad_fmt):
        _format(fmt)
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    if not convs:
        raise ValueError("fp8_training: the model has no nn.Conv2d")
    fmts = (act_fmt, weight_fmt, grad_fmt)
    states = {}
    for name, conv in convs.items():
        device = conv.weight.device
        states[name] = {"x": DelayedScaling(history, margin, device), "dy": DelayedScaling(history, margin, device)}

    def fp8_forward(conv: nn.Conv2d, state: dict):
        return lambda x: _Fp8Conv2d.apply(x, conv.weight, conv.bias, conv, state, fmts)

    try:
        for name, conv in convs.items():
            conv.forward = fp8_forward(conv, states[name])
        yield states
    finally:
        for conv in convs.values():
            conv.__dict__.pop("forward", None)  # the class's forward again
