"""kfuse.ResNetEncoder: the SE-ResNet-FixUp encoder as an nn.Module whose forward and backward run kfuse's code.

On CPU tensors it runs the C++ reference (float32 storage, float64 sums; or float64) through a
torch.autograd.Function, so it trains like any module. On CUDA tensors it runs kfuse's fused kernels: inference through
a CUDA graph per input geometry, training (whenever autograd records) through a torch.autograd.Function whose
backward computes every parameter's gradient with kfuse's backward kernels.
"""

from __future__ import annotations

import operator
import os
from typing import Sequence

import torch
from torch import nn

from . import _C, _script, ops, reference  # noqa: F401  (ops registers torch.ops.kfuse)
from .tuning_table import format_tuning_table, tuning_verdict  # (also importable from here, where they were first)

__all__ = ["ResNetEncoder", "format_tuning_table", "tuning_verdict"]

_NO_AFFINE = ([], [])
_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


def _param_list(module: nn.Module, config) -> list[torch.Tensor]:
    """The module's parameters in the C++ core's order (bps-nav's state_dict order).

    The names resolve once to (owning submodule, attribute) pairs; each call then reads the submodules' current
    parameters directly (a parameter replaced by assignment is seen), instead of walking named_parameters() and
    rebuilding the name list, which cost ~80 us per forward."""
    slots = module.__dict__.get("_kfuse_param_slots")
    if slots is None or slots[0] != config:
        pairs = []
        for name, _ in _C.param_specs(config):
            owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
            pairs.append((module.get_submodule(owner), attr))
        slots = module.__dict__["_kfuse_param_slots"] = (config, pairs)
    return [m._parameters[attr] for m, attr in slots[1]]


_PARAM_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _cuda_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index or 0)


def _current_stash(module, entry, params, stash, x, out_shape, out_dtype, stream) -> int:
    """The stash of the forward that produced `stash`, recomputed from its saved input and parameters where another
    forward replaced it (other parameter tensors bound, or the same input geometry run since)."""
    gpu = entry[0]
    if module._bind(entry, params) or not gpu.stash_valid(stash):
        y = torch.empty(out_shape, dtype=out_dtype, device=x.device)
        ResNetEncoder._stage(entry)
        stash = gpu.forward_train(x, y, stream)
    return stash


class _CudaTrainFunction(torch.autograd.Function):
    """The fused training step: the forward already ran (ResNetEncoder._forward_cuda_train launches it before this
    Function's bookkeeping) and keeps its stash inside the engine (per input geometry); backward writes every
    parameter's gradient into one flat float32 buffer whose views are returned (autograd accumulates them into .grad
    as usual)."""

    @staticmethod
    def forward(ctx, module, entry, launched, x, *params):
        ctx.stash, y, ctx.spec = launched  # (the forward's stash id, output, prepared call): not autograd inputs
        ctx.module, ctx.entry, ctx.out_shape, ctx.out_dtype = module, entry, y.shape, y.dtype
        ctx.save_for_backward(x, *params)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors  # autograd raises here if a parameter was modified in place since forward
        gpu = ctx.entry[0]
        stream = _cuda_stream(x.device)
        ctx.stash = _current_stash(ctx.module, ctx.entry, params, ctx.stash, x, ctx.out_shape, ctx.out_dtype, stream)
        dy = dy.to(ctx.out_dtype).contiguous()
        sizes = [p.numel() for p in params]
        grads = _gradient_buffer(ctx.entry, sum(sizes), params[0].dtype, x.device)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[3] else None
        gpu.run_backward(ctx.spec, -1, ctx.stash, x.data_ptr(), dy.data_ptr(), grads.data_ptr(),
                         0 if dx is None else dx.data_ptr(), stream)
        if params[0].dtype != torch.float32:
            grads = grads.to(params[0].dtype)  # one cast for all (the parameters share one dtype)
        out = [g.view(p.shape) if need else None
               for g, p, need in zip(torch.split(grads, sizes), params, ctx.needs_input_grad[4:])]
        return (None, None, None, dx, *out)


