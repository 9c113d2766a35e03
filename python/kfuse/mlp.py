"""kfuse.FusedMLP: a fully fused MLP whose CUDA kernels are generated for the exact model at run time.

The C++ core writes CUDA source specialized to the widths and activations, compiles it with NVRTC for the device
(cached on disk under $KFUSE_CACHE_DIR/kernels, else ~/.cache/kfuse/kernels) and runs it: the forward in one kernel,
the backward as one kernel for the activation-gradient chain plus GEMMs for the weight gradients, through
torch.autograd. On CPU tensors the module runs plain PyTorch (same math), so it trains and tests anywhere.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import nn
import torch.nn.functional as F

from . import _C, _script

__all__ = ["FusedMLP", "Activation"]

_GPU_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Activation:
    """An activation for FusedMLP.

    Built-ins by name: ``Activation.builtin("relu")``, ``"leaky_relu"`` (``alpha`` = negative slope), ``"sigmoid"``,
    ``"tanh"``, ``"silu"``, ``"gelu"`` (tanh form), ``"softplus"`` (``alpha`` = beta, threshold 20), ``"identity"``.
    User-defined: CUDA float expressions of ``x`` and of its derivative in terms of ``x`` and/or ``y`` (the value),
    e.g. ``Activation("softsign", "x / (1.0f + fabsf(x))", "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))")``.
    The expressions are compiled once with NVRTC here: a mistake raises ValueError quoting NVRTC's log. ``torch_fn``
    (optional) is the same function on tensors, used on CPU tensors.
    """

    def __init__(self, name: str, expression: str, derivative: str, torch_fn: Callable | None = None, *,
                 _builtin: tuple | None = None):
        self.name, self.expression, self.derivative = name, expression, derivative
        self.torch_fn = torch_fn
        self._builtin = _builtin
        if _builtin is None:
            _C.mlp_validate_activation(name, expression, derivative, _C.built_with_cuda())

    @classmethod
    def builtin(cls, name: str, alpha: float | None = None) -> "Activation":
        n, e, d = _C.mlp_builtin_activation(name, alpha)  # ValueError for unknown names
        return cls(n, e, d, _torch_builtin(n, alpha), _builtin=(n, alpha))

    def as_tuple(self) -> tuple[str, str, str]:
        return (self.name, self.expression, self.derivative)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_fn is None:
            raise NotImplementedError(
                f"activation '{self.name}' has no torch_fn: pass torch_fn= to Activation to run it on CPU tensors")
        return self.torch_fn(x)

    def __repr__(self) -> str:
        if self._builtin is not None:
            n, a = self._builtin
            return f"Activation.builtin({n!r}" + ("" if a is None else f", {a!r}") + ")"
        return f"Activation({self.name!r}, {self.expression!r}, {self.derivative!r})"


def _torch_builtin(name: str, alpha: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "relu":
        return torch.relu
    if name == "leaky_relu":
        slope = 0.01 if alpha is None else alpha
        return lambda x: F.leaky_relu(x, slope)
    if name == "sigmoid":
        return torch.sigmoid
    if name == "tanh":
        return torch.tanh
    if name == "silu":
        return F.silu
    if name == "gelu":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "softplus":
        beta = 1.0 if alpha is None else alpha
        return lambda x: F.softplus(x, beta=beta, threshold=20.0)
    return lambda x: x  # identity


ActivationLike = Union[str, Activation, tuple]


def _as_activation(a: ActivationLike, where: str) -> Activation:
    if isinstance(a, Activation):
        return a
    if isinstance(a, str):
        return Activation.builtin(a)
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str):
        return Activation.builtin(a[0], float(a[1]))
    raise TypeError(f"{where}: expected an activation name, (name, alpha) or kfuse.Activation, got {a!r}")


def _is_single_activation(a) -> bool:
    return isinstance(a, (str, Activation)) or (
        isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], (int, float)))


def _activation_of_module(m: nn.Module, index: int) -> Activation:
    """The FusedMLP activation equal to a torch activation module, or ValueError naming why not."""
    where = f"from_torch: layer {index} ({type(m).__name__})"
    if isinstance(m, nn.ReLU):
        return Activation.builtin("relu")
    if isinstance(m, nn.LeakyReLU):
        return Activation.builtin("leaky_relu", float(m.negative_slope))
    if isinstance(m, nn.Sigmoid):
        return Activation.builtin("sigmoid")
    if isinstance(m, nn.Tanh):
        return Activation.builtin("tanh")
    if isinstance(m, nn.SiLU):
        return Activation.builtin("silu")
    if isinstance(m, nn.GELU):
        if m.approximate != "tanh":
            raise ValueError(f"{where}: only GELU(approximate='tanh') is supported (got approximate="
                             f"{m.approximate!r})")
        return Activation.builtin("gelu")
    if isinstance(m, nn.Softplus):
        if m.threshold != 20:
            raise ValueError(f"{where}: only Softplus(threshold=20) is supported (got {m.threshold})")
        return Activation.builtin("softplus", float(m.beta))
    if isinstance(m, nn.Identity):
        return Activation.builtin("identity")
    raise ValueError(f"{where} is not supported: nn.Sequential of nn.Linear layers with ReLU, LeakyReLU, Sigmoid, "
                     f"Tanh, SiLU, GELU(approximate='tanh'), Softplus or Identity between them")


# The raw handle of the current stream without making a torch.cuda.Stream object (a few us per call on the hot path).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cuda_stream(device: torch.device) -> int:
    if _current_raw_stream is not None and device.index is not None:
        return _current_raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


class _FusedFunction(torch.autograd.Function):
    """Forward (training forward when gradients are wanted) and backward of the generated kernels. Parameters pass
    as inputs so that autograd routes their gradients; the kernels read them from the packed buffer.

    `run` = (inference engine, training engine, packed weights, train, output width): one argument instead of five,
    since Function.apply costs host time per argument (the training step is host-bound at width 64)."""

    # The engines are called with device pointers (the *_raw methods): every buffer is made here or checked by
    # FusedMLP.forward (contiguous, the compute dtype, 16-byte aligned, on the parameters' device), and autograd hands
    # backward a dy of y's shape and device.
    @staticmethod
    def forward(ctx, run, x, *params):
        engine, bwd_engine, packed, train, out_width = run
        batch = x.shape[0]
        y = torch.empty((batch, out_width), dtype=x.dtype, device=x.device)
        stream = _cuda_stream(x.device)
        if train:
            # The training variant's stash-writing forward and backward (tuned together as one training step; with
            # recomputed activations its forward leaves part of the stash unwritten, so the backward must be the
            # same engine's); inference may use another variant: weights and y are laid out the same for all.
            stash = torch.empty(max(bwd_engine.stash_bytes(batch), 16), dtype=torch.uint8, device=x.device)
            bwd_engine.forward_train_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), stash.data_ptr(), batch,
                                         stream)
            ctx.engine = bwd_engine
            ctx.params = params
            ctx.save_for_backward(x, y, stash, packed)
        else:
            engine.forward_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), batch, stream)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, y, stash, packed = ctx.saved_tensors
        engine, params = ctx.engine, ctx.params
        batch = x.shape[0]
        if dy.dtype != x.dtype:
            dy = dy.to(x.dtype)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        if dy.data_ptr() % 16:
            dy = dy.clone()
        workspace = torch.empty(engine.backward_workspace_bytes(batch), dtype=torch.uint8, device=x.device)
        # The kernels write the gradients in the parameters' dtype: 16-bit parameters are the compute dtype (each
        # gradient rounded once from its float32 sum), float32 ones get the float32 sums. No cast afterwards.
        grad_dtype = params[0].dtype
        grads = torch.empty(engine.num_parameters, dtype=grad_dtype, device=x.device)
        need = ctx.needs_input_grad
        dx = torch.empty_like(x) if need[1] else None
        engine.backward_raw(packed.data_ptr(), x.data_ptr(), y.data_ptr(), dy.data_ptr(), stash.data_ptr(),
                            workspace.data_ptr(), grads.data_ptr(), grad_dtype != torch.float32,
                            0 if dx is None else dx.data_ptr(), batch, _cuda_stream(x.device))
        # One call for every parameter's view of the gradient vector (nn.Sequential's order, the kernels' layout).
        out = torch._C._nn.unflatten_dense_tensors(grads, params)
        return (None, dx, *(g if n else None for g, n in zip(out, need[2:])))


class FusedMLP(nn.Module):
    """A fully fused MLP: ``input_width -> hidden_widths... -> output_width`` with ``activation`` after every
    hidden layer and ``output_activation`` after the last.

    - hidden widths: multiples of 16 up to 256, different per layer; input and output widths 1..256;
    - ``activation``: a name, ``(name, alpha)``, a :class:`kfuse.Activation`, or a list of those (one per hidden
      layer); ``bias``: bool or one bool per layer;
    - parameters are ``layers[i].weight`` / ``layers[i].bias`` (nn.Linear's); the module's dtype is the compute
      dtype on the GPU (float16 or bfloat16 with fp32 accumulation; a float32 module computes in float16 and returns
      float32);
    - any batch >= 1 and any leading dimensions: input (..., input_width) -> output (..., output_width);
    - ``options``: the generated kernels' alternative code paths, a dict of ``kfuse::MlpOptions`` field names to
      bools (``packed_relu``, ``staged_stores``, ``mma_bias``; include/kfuse/mlp_options.h), the rest at their
      defaults (the fastest measured). Every setting computes the same function; they exist for same-run A/B
      measurements and tests of one code path. Every engine (tuned variants too) uses them; the ``KFUSE_MLP_*``
      environment overrides still apply on top.
    """

    def __init__(self, input_width: int, output_width: int, hidden_widths: Sequence[int] = (64, 64, 64, 64),
                 activation: ActivationLike | Sequence[ActivationLike] = "relu",
                 output_activation: ActivationLike = "identity", bias: bool | Sequence[bool] = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 options: dict[str, bool] | None = None):
        super().__init__()
        self._options = _C.mlp_options(dict(options or {}))  # ValueError naming an unknown field
        hidden = [int(w) for w in hidden_widths]
        if _is_single_activation(activation):
            acts = [_as_activation(activation, "activation")] * len(hidden)
        else:
            acts = [_as_activation(a, f"activation {i}") for i, a in enumerate(activation)]
            if len(acts) != len(hidden):
                raise ValueError(f"expected one activation per hidden layer ({len(hidden)}), got {len(acts)}")
        out_act = _as_activation(output_activation, "output_activation")
        n_layers = len(hidden) + 1
        biases = [bool(bias)] * n_layers if isinstance(bias, bool) else [bool(b) for b in bias]
        if len(biases) != n_layers:
            raise ValueError(f"expected one bias flag per layer ({n_layers}), got {len(biases)}")
        # The C++ core validates widths and counts and names the problem (ValueError).
        _C.mlp_spec_string(int(input_width), hidden, int(output_width), [a.as_tuple() for a in acts],
                           out_act.as_tuple(), biases, "float16")
        self.input_width, self.output_width, self.hidden_widths = int(input_width), int(output_width), hidden
        self.activations, self.output_activation, self.bias_flags = acts, out_act, biases
        widths = [self.input_width, *hidden, self.output_width]
        self.layers = nn.ModuleList(nn.Linear(widths[i], widths[i + 1], bias=biases[i], dtype=dtype, device=device)
                                    for i in range(n_layers))
        self._engines: dict = {}
        self._packed = None  # [key, packed inference buffer, weight views or None]
        # Kernel variants the GPU path uses for inference (forward) and for training (training forward and
        # backward), as tuples engine() takes. None: what tune() chose for the device and compute dtype, else the
        # heuristic default.
        self.variant: tuple | None = None
        self.backward_variant: tuple | None = None
        self._tuned: dict = {}  # (device index, compute dtype) -> (forward variant, backward variant)
        self._kfuse_uid = _script.register(self)

    # -- construction --------------------------------------------------------------------------------------------
    @property
    def options(self) -> dict[str, bool]:
        """Every kernel option as given to the constructor (defaults filled in; without the environment's
        overrides, which each engine's ``options()`` includes)."""
        return dict(self._options)

    @classmethod
    def from_torch(cls, module: nn.Sequential, options: dict[str, bool] | None = None) -> "FusedMLP":
        """A FusedMLP with the structure, weights, dtype and device of an ``nn.Sequential`` of ``nn.Linear``
        layers (with or without bias) and supported activations between them (and optionally after the last);
        ``options`` as in the constructor."""
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"from_torch expects an nn.Sequential, got {type(module).__name__}")
        linears: list[nn.Linear] = []
        acts: list[Activation | None] = []  # the activation after each Linear (None = identity so far)
        for i, m in enumerate(module):
            if isinstance(m, nn.Linear):
                if linears and linears[-1].out_features != m.in_features:
                    raise ValueError(f"from_torch: layer {i} (Linear) takes {m.in_features} features but the "
                                     f"previous Linear gives {linears[-1].out_features}")
                linears.append(m)
                acts.append(None)
                continue
            if isinstance(m, nn.Dropout) and m.p == 0:
                continue
            act = _activation_of_module(m, i)
            if not linears:
                raise ValueError(f"from_torch: layer {i} ({type(m).__name__}) comes before the first Linear")
            if acts[-1] is not None:
                raise ValueError(f"from_torch: layer {i} ({type(m).__name__}) follows another activation; "
                                 f"one activation per Linear is supported")
            acts[-1] = act
        if len(linears) < 2:
            raise ValueError(f"from_torch: need at least two Linear layers (one hidden layer), got {len(linears)}")
        identity = Activation.builtin("identity")
        acts = [a if a is not None else identity for a in acts]
        hidden = [m.out_features for m in linears[:-1]]
        for i, w in enumerate(hidden):
            if w % 16 or w > 256:
                raise ValueError(f"from_torch: hidden layer {i} has width {w}; FusedMLP needs hidden widths that are "
                                 f"multiples of 16 up to 256")
        p = linears[0].weight
        mlp = cls(linears[0].in_features, linears[-1].out_features, hidden, acts[:-1], acts[-1],
                  [m.bias is not None for m in linears], dtype=p.dtype, device=p.device, options=options)
        with torch.no_grad():
            for dst, src in zip(mlp.layers, linears):
                dst.weight.copy_(src.weight)
                if src.bias is not None:
                    dst.bias.copy_(src.bias)
        return mlp

    def tune(self, batch: int, mode: str = "on") -> list[dict]:
        """Chooses the inference and training kernel variants for `batch` rows on the parameters' device and compute
        dtype with kfuse's autotuner (ops 'mlp_forward': the forward; 'mlp_train': the training forward and the
        backward together): every candidate variant compiled (or loaded from the kernel cache), timed on
        random data, checked against the default's output; the choice is cached on disk (mode 'on': a cached
        choice is used as is, 'retune': time again, 'off': the heuristic default). variants() then returns it
        (unless `variant` / `backward_variant` override it). Returns the tuner's report rows (print them with
        kfuse.tuning_table.format_tuning_table)."""
        device, compute = self._gpu_target()
        fwd, bwd, rows = _C.mlp_tune(self.input_width, self.hidden_widths, self.output_width,
                                     [a.as_tuple() for a in self.activations], self.output_activation.as_tuple(),
                                     self.bias_flags, _GPU_DTYPES[compute], device.index or 0, int(batch), mode,
                                     self._options)
        self._tuned[(device.index or 0, compute)] = (tuple(fwd), tuple(bwd))
        return list(rows)

    def variants(self) -> tuple[tuple | None, tuple | None]:
        """The (inference, training) kernel variants the GPU path runs on the parameters' device: the overrides, else
        tune()'s choice for this device and compute dtype, else None (the heuristic default)."""
        device, compute = self._gpu_target()
        return self._variants_for(device.index or 0, compute)

    def _variants_for(self, device_index: int, compute: torch.dtype) -> tuple[tuple | None, tuple | None]:
        tuned = self._tuned.get((device_index, compute), (None, None))
        return (self.variant if self.variant is not None else tuned[0],
                self.backward_variant if self.backward_variant is not None else tuned[1])

    def _gpu_target(self) -> tuple[torch.device, torch.dtype]:
        """The CUDA device of the parameters and the dtype the kernels compute in (as forward() runs them)."""
        p = self.layers[0].weight
        if p.device.type != "cuda":
            raise ValueError(f"FusedMLP: the kernels run on a CUDA device; the parameters are on {p.device}")
        return p.device, (p.dtype if p.dtype in _GPU_DTYPES else torch.float16)

    # -- GPU plumbing --------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        # nn.Sequential's parameter order. Read through the modules' dicts: nn.Module.__getattr__ costs ~1 us per
        # attribute, and this runs on every call.
        out = []
        for layer in self.layers._modules.values():
            ps = layer._parameters
            out.append(ps["weight"])
            b = ps.get("bias")
            if b is not None:
                out.append(b)
        return out

    def engine(self, device: torch.device, compute_dtype: torch.dtype, variant: tuple | None = None):
        """The generated kernels for this MLP on `device` (compiled or loaded from the cache on first use).

        `variant`: None for the heuristic default, else (m_tiles, warps, weights_resident, k_chunk[, fused_wgrad[,
        wgmma[, recompute[, wgmma_backward]]]]) as in kfuse::MlpVariant (include/kfuse/mlp.h)."""
        key = (device.index or 0, compute_dtype, variant)
        e = self._engines.get(key)
        if e is None:
            e = _C.FusedMlpGpu(self.input_width, self.hidden_widths, self.output_width,
                               [a.as_tuple() for a in self.activations], self.output_activation.as_tuple(),
                               self.bias_flags, _GPU_DTYPES[compute_dtype], device.index or 0, variant,
                               self._options)
            self._engines[key] = e
        return e

    def _packed_weights(self, engine, params: list[torch.Tensor], compute_dtype: torch.dtype,
                        train: bool = False) -> torch.Tensor:
        # Packed on the device before every call (one small kernel), from the parameters' current memory: no write
        # to a parameter, by whatever path (an optimizer, a copy through .data, a collective), can leave the kernels
        # reading old weights. Where the parameters are contiguous in the compute dtype the pack reads them in place
        # (the views are kept per set of parameter tensors); otherwise from fresh converted copies. A training call
        # packs into a new buffer (a pending backward keeps the one its forward used); inference reuses its own.
        # Inference tensors (made under torch.inference_mode) cannot be saved for backward: not reused outside it.
        # (The stream too: the inference buffer is rewritten in the stream's order, never under another's reads.)
        device = params[0].device
        key = (id(engine), torch.is_inference_mode_enabled(), _cuda_stream(device),
               tuple(map(torch.Tensor.data_ptr, params)))
        cached = self._packed
        if cached is None or cached[0] != key:
            direct = all(p.dtype == compute_dtype and p.is_contiguous() for p in params)
            views = self._weight_views(compute_dtype) if direct else None
            cached = self._packed = [key, None, views]
        ws, bs = cached[2] if cached[2] is not None else self._weight_views(compute_dtype)
        packed = cached[1]
        if packed is None or train:
            packed = torch.empty(engine.packed_weights_bytes(), dtype=torch.uint8, device=device)
            if not train:
                cached[1] = packed
        engine.pack_weights(ws, bs, packed, _cuda_stream(device))
        return packed

    def _weight_views(self, compute_dtype: torch.dtype) -> tuple[list, list]:
        """The layers' weights and biases as contiguous tensors of the compute dtype (the parameters' own memory
        where they already are)."""
        ws, bs = [], []
        with torch.no_grad():
            for layer in self.layers:
                ws.append(layer.weight.detach().to(compute_dtype).contiguous())
                bs.append(None if layer.bias is None else layer.bias.detach().to(compute_dtype).contiguous())
        return ws, bs

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TorchScript compiles the first branch only: the module's work stays in Python (_forward_python), which a
        # scripted program calls back into (kfuse/_script.py; the first weight lets it check whose parameters those
        # are). Eager calls and torch.compile take the second, with no extra attribute lookups on the hot path.
        if torch.jit.is_scripting():
            return self._forward_python(x, self.layers[0].weight)
        return self._forward(x)

    @torch.jit.ignore
    def _forward_python(self, x, witness):  # unannotated: TorchScript takes them as Tensors -> Tensor
        return _script.python_module(self, FusedMLP, witness, lambda m: m.layers[0].weight)._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of every call: the checks and lookups below are kept to plain Python operations where they
        # can be (a training step at width 64 is bound by host time).
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"FusedMLP expects a torch.Tensor, got {type(x).__name__}")
        shape = x.shape
        if len(shape) < 1 or shape[-1] != self.input_width:
            raise ValueError(f"FusedMLP input must have shape (..., {self.input_width}), got {tuple(shape)}")
        params = self._params()
        p = params[0]
        device = x.device
        if device != p.device:
            raise ValueError(f"input is on {device} but the MLP's parameters are on {p.device}")
        if not x.is_floating_point():
            raise ValueError(f"FusedMLP input must be floating point, got {x.dtype}")
        if device.type != "cuda":
            return self.forward_torch(x)
        if torch.compiler.is_compiling():
            return self._forward_op(x, params)
        dtype = p.dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"FusedMLP on CUDA runs float16, bfloat16 or float32 modules, this one is {dtype}")
        compute = dtype if dtype in _GPU_DTYPES else torch.float16
        x2 = x if len(shape) == 2 else x.reshape(-1, self.input_width)
        if x2.dtype != compute:
            x2 = x2.to(compute)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.output_width, dtype=dtype)
        if x2.data_ptr() % 16:
            x2 = x2.clone()
        fwd_variant, bwd_variant = self._variants_for(device.index or 0, compute)
        engine = self.engine(device, compute, fwd_variant)
        train = torch.is_grad_enabled() and (x2.requires_grad or any(q.requires_grad for q in params))
        packed = self._packed_weights(engine, params, compute, train)
        bwd_engine = self.engine(device, compute, bwd_variant) if train else engine
        y = _FusedFunction.apply((engine, bwd_engine, packed, train, self.output_width), x2, *params)
        if dtype != compute:
            y = y.to(dtype)
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.output_width)

    def _forward_op(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """The CUDA forward as the dispatcher's op (kfuse/ops.py), for torch.compile / torch.export to trace."""
        dtype = params[0].dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"FusedMLP on CUDA runs float16, bfloat16 or float32 modules, this one is {dtype}")
        compute = dtype if dtype in _GPU_DTYPES else torch.float16
        shape = x.shape
        x2 = x.reshape(-1, self.input_width).to(compute)
        train = torch.is_grad_enabled() and (x2.requires_grad or any(q.requires_grad for q in params))
        y = torch.ops.kfuse.mlp_forward(x2, params, self._kfuse_uid, train)
        return y.to(dtype).reshape(*shape[:-1], self.output_width)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same MLP in plain PyTorch ops (the CPU path, and a reference)."""
        h = x.to(self.layers[0].weight.dtype)
        acts = [*self.activations, self.output_activation]
        for layer, act in zip(self.layers, acts):
            h = act(layer(h))
        return h

    def __getstate__(self):
        # The compiled engines (device code, handles) and the packed buffer are rebuilt on demand, never copied or
        # pickled: a deep copy (a target network) gets its own.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_engines"] = {}
        state["_packed"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_options", _C.mlp_options({}))  # pickled before the module had options
        self._kfuse_uid = _script.register(self)  # a copy is a module of its own (kfuse/_script.py)

    def extra_repr(self) -> str:
        acts = ", ".join(a.name for a in self.activations)
        return (f"input_width={self.input_width}, hidden_widths={self.hidden_widths}, "
                f"output_width={self.output_width}, activations=[{acts}], output_activation="
                f"{self.output_activation.name}")
