"""kfuse's operations in PyTorch's dispatcher (torch.library), so that TorchScript, torch.compile and torch.export
see them as ordinary ops: pure functions of their tensors (the parameters are arguments; no hidden state decides which
weights are used), with fake (meta) implementations for tracing and autograd formulas.

    torch.ops.kfuse.encoder_forward(x, params, in_channels, base_planes, layers) -> y
    torch.ops.kfuse.encoder_backward(x, params, grad_output, in_channels, base_planes, layers, input_grad)
        -> [grad of every parameter..., grad_x if input_grad]

`params` are the encoder's parameters in bps-nav's state_dict order (kfuse.ResNetEncoder.parameters()). Implemented
for CPU tensors (kfuse's C++ reference: float32 storage with float64 sums, or float64); the CUDA implementations come
with the engines' binding to these ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C

__all__ = ["encoder_forward", "encoder_backward", "encoder_output_shape"]


def encoder_output_shape(x_shape, base_planes: int) -> list[int]:
    """(N, 8 * base_planes, H / 32, W / 32): the encoder's output for an (N, C, H, W) input (plain Python, so that
    tracing needs no call into the extension)."""
    n, _, h, w = x_shape
    return [n, 8 * base_planes, h // 32, w // 32]


def _config(in_channels: int, base_planes: int, layers: list[int]):
    return (int(in_channels), int(base_planes), tuple(int(v) for v in layers))


@torch.library.custom_op("kfuse::encoder_forward", mutates_args=())
def encoder_forward(x: Tensor, params: list[Tensor], in_channels: int, base_planes: int,
                    layers: list[int]) -> Tensor:
    config = _config(in_channels, base_planes, layers)
    shape = _C.output_shape(config, list(x.shape))  # validates rank, channels and the spatial size
    if x.device.type != "cpu":
        raise NotImplementedError(f"kfuse::encoder_forward has no implementation for {x.device.type} tensors yet; "
                                  "call kfuse.ResNetEncoder")
    y = x.new_empty(shape)
    _C.reference_forward(config, [p.detach().contiguous() for p in params], x.detach().contiguous(), y)
    return y


@encoder_forward.register_fake
def _encoder_forward_fake(x, params, in_channels, base_planes, layers):
    torch._check(x.dim() == 4, lambda: f"kfuse::encoder_forward expects an (N, C, H, W) input, got {x.dim()} dims")
    return x.new_empty(encoder_output_shape(x.shape, base_planes))


@torch.library.custom_op("kfuse::encoder_backward", mutates_args=())
def encoder_backward(x: Tensor, params: list[Tensor], grad_output: Tensor, in_channels: int, base_planes: int,
                     layers: list[int], input_grad: bool) -> list[Tensor]:
    config = _config(in_channels, base_planes, layers)
    if x.device.type != "cpu":
        raise NotImplementedError(f"kfuse::encoder_backward has no implementation for {x.device.type} tensors yet; "
                                  "call kfuse.ResNetEncoder")
    grads = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else None
    _C.reference_backward(config, [p.detach().contiguous() for p in params], x.detach().contiguous(),
                          grad_output.detach().to(x.dtype).contiguous(), grads, grad_x)
    return grads + ([grad_x] if input_grad else [])


@encoder_backward.register_fake
def _encoder_backward_fake(x, params, grad_output, in_channels, base_planes, layers, input_grad):
    return [torch.empty_like(p) for p in params] + ([torch.empty_like(x)] if input_grad else [])


def _forward_setup(ctx, inputs, output):
    x, params, in_channels, base_planes, layers = inputs
    ctx.save_for_backward(x, *params)
    ctx.config = (in_channels, base_planes, list(layers))


def _forward_backward(ctx, grad_output):
    x, *params = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    out = encoder_backward(x, params, grad_output, *ctx.config, input_grad)
    grads = out[: len(params)]
    return (out[-1] if input_grad else None), grads, None, None, None


encoder_forward.register_autograd(_forward_backward, setup_context=_forward_setup)
