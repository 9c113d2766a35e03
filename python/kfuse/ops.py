"""kfuse's operations in PyTorch's dispatcher (torch.library), so that TorchScript, torch.compile and torch.export
see them as ordinary ops: pure functions of their tensors (the parameters are arguments; no hidden state decides which
weights are used), with fake (meta) implementations for tracing and autograd formulas.

    torch.ops.kfuse.encoder_infer(x, params, in_channels, base_planes, layers) -> y       (not differentiable)
    torch.ops.kfuse.encoder_forward(x, params, in_channels, base_planes, layers, training) -> y
    torch.ops.kfuse.encoder_backward(x, params, grad_output, in_channels, base_planes, layers, input_grad,
                                     output=None) -> [every parameter's gradient, flat, grad_x if input_grad]

`params` are the encoder's parameters in bps-nav's state_dict order (kfuse.ResNetEncoder.parameters()); the output
has their dtype. CPU: kfuse's C++ reference (float32 storage with float64 sums, or float64). CUDA: kfuse's engines,
one per (configuration, device, precision) shared by every caller, bound to the parameters' own device memory (they
check its bytes at every call: no write can leave them stale); float16 and float32 parameters compute in float16,
bfloat16 ones in bfloat16. training=True runs the training forward, which keeps what the backward needs inside the
engine; encoder_backward given that forward's `output` uses it, and recomputes it where another forward replaced it.
encoder_infer is the inference forward with the least host work (what the modules call where no gradient is needed):
an op with no autograd formula, which refuses inputs that require a gradient.
"""

from __future__ import annotations

import atexit

import torch
from torch import Tensor

from . import _C

_NO_AFFINE = ([], [])
_DATA_PTR = Tensor.data_ptr
_PRECISION_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ENGINES: dict = {}  # (config, device index, precision) -> engine entry (kfuse.encoder.ResNetEncoder._gpu_engine's)
_SPECS: dict = {}  # (engine id, input kind) -> the engine's prepared call
_STASHES: dict = {}  # training forward's output data_ptr -> (engine entry, stash id, input data_ptr)
_MAX_STASHES = 64  # forwards whose backward never came: the oldest are dropped (their stash ids go stale anyway)


@atexit.register
def _release_engines() -> None:  # before the interpreter tears the extension down
    _FAST.clear()
    _STASHES.clear()
    _SPECS.clear()
    _ENGINES.clear()

__all__ = ["encoder_infer", "encoder_forward", "encoder_backward", "encoder_output_shape", "mlp_forward", "mlp_backward"]


def encoder_infer(x: Tensor, params: list[Tensor], in_channels: int, base_planes: int, layers: list[int]) -> Tensor:
    return torch.ops.kfuse.encoder_infer(x, params, in_channels, base_planes, layers)


