"""kfuse.ResNetEncoder: the SE-ResNet-FixUp encoder as an nn.Module whose forward and backward run kfuse's code.

On CPU tensors it runs the C++ reference (float32 storage, float64 sums; or float64) through a
torch.autograd.Function, so it trains like any module. CUDA tensors need the fused GPU path, which is not built yet.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import nn

from . import _C, reference

__all__ = ["ResNetEncoder"]


def _param_list(module: nn.Module, config) -> list[torch.Tensor]:
    """The module's parameters in the C++ core's order (bps-nav's state_dict order)."""
    named = dict(module.named_parameters())
    return [named[name] for name, _ in _C.param_specs(config)]


class _ReferenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, x, *params):
        ctx.config = config
        ctx.save_for_backward(x, *params)
        y = x.new_empty(_C.output_shape(config, list(x.shape)))
        _C.reference_forward(config, [p.detach() for p in params], x.detach(), y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, *params = ctx.saved_tensors
        grads = [torch.empty_like(p) for p in params]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        _C.reference_backward(ctx.config, [p.detach() for p in params], x.detach(),
                              grad_output.detach().contiguous(), grads, grad_x)
        return (None, grad_x, *[g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:])])


class ResNetEncoder(reference.ResNetEncoder):
    """SE-ResNet-FixUp encoder (bps-nav's se_resnet9_fixup by default) with kfuse's implementation.

    The parameters and ``state_dict`` keys are bps-nav's: ``load_state_dict`` takes a bps-nav backbone's state
    dict as is. Input: (N, in_channels, H, W), H and W multiples of 32; output (N, 8 * base_planes, H/32, W/32).
    """

    def __init__(self, in_channels: int = 3, base_planes: int = 64, layers: Sequence[int] = (1, 1, 1, 1)):
        super().__init__(in_channels, base_planes, layers)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, module: nn.Module) -> "ResNetEncoder":
        """A kfuse encoder with the weights (and dtype, device) of a bps-nav-structured module, e.g. bps-nav's
        ``se_resnet9_fixup(...)`` or :class:`kfuse.reference.ResNetEncoder`."""
        state = module.state_dict()
        specs = [(k, list(v.shape)) for k, v in state.items()]
        try:
            config = _C.infer_config(specs)
        except ValueError as e:
            raise ValueError(f"from_torch: {type(module).__name__} is not a bps-nav SE-ResNet-FixUp encoder: {e}") from None
        enc = cls(*config)
        first = next(iter(state.values()))
        enc.to(device=first.device, dtype=first.dtype)
        enc.load_state_dict(state, strict=True)
        return enc

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, prefix: str = "") -> "ResNetEncoder":
        """Loads a safetensors checkpoint of bps-nav's state_dict (keys optionally under ``prefix``). The network
        is inferred from the tensors; missing, extra, misshapen or mistyped tensors raise kfuse.CheckpointError."""
        path = os.fspath(path)
        enc = cls(*_C.checkpoint_config(path, prefix))
        with torch.no_grad():
            _C.load_checkpoint(path, prefix, enc.config, _param_list(enc, enc.config))
        return enc

    @classmethod
    def default_network(cls, in_channels: int = 3, seed: int = 0) -> "ResNetEncoder":
        """The embedded default network of the benchmark: se_resnet9_fixup with bps-nav's init plus a fixed random
        perturbation (non-zero conv2, FixUp scalars away from 0/1), so that no residual branch is trivially zero."""
        enc = cls(in_channels)
        with torch.no_grad():
            _C.default_params(enc.config, seed, True, _param_list(enc, enc.config))
        return enc

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Saves the parameters as float32 safetensors under bps-nav's names."""
        _C.save_checkpoint(os.fspath(path), self.config,
                           [p.detach().float().cpu().contiguous() for p in _param_list(self, self.config)])

    # -- forward -----------------------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ResNetEncoder expects a torch.Tensor, got {type(x).__name__}")
        _C.output_shape(self.config, list(x.shape))  # rank, channels, spatial size: raises ValueError
        p = self.stem[1].weight
        if x.device != p.device:
            raise ValueError(f"input is on {x.device} but the encoder's parameters are on {p.device}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.device.type == "cuda":
            raise NotImplementedError(
                "kfuse.ResNetEncoder has no CUDA path yet (the fused GPU kernels are being built); run it on CPU "
                "tensors (C++ reference) or use kfuse.reference.ResNetEncoder for a plain PyTorch model on the GPU")
        if x.device.type != "cpu":
            raise NotImplementedError(f"kfuse.ResNetEncoder runs on CPU (and, later, CUDA) tensors, not {x.device}")
        params = _param_list(self, self.config)
        dtype = params[0].dtype
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the CPU reference runs in float32 or float64; the parameters are {dtype} "
                             "(call .float() or .double())")
        if any(p.dtype != dtype for p in params):
            raise ValueError("the encoder's parameters have mixed dtypes; call .float() or .double()")
        if x.dtype != dtype:
            raise ValueError(f"input dtype {x.dtype} does not match the parameters' dtype {dtype}")
        return _ReferenceFunction.apply(self.config, x.contiguous(), *params)