def _gradient_buffer(entry, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The float32 buffer a backward writes every gradient into. For fp16 / bf16 parameters the engine's own, the
    same every step: only a cast leaves it, and its address is baked into the engine's gradient job table and its
    captured backward graphs (a fresh buffer per step re-uploaded the table from the host, which a CUDA graph
    captured by the caller cannot hold, and moved the graphs' keys). For float32 parameters the gradients are views
    of the buffer, handed to autograd (and kept by it as .grad): a fresh one per step."""
    if dtype == torch.float32:
        return torch.empty(count, dtype=torch.float32, device=device)
    buf = entry[6]
    if buf is None or buf.numel() != count or buf.device != device:
        buf = entry[6] = torch.empty(count, dtype=torch.float32, device=device)
    return buf


class _StagedStep:
    """What one training step's staged backward shares between its nodes (one _CudaTrainStage per backward stage):
    the forward's stash and tensors, then, from the first stage's backward on, dL/dy, the flat float32 gradient
    buffer the stages write and dL/dx."""

    def __init__(self, module, entry, stash, spec, y, x, params, groups):
        self.module, self.entry, self.stash, self.x, self.params, self.groups = module, entry, stash, x, params, groups
        self.spec = spec
        self.y, self.out_shape, self.out_dtype = y, y.shape, y.dtype
        self.need_dx = x.requires_grad
        self.dy = self.grads = self.dx = None

    def begin(self, dy: torch.Tensor) -> None:
        """Before the first stage: the buffers, and the forward again if another one replaced its stash."""
        x = self.x
        self.stream = _cuda_stream(x.device)
        self.stash = _current_stash(self.module, self.entry, self.params, self.stash, x, self.out_shape,
                                    self.out_dtype, self.stream)
        self.dy = dy.to(self.out_dtype).contiguous()
        self.grads = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32, device=x.device)
        self.dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if self.need_dx else None

    def run(self, stage: int) -> None:
        self.entry[0].run_backward(self.spec, stage, self.stash, self.x.data_ptr(), self.dy.data_ptr(),
                                   self.grads.data_ptr(), 0 if self.dx is None else self.dx.data_ptr(), self.stream)

    def released(self, stage: int, needed) -> list:
        """The gradients stage `stage` finalized, as its node's outputs: views of the flat buffer in the parameters'
        dtype (one cast per contiguous run of them)."""
        dtype = self.params[0].dtype
        out = []
        for start, indices in self.groups[stage]:
            sizes = [self.params[i].numel() for i in indices]
            run = self.grads[start:start + sum(sizes)]
            if dtype != torch.float32:
                run = run.to(dtype)
            out += [g.view(self.params[i].shape) for g, i in zip(torch.split(run, sizes), indices)]
        return [g if need else None for g, need in zip(out, needed)]


def _stage_groups(config, params: list[torch.Tensor]) -> list:
    """Per stage of the CUDA training backward: the runs (offset in the flat gradient buffer, parameter indices) of
    consecutive parameters whose gradients that stage finalizes."""
    stage_of = _C.backward_stage_of_parameters(config)
    groups = [[] for _ in range(max(stage_of) + 1)]
    offset = 0
    for i, (p, stage) in enumerate(zip(params, stage_of)):
        runs = groups[stage]
        if runs and runs[-1][1][-1] == i - 1:
            runs[-1][1].append(i)
        else:
            runs.append((offset, [i]))
        offset += p.numel()
    return groups


class _CudaTrainStage(torch.autograd.Function):
    """One backward stage of the training step as its own autograd node (ResNetEncoder(gradient_release=
    "per_block")): the nodes chain from the stem's (input x) through empty float32 links to the last block's, which
    returns the output. Autograd runs their backwards last block first; each launches its stage and returns the
    gradients that stage finalized, so autograd accumulates them, and DistributedDataParallel's hooks start their
    all-reduce, while the earlier stages still compute. The forward ran before (ResNetEncoder._forward_cuda_train)."""

    @staticmethod
    def forward(ctx, step, stage, link, *params):
        ctx.step, ctx.stage = step, stage
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(link, *params) if stage == len(step.groups) - 1 else ctx.save_for_backward(*params)
        if stage == 0:
            y, step.y = step.y, None  # (the step must not hold y: y -> its node -> the step would be a cycle)
            return y
        return torch.empty(0, dtype=torch.float32, device=step.x.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        step, stage = ctx.step, ctx.stage
        _ = ctx.saved_tensors  # autograd raises here if one of them was modified in place since the forward
        if stage == 0:
            step.begin(grad if grad is not None else torch.zeros(step.out_shape, dtype=step.out_dtype,
                                                                 device=step.x.device))
        step.run(stage)
        grads = step.released(stage, ctx.needs_input_grad[3:])
        stem = stage == len(step.groups) - 1
        link = step.dx if stem else torch.empty(0, dtype=torch.float32, device=step.x.device)
        if stem:  # the step is done: its buffers go (the gradients returned keep what they view); begin() makes
            step.dy = step.grads = step.dx = None  # new ones for another backward through a retained graph
        return (None, None, link, *grads)


class ResNetEncoder(reference.ResNetEncoder):
    """SE-ResNet-FixUp encoder (bps-nav's se_resnet9_fixup by default) with kfuse's implementation.

    The parameters and ``state_dict`` keys are bps-nav's: ``load_state_dict`` takes a bps-nav backbone's state
    dict as is. Input: (N, in_channels, H, W), H and W multiples of 32; output (N, 8 * base_planes, H/32, W/32).

    ``gpu_options``: the CUDA engine's code-path choices by name (the fields of ``kfuse::EncoderOptions``,
    include/kfuse/encoder_options.h, as ints), for A/B measurements and tests; the defaults are the measured fastest.

    ``gradient_release``: when the CUDA training backward hands the parameters' gradients to autograd: ``"at_end"``
    (all at once when the backward is done) or ``"per_block"`` (each block's as soon as its backward is done, the
    last block's first, so that DistributedDataParallel's all-reduce of them overlaps the rest of the backward; give
    DDP buckets smaller than a block's gradients, e.g. ``bucket_cap_mb=2``). The gradients are the same. Eager
    training only: under torch.compile the encoder's backward op hands on every gradient at its end.
    """

    GRADIENT_RELEASE = ("at_end", "per_block")

    def __init__(self, in_channels: int = 3, base_planes: int = 64, layers: Sequence[int] = (1, 1, 1, 1),
                 gpu_options: dict[str, int] | None = None, gradient_release: str = "at_end"):
        super().__init__(in_channels, base_planes, layers)
        self.gpu_options = dict(gpu_options or {})
        if gradient_release not in self.GRADIENT_RELEASE:
            raise ValueError(f"gradient_release must be one of {self.GRADIENT_RELEASE}, got {gradient_release!r}")
        self.gradient_release = gradient_release
        self._kfuse_uid = _script.register(self)

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

    def set_input_normalization(self, mean=None, var=None) -> None:
        """Normalization of uint8 renderer input (N, H, W, C or C+1): v = (x / 255 - mean) * rsqrt(max(var, 1e-2))
        per channel, folded into the stem's input read on the GPU (exact). None restores plain x / 255. Takes effect
        at once, also in CUDA graphs captured around the module before (the map is read from device memory when a
        graph replays): where a CUDA engine reads uint8 input, the new map is written to it now (synchronous; not
        during a capture)."""
        if (mean is None) != (var is None):
            raise ValueError("give both mean and var, or neither")
        if mean is not None:
            mean = torch.as_tensor(mean, dtype=torch.float64).flatten().cpu()
            var = torch.as_tensor(var, dtype=torch.float64).flatten().cpu()
            if mean.numel() != self.in_channels or var.numel() != self.in_channels:
                raise ValueError(f"mean and var need {self.in_channels} values each, got {mean.numel()} and {var.numel()}")
        self._input_norm = None if mean is None else (mean, var)
        # Engines that run uint8 input get the new map now, not at their next call through this module: a replay of
        # a graph captured around the module runs no Python and would read the old one.
        affine = self._uint8_affine()
        for entry in self.__dict__.get("_gpu_engines", {}).values():
            if entry[2] != _NO_AFFINE and entry[2] != affine:
                entry[0].set_input_affine(*affine)
                entry[2] = affine

    def _uint8_affine(self) -> tuple[list[float], list[float]]:
        # Every uint8 call reads it: computed once per normalization (five small tensor ops, ~20 us of host time),
        # kept with the normalization it came from.
        norm = getattr(self, "_input_norm", None)
        cached = self.__dict__.get("_uint8_affine_cache")
        if cached is not None and cached[0] is norm:
            return cached[1]
        if norm is None:
            affine = [1 / 255] * self.in_channels, [0.0] * self.in_channels
        else:
            mean, var = norm
            inv = torch.rsqrt(var.clamp_min(1e-2))
            affine = (inv / 255).tolist(), (-mean * inv).tolist()
        self.__dict__["_uint8_affine_cache"] = (norm, affine)
        return affine

    def _as_nchw(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 renderer input (N, H, W, C or C+1 with alpha) -> an (N, C, H, W) view; other inputs as they are."""
        if x.dtype != torch.uint8:
            return x
        if x.dim() != 4 or x.shape[-1] not in (self.in_channels, self.in_channels + 1):
            raise ValueError(f"uint8 input is read as the renderer's NHWC images (N, H, W, {self.in_channels} or "
                             f"{self.in_channels + 1}); got shape {tuple(x.shape)}")
        return x.permute(0, 3, 1, 2)[:, : self.in_channels]

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TorchScript compiles the first branch only: the module's work stays in Python (_forward_python), which a
        # scripted program calls back into (kfuse/_script.py; the stem's weight lets it check whose parameters those
        # are). Eager calls and torch.compile take the second, with no extra attribute lookups on the hot path.
        if torch.jit.is_scripting():
            return self._forward_python(x, self.stem[1].weight)
        return self._forward(x)

    @torch.jit.ignore
    def _forward_python(self, x, witness):  # unannotated: TorchScript takes them as Tensors -> Tensor
        return _script.python_module(self, ResNetEncoder, witness, lambda m: m.stem[1].weight)._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ResNetEncoder expects a torch.Tensor, got {type(x).__name__}")
        x = self._as_nchw(x)
        if torch.compiler.is_compiling():
            # Traced by torch.compile / torch.export: the dispatcher's op (CPU or CUDA), with plain-Python checks
            # only; uint8 input normalized by traced PyTorch ops. The training forward keeps the backward's stash.
            params = list(self.parameters())
            x = self._cpu_input(x, params[0].dtype)
            if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
                return torch.ops.kfuse.encoder_forward(x, params, *self._op_config(), True)
            return torch.ops.kfuse.encoder_infer(x, params, *self._op_config())
        if x.device.type == "cuda":
            return self._forward_cuda(x)
        self._check_input(x)
        if x.device.type != "cpu":
            raise NotImplementedError(f"kfuse.ResNetEncoder runs on CPU and CUDA tensors, not {x.device}")
        params = _param_list(self, self.config)
        dtype = params[0].dtype
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the CPU reference runs in float32 or float64; the parameters are {dtype} "
                             "(call .float() or .double())")
        if any(p.dtype != dtype for p in params):
            raise ValueError("the encoder's parameters have mixed dtypes; call .float() or .double()")
        x = self._cpu_input(x, dtype)
        if x.dtype != dtype:
            raise ValueError(f"input dtype {x.dtype} does not match the parameters' dtype {dtype}")
        return torch.ops.kfuse.encoder_forward(x.contiguous(), params, *self._op_config(), False)

    def _op_config(self) -> tuple[int, int, list[int]]:
        """The encoder's configuration as the dispatcher's ops take it (in_channels, base_planes, layers)."""
        c = self.config
        return c[0], c[1], list(c[2])

    def _cpu_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 renderer input normalized as the stem reads it on the GPU; other inputs as they are."""
        if x.dtype != torch.uint8:
            return x
        dtype = torch.float32 if x.device.type == "cuda" else dtype  # the CUDA op converts to its precision
        norm = getattr(self, "_input_norm", None)
        if norm is None:
            return (x.to(dtype) * (1 / 255)).contiguous()
        inv = torch.rsqrt(norm[1].to(x.device, dtype).clamp_min(1e-2)).view(1, -1, 1, 1)  # as _uint8_affine
        return (x.to(dtype) * (inv / 255) - norm[0].to(x.device, dtype).view(1, -1, 1, 1) * inv).contiguous()

    def __getstate__(self):
        # The cached GPU engines (device memory, CUDA graphs) are rebuilt on demand, never copied or pickled.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        for key in ("_gpu_engines", "_kfuse_last_call", "_kfuse_last_train_call", "_kfuse_fast_call"):
            state.pop(key, None)  # engines, and prepared calls that point into them
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._kfuse_uid = _script.register(self)  # a copy is a module of its own (kfuse/_script.py)

    # -- CUDA inference ------------------------------------------------------------------------------------------
    def _gpu_precision(self) -> torch.dtype:
        """bfloat16 modules run in bfloat16; float16 and float32 modules in float16 (like autocast)."""
        return torch.bfloat16 if self.stem[1].weight.dtype == torch.bfloat16 else torch.float16

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of inference: everything here runs per call, so it avoids per-call allocations beyond the
        # output and re-validates only what can change (the input's geometry is validated once per geometry).
        params = None
        if torch.is_grad_enabled():
            params = _param_list(self, self.config)
            if x.requires_grad or any(p.requires_grad for p in params):
                return self._forward_cuda_train(x, params)
        # The engine reads the parameters' own device memory and checks their bytes on the device at every call
        # (whatever wrote them: an optimizer, a copy through .data, a collective), so the host only has to know that
        # the parameters are still the same tensors. A call like the previous one launches first and checks that
        # afterwards (while the GPU runs): the parameter list (~10 us of Python) leaves the latency's critical path.
        # When a parameter tensor was replaced, the call is redone on the full path below, after the engine rebound:
        # the first launch's output is dropped (stream order makes that safe; the engine keeps the tensors it reads
        # alive).
        fast = self.__dict__.get("_kfuse_fast_call")
        if fast is not None and fast[0] == (x.shape, x.stride(), x.dtype, x.device):
            y = ops.launch_prepared(fast[1], x)
            if params is None:
                params = _param_list(self, self.config)
            if ops.still_bound(fast[1], params):
                return y
        if params is None:
            params = _param_list(self, self.config)
        gpu, spec, y, stream, entry = self._prepared_call(x, params, "_kfuse_last_call")
        self._stage(entry)
        gpu.run(spec, x.data_ptr(), y.data_ptr(), stream)
        prepared = ops.prepared_inference(gpu, spec, x, y, entry, params[0].dtype)
        self.__dict__["_kfuse_fast_call"] = None if prepared is None else (
            (x.shape, x.stride(), x.dtype, x.device), prepared)
        return y

    def _forward_cuda_train(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        # The latency of a training step starts with the host time before the forward's graph launch: validation is
        # cached per input kind (as in _forward_cuda), and the forward runs before autograd's bookkeeping of the
        # inputs (_CudaTrainFunction.apply with every parameter, ~0.1 ms), which then overlaps the GPU's work.
        w_dtype = params[0].dtype
        if w_dtype not in _PARAM_DTYPE_NAMES or any(p.dtype != w_dtype for p in params):
            raise ValueError("training on CUDA needs the parameters in one dtype of float32, float16 or bfloat16; got "
                             + ", ".join(sorted({str(p.dtype) for p in params})))
        gpu, spec, y, stream, entry = self._prepared_call(x, params, "_kfuse_last_train_call")
        self._stage(entry)
        stash = gpu.run_train(spec, x.data_ptr(), y.data_ptr(), stream)
        release = self.__dict__.get("gradient_release", "at_end")
        if release == "at_end":
            return _CudaTrainFunction.apply(self, entry, (stash, y, spec), x, *params)
        if release != "per_block":
            raise ValueError(f"gradient_release must be one of {self.GRADIENT_RELEASE}, got {release!r}")
        return self._staged_backward_chain(entry, stash, spec, y, x, params)

    def _staged_backward_chain(self, entry, stash, spec, y, x, params):
        """y as the end of a chain of _CudaTrainStage nodes, one per backward stage (stem first)."""
        if entry[5] is None:
            entry[5] = _stage_groups(self.config, params)
        groups = entry[5]
        step = _StagedStep(self, entry, stash, spec, y, x, params, groups)
        link = x
        for stage in range(len(groups) - 1, -1, -1):
            link = _CudaTrainStage.apply(step, stage, link, *[params[i] for _, run in groups[stage] for i in run])
        return link

    def _prepared_call(self, x: torch.Tensor, params: list[torch.Tensor], slot: str):
        """(engine, prepared call, new output y, stream, engine entry) for a forward of x: the input is validated
        and the call prepared (full DLPack validation) once per input kind, kept in self.__dict__[slot]; later calls
        of the same kind pass only pointers."""
        w_dtype = params[0].dtype
        key = (x.shape, x.stride(), x.dtype, x.device, w_dtype, params[0].device)
        call = self.__dict__.get(slot)
        if call is None or call[0] != key:
            self._check_input(x)
            if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
                raise ValueError(f"CUDA input must be float32, float16, bfloat16 or uint8, got {x.dtype}")
            precision = torch.bfloat16 if w_dtype == torch.bfloat16 else torch.float16
            out_dtype = torch.float32 if w_dtype == torch.float32 else precision
            out_shape = tuple(_C.output_shape(self.config, list(x.shape)))
            call = [key, precision, out_dtype, out_shape, x.device.index or 0, None, None]
            self.__dict__[slot] = call
        _, precision, out_dtype, out_shape, index, spec, spec_engine = call
        entry = self._gpu_engine(x.device, precision, params)
        gpu = entry[0]
        affine = self._uint8_affine() if x.dtype == torch.uint8 else _NO_AFFINE
        if entry[2] != affine:  # changing it recaptures the CUDA graphs: keep it while the input kind stays
            gpu.set_input_affine(*affine)
            entry[2] = affine
        y = torch.empty(out_shape, dtype=out_dtype, device=x.device)
        if spec is None or spec_engine is not gpu:
            call[5] = spec = gpu.prepare_call(x, y)
            call[6] = gpu
        return gpu, spec, y, torch._C._cuda_getCurrentRawStream(index), entry

    # -- tuning ----------------------------------------------------------------------------------------------------
    def tune(self, batch: int = 128, height: int = 64, width: int = 64, mode: str = "retune",
             device: torch.device | str | None = None, verbose: bool = True, training: bool = False) -> list[dict]:
        """Times every candidate kernel of every convolution of this network at (batch, height, width) on the GPU
        and keeps the fastest correct one (kfuse's autotuner); choices persist in the tuning cache
        ($KFUSE_CACHE_DIR, else ~/.cache/kfuse), so later processes start tuned. mode: 'retune' (time again) or
        'on' (reuse cached choices). training=True also tunes the training step's backward convolutions (weight and
        data gradients, cuDNN's algorithms among the candidates). Returns one dict per convolution: op, shape, default
        and chosen kernel, their median times (ms), the spread and cuDNN's best time where cuDNN is a candidate;
        prints a table when verbose."""
        if mode not in ("on", "retune"):
            raise ValueError(f"mode must be 'on' or 'retune', got {mode!r}")
        device = torch.device(device) if device is not None else self.stem[1].weight.device
        if device.type != "cuda":
            raise ValueError(f"tuning needs the encoder on a CUDA device (or device='cuda'), got {device}")
        _C.output_shape(self.config, [batch, self.in_channels, height, width])  # validates the geometry
        params = _param_list(self, self.config)
        w_dtype = params[0].dtype
        precision = torch.bfloat16 if w_dtype == torch.bfloat16 else torch.float16
        gpu = self._gpu_engine(device, precision, params)[0]

        def progress(done, total, row):
            if verbose:
                bar = "#" * (20 * done // total)
                print(f"\r[kfuse tune] [{bar:<20}] {done}/{total} {row['shape']}", end="" if done < total else "\n",
                      flush=True)

        rows = gpu.tune(batch, height, width, mode, progress, training)
        if verbose:
            print(format_tuning_table(rows))
        return rows

    def _gpu_engine(self, device: torch.device, precision: torch.dtype, params: list[torch.Tensor]):
        """[engine, bound pointers, input affine, tensors kept alive, staged copies, backward stage groups, float32
        gradient buffer] for (device, precision): a cached _C.EncoderGpu bound to the parameters' device memory (it follows every write to
        them by itself)."""
        key = (device.index, precision)
        engines = self.__dict__.setdefault("_gpu_engines", {})
        entry = engines.get(key)
        if entry is None:
            name = "float16" if precision == torch.float16 else "bfloat16"
            options = self.__dict__.get("gpu_options") or {}
            entry = engines[key] = [_C.EncoderGpu(self.config, name, device.index or 0, options), None, _NO_AFFINE,
                                    None, None, None, None]
        if all(p.device == device for p in params):
            self._bind(entry, params)
        else:
            # Parameters elsewhere (tuning a CPU module on a GPU): their values are copied from the host, whenever a
            # parameter's storage or version moved.
            stamp = ("host", list(map(_DATA_PTR, params)), list(map(_VERSION, params)))
            if entry[1] != stamp:
                with torch.no_grad():
                    entry[0].set_weights([p.detach().float().cpu().contiguous() for p in params])
                entry[1], entry[3], entry[4] = stamp, list(params), None
        return entry

    @staticmethod
    def _bind(entry, params: list[torch.Tensor]) -> bool:
        """Binds the parameters' device memory to the engine, unless it is bound to exactly these tensors' storages
        already; returns whether it bound. The engine then fingerprints their bytes on the device at every forward
        and repacks what changed. A non-contiguous parameter (e.g. a channels_last filter) is read through a
        contiguous copy that _stage refreshes before every launch."""
        ptrs = list(map(_DATA_PTR, params))
        if entry[1] == ptrs:
            return False
        for (name, shape), p in zip(_C.param_specs(entry[0].config), params):  # the engine reads shape's bytes
            if tuple(p.shape) != tuple(shape):
                raise ValueError(f"parameter {name} has shape {tuple(p.shape)}, but the network needs {tuple(shape)}")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _PARAM_DTYPE_NAMES:
            raise ValueError("the encoder's parameters must share one dtype of float32, float16 or bfloat16; got "
                             + ", ".join(sorted(map(str, dtypes))))
        with torch.inference_mode(False):  # staged copies are written again outside inference mode
            src = [p.detach() if p.is_contiguous() else p.detach().contiguous() for p in params]
        entry[0].set_weights_device([t.data_ptr() for t in src], _PARAM_DTYPE_NAMES[params[0].dtype], 0)
        entry[1] = ptrs
        entry[3] = list(params) + src  # the bound storages stay alive while the engine reads them
        entry[4] = [(s, p) for s, p in zip(src, params) if not p.is_contiguous()] or None
        return True

    @staticmethod
    def _stage(entry) -> None:
        """Refreshes the contiguous copies of non-contiguous parameters (on the current stream, before a launch)."""
        if entry[4]:
            with torch.no_grad():
                for copy, p in entry[4]:
                    copy.copy_(p)