def encoder_output_shape(x_shape, base_planes: int) -> list[int]:
    """(N, 8 * base_planes, H / 32, W / 32): the encoder's output for an (N, C, H, W) input (plain Python, so that
    tracing needs no call into the extension)."""
    n, _, h, w = x_shape
    return [n, 8 * base_planes, h // 32, w // 32]


def _config(in_channels: int, base_planes: int, layers: list[int]):
    return (int(in_channels), int(base_planes), tuple(int(v) for v in layers))


@torch.library.custom_op("kfuse::encoder_forward", mutates_args=(), device_types="cpu")
def encoder_forward(x: Tensor, params: list[Tensor], in_channels: int, base_planes: int,
                    layers: list[int], training: bool) -> Tensor:
    config = _config(in_channels, base_planes, layers)
    shape = _C.output_shape(config, list(x.shape))  # validates rank, channels and the spatial size
    y = x.new_empty(shape)
    _C.reference_forward(config, [p.detach().contiguous() for p in params], x.detach().contiguous(), y)
    return y


@encoder_forward.register_fake
def _encoder_forward_fake(x, params, in_channels, base_planes, layers, training):
    torch._check(x.dim() == 4, lambda: f"kfuse::encoder_forward expects an (N, C, H, W) input, got {x.dim()} dims")
    return x.new_empty(encoder_output_shape(x.shape, base_planes), dtype=params[0].dtype)


# The inference op is registered with torch.library.Library rather than custom_op: custom_op's Python layers
# (autograd wrapper, aliasing checks) cost ~12 us per call with 60 tensor arguments; an autograd fallthrough costs
# nothing, and the kernels refuse what would need a gradient.
_LIB = torch.library.Library("kfuse", "FRAGMENT")
_LIB.define("encoder_infer(Tensor x, Tensor[] params, int in_channels, int base_planes, int[] layers) -> Tensor")
_LIB.impl("encoder_infer", torch.library.fallthrough_kernel, "Autograd")
_FAST: dict = {}  # (input kind, configuration) -> a prepared inference call (_encoder_infer_cuda)


def _refuse_gradients(x: Tensor, params: list[Tensor]) -> None:
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        raise RuntimeError("kfuse::encoder_infer is not differentiable, and an input or parameter requires a gradient: "
                           "call kfuse::encoder_forward (training=True), or run under torch.no_grad()")


def _encoder_infer_cpu(x, params, in_channels, base_planes, layers):
    _refuse_gradients(x, params)
    with torch.no_grad():
        return encoder_forward(x, params, in_channels, base_planes, layers, False)


# The launch-first hot path of the inference forward, shared by the module (ResNetEncoder._forward_cuda) and
# encoder_infer: a call like the previous one launches on its prepared call first and checks afterwards (while the GPU
# runs) that the parameters are still the tensors the engine is bound to; otherwise the caller redoes the call on the
# full path, after the engine rebound (the first launch's output is dropped; stream order makes that safe).
def prepared_inference(gpu, spec, x: Tensor, y: Tensor, entry, w_dtype):
    """What launch_prepared and still_bound need, or None where the full path must run every call: uint8 input
    (it also depends on the engine's input affine) and non-contiguous parameters (staged before each launch)."""
    if x.dtype == torch.uint8 or entry[4]:
        return None
    return (gpu, spec, y.shape, y.dtype, x.device.index or 0, entry, entry[1], w_dtype)


def launch_prepared(prepared, x: Tensor) -> Tensor:
    gpu, spec, out_shape, out_dtype, index = prepared[:5]
    y = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    gpu.run(spec, x.data_ptr(), y.data_ptr(), torch._C._cuda_getCurrentRawStream(index))
    return y


def still_bound(prepared, params: list[Tensor]) -> bool:
    entry, stamp, w_dtype = prepared[5:]
    return entry[1] is stamp and params[0].dtype == w_dtype and stamp == list(map(_DATA_PTR, params))


def _encoder_infer_cuda(x, params, in_channels, base_planes, layers):
    key = (x.shape, x.stride(), x.dtype, x.device, in_channels, base_planes, *layers)
    fast = _FAST.get(key)
    if fast is not None:
        y = launch_prepared(fast, x)
        if still_bound(fast, params):
            _refuse_gradients(x, params)
            return y
    _refuse_gradients(x, params)
    config = _config(in_channels, base_planes, layers)
    entry, _ = _cuda_engine(x, params, config)
    gpu, spec, y = _cuda_call(entry, x, params, config)
    gpu.run(spec, x.data_ptr(), y.data_ptr(), _stream(x))
    prepared = prepared_inference(gpu, spec, x, y, entry, params[0].dtype)
    if prepared is not None:
        if len(_FAST) >= 64:
            _FAST.pop(next(iter(_FAST)))
        _FAST[key] = prepared
    return y


_LIB.impl("encoder_infer", _encoder_infer_cpu, "CPU")
_LIB.impl("encoder_infer", _encoder_infer_cuda, "CUDA")


@torch.library.register_fake("kfuse::encoder_infer")
def _encoder_infer_fake(x, params, in_channels, base_planes, layers):
    return _encoder_forward_fake(x, params, in_channels, base_planes, layers, False)


def _cuda_engine(x: Tensor, params: list[Tensor], config):
    """The shared engine entry for these parameters on x's device, bound to their memory; and its precision."""
    w_dtype = params[0].dtype
    if any(p.device != x.device for p in params):
        raise ValueError(f"kfuse::encoder ops: the input is on {x.device} but a parameter is on "
                         f"{next(p.device for p in params if p.device != x.device)}")
    precision = torch.bfloat16 if w_dtype == torch.bfloat16 else torch.float16
    key = (config, x.device.index or 0, precision)
    entry = _ENGINES.get(key)
    if entry is None:
        entry = _ENGINES[key] = [_C.EncoderGpu(config, _PRECISION_NAMES[precision], key[1]), None, _NO_AFFINE, None,
                                 None, None]
    from .encoder import ResNetEncoder  # (kfuse.encoder imports this module)
    rebound = ResNetEncoder._bind(entry, params)  # validates the parameters' dtypes
    ResNetEncoder._stage(entry)
    return entry, rebound


def _cuda_call(entry, x: Tensor, params: list[Tensor], config):
    """(engine, prepared call, new output) for a forward of x."""
    gpu = entry[0]
    key = (id(gpu), x.shape, x.stride(), x.dtype, params[0].dtype)
    known = _SPECS.get(key)
    if known is None:  # validated and prepared once per input kind; later calls pass pointers only
        shape = _C.output_shape(config, list(x.shape))
        y = torch.empty(shape, dtype=params[0].dtype, device=x.device)
        known = _SPECS[key] = (gpu.prepare_call(x, y), shape)
        return gpu, known[0], y
    return gpu, known[0], torch.empty(known[1], dtype=params[0].dtype, device=x.device)


def _flat_gradient_fake(params: list[Tensor]) -> Tensor:
    """The backward ops return every parameter's gradient in one flat tensor of the parameters' dtype, in their
    order: the kernels write one buffer, and an op's outputs may not alias each other, so per-parameter outputs would
    cost a copy of all of them; the autograd formulas hand autograd views of it (_per_parameter)."""
    return params[0].new_empty(sum(p.numel() for p in params))


def _per_parameter(flat: Tensor, params: list[Tensor]) -> list[Tensor]:
    return [g.view(p.shape) for g, p in zip(torch.split(flat, [p.numel() for p in params]), params)]


def _stream(x: Tensor) -> int:
    return torch._C._cuda_getCurrentRawStream(x.device.index or 0)


@encoder_forward.register_kernel("cuda")
def _encoder_forward_cuda(x, params, in_channels, base_planes, layers, training):
    config = _config(in_channels, base_planes, layers)
    entry, _ = _cuda_engine(x, params, config)
    gpu, spec, y = _cuda_call(entry, x, params, config)
    if not training:
        gpu.run(spec, x.data_ptr(), y.data_ptr(), _stream(x))
        return y
    stash = gpu.run_train(spec, x.data_ptr(), y.data_ptr(), _stream(x))
    if len(_STASHES) >= _MAX_STASHES:
        _STASHES.pop(next(iter(_STASHES)))
    _STASHES[y.data_ptr()] = (entry, stash, x.data_ptr())
    return y


@torch.library.custom_op("kfuse::encoder_backward", mutates_args=(), device_types="cpu")
def encoder_backward(x: Tensor, params: list[Tensor], grad_output: Tensor, in_channels: int, base_planes: int,
                     layers: list[int], input_grad: bool, output: Tensor | None = None) -> list[Tensor]:
    config = _config(in_channels, base_planes, layers)
    grads = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else None
    _C.reference_backward(config, [p.detach().contiguous() for p in params], x.detach().contiguous(),
                          grad_output.detach().to(x.dtype).contiguous(), grads, grad_x)
    return [torch.cat([g.reshape(-1) for g in grads])] + ([grad_x] if input_grad else [])


@encoder_backward.register_fake
def _encoder_backward_fake(x, params, grad_output, in_channels, base_planes, layers, input_grad, output=None):
    return [_flat_gradient_fake(params)] + (
        [torch.empty_like(x, memory_format=torch.contiguous_format)] if input_grad else [])


@encoder_backward.register_kernel("cuda")
def _encoder_backward_cuda(x, params, grad_output, in_channels, base_planes, layers, input_grad, output=None):
    config = _config(in_channels, base_planes, layers)
    entry, rebound = _cuda_engine(x, params, config)
    gpu = entry[0]
    kept = _STASHES.pop(output.data_ptr(), None) if output is not None else None
    stream = _stream(x)
    if (kept is not None and not rebound and kept[0] is entry and kept[2] == x.data_ptr()
            and gpu.stash_valid(kept[1])):
        stash = kept[1]
    else:  # no training forward of this output, or another one replaced what it kept: recompute it
        gpu, spec, y = _cuda_call(entry, x, params, config)
        stash = gpu.run_train(spec, x.data_ptr(), y.data_ptr(), stream)
    dy = grad_output.to(params[0].dtype).contiguous()
    sizes = [p.numel() for p in params]
    grads = torch.empty(sum(sizes), dtype=torch.float32, device=x.device)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if input_grad else None
    gpu.backward(stash, x, dy, grads, dx, stream)
    return [grads.to(params[0].dtype)] + ([dx] if input_grad else [])


def _forward_setup(ctx, inputs, output):
    x, params, in_channels, base_planes, layers, _ = inputs
    ctx.save_for_backward(x, output, *params)
    ctx.config = (in_channels, base_planes, list(layers))


def _forward_backward(ctx, grad_output):
    x, output, *params = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    out = encoder_backward(x, params, grad_output, *ctx.config, input_grad, output)
    return (out[1] if input_grad else None), _per_parameter(out[0], params), None, None, None, None


encoder_forward.register_autograd(_forward_backward, setup_context=_forward_setup)


# -- the fused MLP ----------------------------------------------------------------------------------------------------
#     torch.ops.kfuse.mlp_forward(x, params, module_uid, training) -> y
#     torch.ops.kfuse.mlp_backward(x, params, grad_output, module_uid, input_grad, output)
#         -> [every parameter's gradient, flat, grad_x if input_grad]
# x: (batch, input_width); params: the layers' weights and biases in nn.Sequential's order; the output has the
# compute dtype (the parameters' for float16 / bfloat16, else float16). module_uid names the kfuse.FusedMLP whose
# configuration, generated kernels and tuned variants the ops use (process-local, as its kernels are); the weights
# are the `params` given, packed from their memory at every call. CUDA only; the module's CPU path is plain PyTorch.
_MLP_STASHES: dict = {}  # training forward's output data_ptr -> (stash, packed weights, engine)
atexit.register(_MLP_STASHES.clear)


def _mlp_module(uid: int):
    from . import _script
    from .mlp import FusedMLP
    ref = _script._ORIGINALS.get(int(uid))
    m = ref() if ref is not None else None
    if not isinstance(m, FusedMLP):
        raise RuntimeError(f"kfuse::mlp ops: no kfuse.FusedMLP with id {uid} in this process (the ops run with the "
                           "module they were traced from)")
    return m


def _mlp_compute(params: list[Tensor]) -> torch.dtype:
    return params[0].dtype if params[0].dtype in (torch.float16, torch.bfloat16) else torch.float16


def _mlp_pack(m, engine, params: list[Tensor], compute: torch.dtype, stream: int) -> Tensor:
    ws, bs, it = [], [], iter(params)
    for has_bias in m.bias_flags:
        ws.append(next(it).detach().to(compute).contiguous())
        bs.append(next(it).detach().to(compute).contiguous() if has_bias else None)
    packed = torch.empty(engine.packed_weights_bytes(), dtype=torch.uint8, device=params[0].device)
    engine.pack_weights(ws, bs, packed, stream)
    return packed


def _mlp_input(x: Tensor, compute: torch.dtype) -> Tensor:
    x = x.to(compute).contiguous()
    return x.clone() if x.data_ptr() % 16 else x


def _mlp_train_forward(m, x, params, compute, stream):
    _, bwd_variant = m._variants_for(x.device.index or 0, compute)
    engine = m.engine(x.device, compute, bwd_variant)
    packed = _mlp_pack(m, engine, params, compute, stream)
    y = torch.empty((x.shape[0], m.output_width), dtype=compute, device=x.device)
    stash = torch.empty(max(engine.stash_bytes(x.shape[0]), 16), dtype=torch.uint8, device=x.device)
    engine.forward_train_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), stash.data_ptr(), x.shape[0], stream)
    return y, (stash, packed, engine)


