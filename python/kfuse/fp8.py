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

import torch
import torch.nn.functional as F

__all__ = ["FORMATS", "DelayedScaling", "quantize", "scale_from_amax", "conv2d_quantized_reference"]

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
        """(x as the fp8 kernel sees it, the scale used). Per-channel state scales dimension 0 of x."""
        s = self.scale if self.scale.dim() == 0 else self.scale.view(-1, *([1] * (x.dim() - 1)))
        return quantize(x, s, fmt), self.scale.clone()

    def update(self, x: torch.Tensor, fmt: str) -> None:
        """Rolls x's amax (per channel: over every dimension but 0) into the history, then sets the next scale."""
        with torch.no_grad():
            amax = x.detach().abs().float()
            amax = amax.amax() if self.scale.dim() == 0 else amax.reshape(amax.shape[0], -1).amax(1)
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
