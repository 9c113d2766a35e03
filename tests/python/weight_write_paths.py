"""The ways programs write parameters, for test_gpu_weight_writes (GPU tier): each Write changes some or all of a
module's parameters one way (through .data, in-place ops, every torch.optim optimizer in its forms, state dicts,
vector_to_parameters, reassignment, a collective into the storage, conversions and copies), several of which move no
version counter.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

# A "material" write must move the float64 reference's output (and, for training, its whole gradient) by at least
# this much, normwise relative: 10x the encoder's output tolerance (ENC_TOL = 1e-2), 5x the gradients' floor
# (test_gpu_training.TOL = 2e-2; assert_grads_close's bounds, PyTorch-relative where larger, are used as they are) and
# more than 3x the MLP's loosest one (bf16, 3e-2). A module that kept computing with the old weights is then off its
# reference by ~CHANGED, far outside every bound.
CHANGED = 0.1
# The parameters the partial writes touch: for the encoder a big filter (block 4's conv2, 2.4 M of the 4.9 M
# weights), a FixUp scalar of block 2 and the stem's filter; for the MLP weights of the first and last layers and a
# hidden bias.
ENC_FEW = ("stem.1.weight", "layers.1.0.fixup_bias2a", "layers.3.0.conv2.weight")
MLP_FEW = ("layers.0.weight", "layers.1.bias", "layers.2.weight")
DEVICE = "cuda"
ACC_DTYPE = torch.float16  # the modules of the gradient accumulation tests
ENC_N = 16  # images per call (3 channels, 64 x 64)
MLP_BATCH = 1000  # rows per call (32 -> 64 -> 64 -> 16, ReLU, as test_mlp_gpu.make)
# Optimizer steps: each parameter is its own param group, and its learning rate is set (after the backward) so that
# the step moves it by a set fraction of its rms: SGD lr = OPT_STEPS[kind]["sgd"] * rms(p) / rms(grad); Adam's first
# step moves each element by ~lr (in the gradient's sign, coherently, so it moves the output much more per unit):
# lr = OPT_STEPS[kind]["adam"] * rms(p). A plain learning rate would move the 1-element FixUp scalars (whose gradients sum over the whole
# batch) by far more than their value and the filters by nothing visible. The fractions give output changes of
# ~0.2-1 (measured on float64 twins): the encoder's output is far more sensitive to a step along its gradient (1% of
# the shortcut filters' rms moves it by 20%) than the MLP's.
OPT_STEPS = {"encoder": {"sgd": 0.01, "adam": 0.008}, "mlp": {"sgd": 0.08, "adam": 0.08}}


# -- new values -----------------------------------------------------------------------------------------------------
def _rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def perturbed(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """New values for a parameter, float32 on its device: a scalar times 1.5, a tensor 0.75 t + 0.5 rms(t) noise
    (a change of ~55% of its rms, sign changes in many elements)."""
    v = t.detach().float()
    if v.numel() == 1:
        return v * 1.5
    noise = torch.randn(v.shape, generator=gen).to(v.device)
    return 0.75 * v + 0.5 * _rms(v) * noise


def _named(m: nn.Module, names=None) -> list[tuple[str, torch.Tensor]]:
    params = dict(m.named_parameters())
    return [(n, params[n]) for n in (names if names is not None else params)]


def _data_copy(m: nn.Module, ctx, names=None) -> None:
    """p.data.copy_(new) for the named parameters (all when names is None): no version bump."""
    for _, p in _named(m, ctx.few if names is None else names):
        p.data.copy_(perturbed(p, ctx.gen))


# -- the write paths ------------------------------------------------------------------------------------------------
class Write:
    """One way of writing parameters. setup(m, ctx) runs after the module is built and before its first call;
    apply(m, ctx) writes and returns the module the consumer runs next (the same one, or a copy). ctx: gen (a
    torch.Generator for new values), few (ENC_FEW or MLP_FEW), kind ("encoder" or "mlp"), run(m) (the consumer's calls,
    unchecked: for writes that need the module to have run in between), step_batch(m) ((x, dL/dy) of one training
    step), and what setup keeps. material: whether the write moves the output by >= CHANGED (else only its bits)."""

    def __init__(self, name, apply, setup=None, dtype=torch.float16, material=True, kinds=("encoder", "mlp"),
                 version_bump=False):
        # version_bump (documentation): the write moves every written parameter's version counter or address, which
        # main's (address, version) stamps already see
        self.name, self.apply_fn, self.setup_fn, self.dtype = name, apply, setup, dtype
        self.material, self.kinds, self.version_bump = material, kinds, version_bump

    def setup(self, m, ctx):
        if self.setup_fn is not None:
            self.setup_fn(m, ctx)

    def apply(self, m, ctx):
        with torch.no_grad():
            out = self.apply_fn(m, ctx)
        return m if out is None else out

    def __repr__(self):
        return self.name


# 1. fp32 master weights, modified, copied into the fp16 module through .data.
def masters_setup(m, ctx):
    ctx.masters = [(p, p.detach().float().clone()) for _, p in _named(m)]


def masters_apply(m, ctx):
    for p, master in ctx.masters:
        master.copy_(perturbed(master, ctx.gen))  # the optimizer's update of the master copy
        p.data.copy_(master)  # fp32 -> fp16, into the module's storage


# 2. arithmetic on p.data.
def _data_arith(m, ctx):
    (_, a), (_, b), (_, c) = _named(m, ctx.few)
    a.data.mul_(0.5)
    if b.numel() == 1:
        b.data.mul_(1.5)
    else:
        b.data.add_(perturbed(b, ctx.gen) - b.detach().float())
    c.data.add_(perturbed(c, ctx.gen) - c.detach().float())


# 3. in-place ops on the parameters themselves under torch.no_grad (they bump the version).
def _param_inplace(m, ctx):
    (_, a), (_, b), (_, c) = _named(m, ctx.few)
    a.mul_(0.5)
    if b.numel() == 1:
        b.mul_(1.5)
    else:
        b.add_(perturbed(b, ctx.gen) - b.detach().float())
    c.copy_(perturbed(c, ctx.gen))


# 4. a writer holding tensors taken from p.data before the module's first call.
def _early_views_setup(m, ctx):
    ctx.views = {n: p.data for n, p in _named(m)}


def _early_views_apply(m, ctx):
    for n in ctx.few:
        v = ctx.views[n]
        v.copy_(perturbed(v, ctx.gen))


# 2b. foreach kernels on the .data of every parameter (the way some fp16 optimizers update model weights).
def _foreach_data(m, ctx):
    data = [p.data for _, p in _named(m)]
    deltas = [(perturbed(d, ctx.gen) - 0.75 * d.float()).to(d.dtype) if d.numel() > 1 else 0.5 * d for d in data]
    torch._foreach_mul_(data, 0.75)
    torch._foreach_add_(data, deltas)


# Small writes through .data (material=False: the output must change bits, not by CHANGED). The element written is
# the largest in magnitude, wherever it is in the tensor.
def _one_element(m, ctx):
    p = dict(m.named_parameters())[ctx.few[2]]
    flat = p.data.view(-1)
    k = int(flat.float().abs().argmax())
    flat[k] = -4 * flat[k]


def _swap_two_elements(m, ctx):
    """A change that keeps the tensor's sum (and any order-blind checksum): its largest and smallest elements trade
    places."""
    p = dict(m.named_parameters())[ctx.few[2]]
    flat = p.data.view(-1)
    i, j = int(flat.float().argmax()), int(flat.float().argmin())
    a, b = flat[i].clone(), flat[j].clone()
    flat[i], flat[j] = b, a


def _permute_filters(m, ctx):
    """Rows (output channels / units) of two weight tensors rolled by one: the same multiset of values, in another
    order (sum-preserving), through .data."""
    for n in (ctx.few[0], ctx.few[2]):
        p = dict(m.named_parameters())[n]
        p.data.copy_(p.data.roll(1, dims=0).clone())


# 5. torch.optim: one real training step (loss = (y * dL/dy).sum(), backward, step).
def _per_param_groups(m):
    return [{"params": [p]} for _, p in _named(m)]


def _set_step_lrs(opt, adam: bool, kind: str):
    step = OPT_STEPS[kind]["adam" if adam else "sgd"]
    for g in opt.param_groups:
        p = g["params"][0]
        if adam:
            g["lr"] = step * _rms(p)
        else:
            gr = _rms(p.grad) if p.grad is not None else 0.0
            g["lr"] = step * _rms(p) / gr if gr > 0 else 0.0


def _optimizer_write(name, cls, dtype=torch.float32, **kw) -> Write:
    adam = cls is not torch.optim.SGD
    if not adam:
        kw.setdefault("momentum", 0.9)

    def setup(m, ctx):
        try:
            ctx.opt = cls(_per_param_groups(m), lr=0.0, **kw)
        except (RuntimeError, ValueError) as e:  # e.g. fused=True unsupported for this dtype / device
            pytest.skip(f"{cls.__name__}({kw}) unsupported here: {e}")

    def apply(m, ctx):
        opt = ctx.opt
        opt.zero_grad(set_to_none=True)
        x, dy = ctx.step_batch(m)
        with torch.enable_grad():
            (m(x).float() * dy).sum().backward()
        _set_step_lrs(opt, adam, ctx.kind)
        opt.step()

    # fused=True: _fused_sgd_ / _fused_adam_ leave the parameters' versions as they were (torch 2.11)
    return Write(name, apply, setup, dtype=dtype, version_bump=not kw.get("fused", False))


def _grad_scaler_write(name, cls, **kw) -> Write:
    """The same step through torch.amp.GradScaler (float32 module). SGD unscales explicitly (its learning rates are
    set from the unscaled gradients); fused Adam takes the scale into its kernel. The scale must not drop: the step
    was not skipped."""
    adam = cls is not torch.optim.SGD
    if not adam:
        kw.setdefault("momentum", 0.9)
    init_scale = 64.0

    def setup(m, ctx):
        try:
            ctx.opt = cls(_per_param_groups(m), lr=0.0, **kw)
        except (RuntimeError, ValueError) as e:
            pytest.skip(f"{cls.__name__}({kw}) unsupported here: {e}")
        ctx.scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)

    def apply(m, ctx):
        opt, scaler = ctx.opt, ctx.scaler
        opt.zero_grad(set_to_none=True)
        x, dy = ctx.step_batch(m)
        with torch.enable_grad():
            scaler.scale((m(x).float() * dy).sum()).backward()
        if not adam:
            scaler.unscale_(opt)
        _set_step_lrs(opt, adam, ctx.kind)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == init_scale, "GradScaler found inf/NaN gradients and skipped the step"

    return Write(name, apply, setup, dtype=torch.float32, version_bump=not kw.get("fused", False))


# 6. load_state_dict (copy_ into the parameters: a version bump), and with assign=True (new tensors).
def _new_state(m, ctx):
    return {k: perturbed(v, ctx.gen).to(v.dtype) for k, v in m.state_dict().items()}


def _load_state_dict(m, ctx):
    m.load_state_dict(_new_state(m, ctx))


def _load_state_dict_assign(m, ctx):
    m.load_state_dict(_new_state(m, ctx), assign=True)


# 7. vector_to_parameters: each parameter becomes a view of the vector (new storage). Reused: the same vector is
# written and handed to vector_to_parameters again, so the parameters keep their addresses and versions.
def _v2p(m, ctx):
    params = [p for _, p in _named(m)]
    ctx.vec = nn.utils.parameters_to_vector([perturbed(p, ctx.gen).to(p.dtype) for p in params])
    nn.utils.vector_to_parameters(ctx.vec, params)


def _v2p_reused(m, ctx):
    params = [p for _, p in _named(m)]
    vec = nn.utils.parameters_to_vector(params).clone()
    nn.utils.vector_to_parameters(vec, params)  # same values, new storage
    ctx.run(m)  # the module runs with the parameters as views of vec
    vec.copy_(nn.utils.parameters_to_vector([perturbed(p, ctx.gen).to(p.dtype) for p in params]))
    nn.utils.vector_to_parameters(vec, params)  # same views again
    ctx.vec = vec


# 8. a parameter replaced by assignment.
def _reassign(m, ctx):
    for n, p in _named(m, ctx.few):
        owner, attr = n.rsplit(".", 1)
        setattr(m.get_submodule(owner), attr, nn.Parameter(perturbed(p, ctx.gen).to(p.dtype)))


# 9. writes into the storage without autograd's knowledge: a real NCCL collective (world size 1: all_gather_into_
# tensor writes its input into the output, the parameter's storage, with NCCL's kernels, exactly what a broadcast from
# another rank does: c10d's ops carry no in-place annotation and NCCL writes device memory, so no version counter
# moves), and a raw storage copy (UntypedStorage.copy_, which has no version counter either). A real broadcast needs a
# second GPU and process: out of scope here.
_NCCL = {}


def _nccl_group(tmp_dir: str):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp_dir, 'nccl_store')}", rank=0,
                                    world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
        except Exception as e:  # noqa: BLE001 - no NCCL on this machine: skip, with the reason
            pytest.skip(f"cannot start a one-rank NCCL process group: {e}")
        _NCCL["owner"] = True
    return dist



def release_nccl() -> None:
    """Destroys the process group _nccl_group started, if it did."""
    if _NCCL.pop("owner", False):
        import torch.distributed as dist
        dist.destroy_process_group()

def _nccl_write(m, ctx):
    dist = _nccl_group(ctx.tmp_dir)
    for _, p in _named(m, ctx.few):
        assert p.is_contiguous()
        dist.all_gather_into_tensor(p.detach(), perturbed(p, ctx.gen).to(p.dtype).contiguous())
    torch.cuda.synchronize()


def _storage_write(m, ctx):
    for _, p in _named(m, ctx.few):
        s = p.untyped_storage()
        assert p.storage_offset() == 0 and s.nbytes() == p.numel() * p.element_size()
        s.copy_(perturbed(p, ctx.gen).to(p.dtype).contiguous().untyped_storage())


# 10. conversions (each gives the parameters new storage), a call, then a .data write.
def _convert_then_data_copy(convert):
    def apply(m, ctx):
        convert(m)
        ctx.run(m)
        _data_copy(m, ctx)

    return apply


# 11. a deep copy that runs, then is written through .data; the original must keep its weights and answer.
def _deepcopy_then_data_copy(m, ctx):
    c = copy.deepcopy(m)
    ctx.original = m
    ctx.run(c)
    _data_copy(c, ctx)
    return c


WRITES = [
    Write("data_copy_from_fp32_masters", masters_apply, masters_setup),
    Write("data_mul_add", _data_arith),
    Write("foreach_on_data", _foreach_data),
    Write("param_inplace_no_grad", _param_inplace, version_bump=True),
    Write("early_data_view", _early_views_apply, _early_views_setup),
    Write("one_element_through_data", _one_element, material=False),
    Write("swap_two_elements_through_data", _swap_two_elements, material=False),
    Write("permute_filters_through_data", _permute_filters),
    # float32 modules (computing in fp16): the fp32 parameters an optimizer steps (fp16 Adam is not a setup anyone
    # trains with: its eps underflows)
    *[_optimizer_write(f"{cls.__name__.lower()}_{impl}", cls, **{impl: True})
      for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) for impl in ("foreach", "fused")],
    *[_optimizer_write(f"{cls.__name__.lower()}_forloop", cls, foreach=False)
      for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)],
    _optimizer_write("sgd_foreach_fp16_module", torch.optim.SGD, dtype=torch.float16, foreach=True),
    _grad_scaler_write("grad_scaler_sgd", torch.optim.SGD, foreach=True),
    _grad_scaler_write("grad_scaler_adam_fused", torch.optim.Adam, fused=True),
    Write("load_state_dict", _load_state_dict, version_bump=True),
    Write("load_state_dict_assign", _load_state_dict_assign, version_bump=True),
    Write("vector_to_parameters", _v2p, version_bump=True),  # new storage: seen by address
    Write("vector_to_parameters_reused_vector", _v2p_reused),
    Write("reassign_parameter", _reassign, version_bump=True),  # new storage: seen by address
    Write("nccl_all_gather_into_parameter", _nccl_write),
    Write("raw_storage_copy", _storage_write),
    Write("float_half_roundtrip_then_data_copy", _convert_then_data_copy(lambda m: m.float().half())),
    Write("bfloat16_then_data_copy", _convert_then_data_copy(lambda m: m.to(torch.bfloat16))),
    Write("cpu_cuda_roundtrip_then_data_copy", _convert_then_data_copy(lambda m: m.cpu().cuda())),
    Write("channels_last_then_data_copy", _convert_then_data_copy(lambda m: m.to(memory_format=torch.channels_last)),
          kinds=("encoder",)),
    Write("deepcopy_then_data_copy", _deepcopy_then_data_copy),
]