@torch.library.custom_op("kfuse::mlp_forward", mutates_args=(), device_types="cuda")
def mlp_forward(x: Tensor, params: list[Tensor], module_uid: int, training: bool) -> Tensor:
    m = _mlp_module(module_uid)
    compute = _mlp_compute(params)
    x = _mlp_input(x, compute)
    stream = _stream(x)
    if x.shape[0] == 0:
        return torch.empty((0, m.output_width), dtype=compute, device=x.device)
    if training:
        y, kept = _mlp_train_forward(m, x, params, compute, stream)
        if len(_MLP_STASHES) >= _MAX_STASHES:
            _MLP_STASHES.pop(next(iter(_MLP_STASHES)))
        _MLP_STASHES[y.data_ptr()] = kept
        return y
    fwd_variant, _ = m._variants_for(x.device.index or 0, compute)
    engine = m.engine(x.device, compute, fwd_variant)
    packed = _mlp_pack(m, engine, params, compute, stream)
    y = torch.empty((x.shape[0], m.output_width), dtype=compute, device=x.device)
    engine.forward_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], stream)
    return y


@mlp_forward.register_fake
def _mlp_forward_fake(x, params, module_uid, training):
    torch._check(x.dim() == 2, lambda: f"kfuse::mlp_forward expects a (batch, width) input, got {x.dim()} dims")
    out_width = params[-1].shape[0]  # the last layer's bias (out) or weight (out, in)
    return x.new_empty((x.shape[0], out_width), dtype=_mlp_compute(params))


@torch.library.custom_op("kfuse::mlp_backward", mutates_args=(), device_types="cuda")
def mlp_backward(x: Tensor, params: list[Tensor], grad_output: Tensor, module_uid: int, input_grad: bool,
                 output: Tensor) -> list[Tensor]:
    m = _mlp_module(module_uid)
    compute = _mlp_compute(params)
    x = _mlp_input(x, compute)
    stream = _stream(x)
    kept = _MLP_STASHES.pop(output.data_ptr(), None)
    y = output
    if kept is None:  # no training forward of this output: recompute it
        y, kept = _mlp_train_forward(m, x, params, compute, stream)
    stash, packed, engine = kept
    dy = grad_output.to(compute).contiguous()
    if dy.data_ptr() % 16:
        dy = dy.clone()
    workspace = torch.empty(engine.backward_workspace_bytes(x.shape[0]), dtype=torch.uint8, device=x.device)
    grad_dtype = params[0].dtype
    grads = torch.empty(engine.num_parameters, dtype=grad_dtype, device=x.device)
    dx = torch.empty_like(x) if input_grad else None
    engine.backward_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), dy.data_ptr(), stash.data_ptr(),
                        workspace.data_ptr(), grads.data_ptr(), grad_dtype != torch.float32,
                        0 if dx is None else dx.data_ptr(), x.shape[0], stream)
    return [grads] + ([dx] if input_grad else [])


@mlp_backward.register_fake
def _mlp_backward_fake(x, params, grad_output, module_uid, input_grad, output):
    return [_flat_gradient_fake(params)] + ([x.new_empty(x.shape, dtype=_mlp_compute(params))] if input_grad else [])


def _mlp_setup(ctx, inputs, output):
    x, params, module_uid, _ = inputs
    ctx.save_for_backward(x, output, *params)
    ctx.module_uid = module_uid
    ctx.x_dtype = x.dtype


def _mlp_backward_formula(ctx, grad_output):
    x, output, *params = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    out = mlp_backward(x, params, grad_output, ctx.module_uid, input_grad, output)
    dx = out[1].to(ctx.x_dtype) if input_grad else None
    return dx, _per_parameter(out[0], params), None, None


mlp_forward.register_autograd(_mlp_backward_formula, setup_context=_mlp_setup)
