"""GPU tier: kfuse's modules compute with the parameters they have NOW, however those were written (skipped without a
CUDA GPU).

kfuse.ResNetEncoder and kfuse.FusedMLP keep their weights packed on the GPU and repack them when a parameter changed.
Programs write parameters in many ways, and several of them do not bump the parameter's version counter: a copy from
fp32 master weights through `.data` (the mixed-precision optimizer pattern of RL trainers), arithmetic on `p.data`,
a collective (NCCL) writing into the storage, a write through a tensor taken from `p.data` long before, and (measured
with torch 2.11) torch.optim's fused=True optimizers, whose _fused_sgd_ / _fused_adam_ kernels update the parameters
in place without bumping their versions. Each test
here builds a module, runs its consumer (the same call several times: eager, then captured and replayed where kfuse
uses CUDA graphs), writes the parameters one way, runs the consumer again and holds every call to a float64 PyTorch
twin of the parameters the module has after the write (within the tolerances of the other GPU tests). It also
asserts that the write changed the answer by far more than the tolerance (CHANGED), so that no test passes because
the old and new weights give the same output; and writes that change very little (one element, a swap of two
elements) must at least change the bits of the output.

Matrix: WRITES (how the parameters are written: weight_write_paths.py) x CONSUMERS (encoder inference under no_grad / inference_mode,
encoder training forward + backward with every parameter gradient, MLP inference, MLP training forward + backward).
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from conftest import captured_by_caller, rel_err

import kfuse
from kfuse import reference
from test_gpu_inference import TOL as ENC_TOL, reference64
from test_gpu_training import (assert_grads_close, away_from_kinks, kfuse_grads, loss_gradient, reference_grads,
                               torch_mixed_grads)
from test_mlp_gpu import TOL as MLP_TOL, make as make_mlp, reference as mlp_reference, rel
from weight_write_paths import (ACC_DTYPE, CHANGED, DEVICE, ENC_FEW, ENC_N, MLP_BATCH, MLP_FEW, WRITES, masters_apply,
                                masters_setup, perturbed, release_nccl)

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")


@pytest.fixture(scope="module", autouse=True)
def _nccl_teardown():
    yield
    release_nccl()



# -- consumers ------------------------------------------------------------------------------------------------------
def _out_dtype(p_dtype: torch.dtype) -> torch.dtype:
    return p_dtype  # float32 modules return float32, fp16 / bf16 modules their dtype


class Measured(SimpleNamespace):
    """ref: the float64 twin's output; outs: the module's outputs, one per call; ref_grads / grads: the flat float64
    gradient and the module's per call (training); errors: what is off the twin."""


def _flat(d: dict, names) -> torch.Tensor:
    return torch.cat([d[n].detach().double().flatten().cpu() for n in names])


class EncoderConsumer:
    kind = "encoder"

    def __init__(self, make_reference, dtype, train, seed):
        self.train = train
        self.module = kfuse.ResNetEncoder.from_torch(make_reference(in_channels=3, seed=seed)).to(DEVICE, dtype)
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.rand(ENC_N, 3, 64, 64, generator=gen)
        self.dy_raw = loss_gradient(ENC_N, gen)
        self.step_x = torch.rand(8, 3, 64, 64, generator=gen)
        self.step_dy = loss_gradient(8, gen)
        self._dev = {}

    def _on_device(self, t, dtype):
        key = (id(t), dtype)
        if key not in self._dev:  # one device copy per dtype: the same address on every call
            self._dev[key] = t.to(DEVICE, dtype)
        return self._dev[key]

    def step_batch(self, m):
        dt = m.stem[1].weight.dtype
        return self._on_device(self.step_x, dt), self.step_dy.to(DEVICE)

    def run(self, m, dy=None):
        dt = m.stem[1].weight.dtype
        x = self._on_device(self.x, dt)
        if self.train:
            dy = self.dy_raw if dy is None else dy
            dyd = dy.to(DEVICE, _out_dtype(dt))
            return [kfuse_grads(m, x, dyd)[:2] for _ in range(3)]  # eager, captured, replayed
        outs = []
        with torch.no_grad():
            outs += [m(x) for _ in range(3)]  # eager, captured, replayed
            outs.append(m(x.clone()))  # a new input address
        with torch.inference_mode():
            outs.append(m(x).clone())
        return outs

    def measure(self, m) -> Measured:
        dt = m.stem[1].weight.dtype
        twin = reference.ResNetEncoder(*m.config)
        twin.load_state_dict({k: v.detach().float().cpu() for k, v in m.state_dict().items()})
        errors = []
        if not self.train:
            outs = self.run(m)
            y64 = reference64(twin, self.x)
            for i, y in enumerate(outs):
                e = rel_err(y, y64)
                if not e <= ENC_TOL:
                    errors.append(f"call {i}: output off by {e:.2e} (bound {ENC_TOL:.0e})")
            return Measured(ref=y64, outs=outs, errors=errors, ref_grads=None, grads=None)
        dy = away_from_kinks(twin, self.x, self.dy_raw)
        runs = self.run(m, dy)
        y64, g64, _ = reference_grads(twin, self.x, dy)
        precision = torch.bfloat16 if dt == torch.bfloat16 else torch.float16
        mixed = torch_mixed_grads(twin, self.x, dy, precision, realizations=3)
        for i, (y, g) in enumerate(runs):
            e = rel_err(y, y64)
            if not e <= ENC_TOL:
                errors.append(f"call {i}: output off by {e:.2e} (bound {ENC_TOL:.0e})")
            try:
                assert_grads_close(g, g64, mixed)
            except AssertionError as err:
                errors.append(f"call {i}: {str(err).splitlines()[0]}")
        names = list(g64)
        return Measured(ref=y64, outs=[y for y, _ in runs], errors=errors, ref_grads=_flat(g64, names),
                        grads=[_flat(g, names) for _, g in runs])


class MlpConsumer:
    kind = "mlp"

    def __init__(self, make_reference, dtype, train, seed):
        self.train = train
        self.module = make_mlp(32, [64, 64], 16, dtype=dtype, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(MLP_BATCH, 32, generator=gen)
        self.dy = torch.randn(MLP_BATCH, 16, generator=gen)
        self.step_x = torch.randn(256, 32, generator=gen)
        self.step_dy = torch.randn(256, 16, generator=gen)
        self._dev = {}

    def _on_device(self, t, dtype):
        key = (id(t), dtype)
        if key not in self._dev:
            self._dev[key] = t.to(DEVICE, dtype)
        return self._dev[key]

    def step_batch(self, m):
        return self._on_device(self.step_x, m.layers[0].weight.dtype), self.step_dy.to(DEVICE)

    def run(self, m):
        dt = m.layers[0].weight.dtype
        x = self._on_device(self.x, dt)
        if self.train:
            dy = self._on_device(self.dy, _out_dtype(dt))
            params = [p for _, p in m.named_parameters()]
            runs = []
            for _ in range(3):
                y = m(x)
                runs.append((y.detach(), torch.autograd.grad(y, params, dy)))
            return runs
        outs = []
        with torch.no_grad():
            outs += [m(x) for _ in range(3)]
            outs.append(m(x.clone()))
        with torch.inference_mode():
            outs.append(m(x).clone())
        return outs

    def measure(self, m) -> Measured:
        dt = m.layers[0].weight.dtype
        compute = torch.bfloat16 if dt == torch.bfloat16 else torch.float16
        x = self._on_device(self.x, dt)
        tol = MLP_TOL[compute]
        errors = []
        if not self.train:
            outs = self.run(m)
            _, y64 = mlp_reference(m, x, torch.float64)
            _, yh = mlp_reference(m, x, compute)
            bound = max(tol, 4 * rel(yh, y64))
            for i, y in enumerate(outs):
                e = rel(y, y64)
                if not e <= bound:
                    errors.append(f"call {i}: output off by {e:.2e} (bound {bound:.1e})")
            return Measured(ref=y64.detach(), outs=outs, errors=errors, ref_grads=None, grads=None)
        runs = self.run(m)
        dy = self._on_device(self.dy, _out_dtype(dt))
        ref64, y64 = mlp_reference(m, x, torch.float64)
        g64 = torch.autograd.grad(y64, list(ref64.parameters()), dy.double())
        refh, yh = mlp_reference(m, x, compute)
        gh = torch.autograd.grad(yh, list(refh.parameters()), dy.to(compute))
        names = [n for n, _ in m.named_parameters()]
        out_bound = max(tol, 4 * rel(yh, y64))
        for i, (y, g) in enumerate(runs):
            e = rel(y, y64)
            if not e <= out_bound:
                errors.append(f"call {i}: output off by {e:.2e} (bound {out_bound:.1e})")
            for n, gk, gr, gt in zip(names, g, g64, gh):
                e, et = rel(gk, gr), rel(gt, gr)
                if not e <= max(tol, 4 * et):
                    errors.append(f"call {i}: {n}.grad off by {e:.2e} (torch {et:.2e})")
        return Measured(ref=y64.detach(), outs=[y for y, _ in runs], errors=errors,
                        ref_grads=torch.cat([g.double().flatten().cpu() for g in g64]),
                        grads=[torch.cat([t.double().flatten().cpu() for t in g]) for _, g in runs])


CONSUMERS = {
    "encoder_inference": (EncoderConsumer, False),
    "encoder_training": (EncoderConsumer, True),
    "mlp_inference": (MlpConsumer, False),
    "mlp_training": (MlpConsumer, True),
}


def _assert_follows(before: Measured, after: Measured, material: bool, label: str) -> None:
    """after's calls hold to the twin of the new parameters; the write made a difference to the twin and to kfuse."""
    moved = rel_err(after.ref, before.ref)
    moved_grads = None if after.ref_grads is None else rel_err(after.ref_grads, before.ref_grads)
    if material:
        assert moved >= CHANGED, (f"{label}: the write moved the float64 reference's output by only {moved:.2e} "
                                  f"(< {CHANGED}): the test cannot tell old weights from new ones")
        if moved_grads is not None:
            assert moved_grads >= CHANGED, f"{label}: the write moved the reference gradient by only {moved_grads:.2e}"
    # A module within tolerance of the new twin moved by about as much as the twin did (>= CHANGED, against
    # tolerances <= CHANGED / 3): one that moved by less than half of that kept (some of) the old weights.
    stale = []
    for i, y in enumerate(after.outs):
        y0 = before.outs[min(i, len(before.outs) - 1)]
        if material:
            d = rel_err(y, y0)
            if d < moved / 2:
                stale.append(f"call {i}: output moved by {d:.2e} from the pre-write output, the reference by "
                             f"{moved:.2e}")
        elif torch.equal(y, y0):
            stale.append(f"call {i}: output bit-identical to the pre-write output")
    if after.grads is not None:
        for i, g in enumerate(after.grads):
            g0 = before.grads[i]
            if material:
                d = rel_err(g, g0)
                if d < moved_grads / 2:
                    stale.append(f"call {i}: gradient moved by {d:.2e} from the pre-write gradient, the reference's "
                                 f"by {moved_grads:.2e}")
            elif torch.equal(g, g0):
                stale.append(f"call {i}: gradient bit-identical to the pre-write gradient")
    assert not stale and not after.errors, (
        f"{label}: after the write the module does not compute with its new parameters "
        f"({'stale weights? ' if stale else ''}{'; '.join(stale + after.errors)})")


def _seed(*parts) -> int:
    return 5000 + zlib.crc32("/".join(parts).encode()) % 10000


@pytest.mark.parametrize("consumer,write", [pytest.param(c, w, id=f"{c}-{w.name}") for c in CONSUMERS
                                              for w in WRITES if CONSUMERS[c][0].kind in w.kinds])
def test_module_computes_with_the_written_weights(make_reference, tmp_path, consumer, write):
    cls, train = CONSUMERS[consumer]
    seed = _seed(consumer, write.name)
    c = cls(make_reference, write.dtype, train, seed)
    m = c.module
    def run(module):  # a write's call in between (Write.apply runs under no_grad; training needs autograd)
        with torch.enable_grad():
            return c.run(module)

    ctx = SimpleNamespace(gen=torch.Generator().manual_seed(seed + 2), kind=cls.kind, run=run,
                          step_batch=c.step_batch, few=ENC_FEW if cls.kind == "encoder" else MLP_FEW,
                          tmp_dir=str(tmp_path))
    write.setup(m, ctx)
    before = c.measure(m)  # eager, captured, replayed: caches and graphs exist when the write comes
    assert not before.errors, f"before any write: {before.errors}"
    if not train and not write.material:  # a bit-level comparison needs bit-reproducible calls
        assert all(torch.equal(y, before.outs[0]) for y in before.outs[:4]), "repeated calls differ"
    if train and not write.material and not all(torch.equal(y, before.outs[0]) for y in before.outs):
        pytest.skip("the training forward is not bit-reproducible here: a bit-level comparison means nothing")
    m = write.apply(m, ctx)
    after = c.measure(m)
    _assert_follows(before, after, write.material, f"{consumer} after {write.name}")
    if hasattr(ctx, "original"):  # the deep copy's writes stay in the copy
        orig = c.measure(ctx.original)
        assert not orig.errors, f"the original after its copy was written: {orig.errors}"
        assert rel_err(orig.ref, before.ref) <= 1e-12, "writing the copy changed the original's parameters"


# -- gradient accumulation across a .data write ---------------------------------------------------------------------
def test_encoder_gradients_accumulate_across_a_data_copy(make_reference):
    """forward/backward, p.data.copy_(new) for every parameter (fp32 masters into an fp16 module), forward/backward:
    .grad must be the old weights' gradient of the first batch plus the NEW weights' gradient of the second."""
    seed = 6100
    ref = make_reference(in_channels=3, seed=seed)
    m = kfuse.ResNetEncoder.from_torch(ref).to(DEVICE, ACC_DTYPE)
    gen = torch.Generator().manual_seed(seed + 1)
    x1, x2 = torch.rand(ENC_N, 3, 64, 64, generator=gen), torch.rand(ENC_N, 3, 64, 64, generator=gen)
    dy1, dy2 = loss_gradient(ENC_N, gen), loss_gradient(ENC_N, gen)
    ctx = SimpleNamespace(gen=torch.Generator().manual_seed(seed + 2))
    masters_setup(m, ctx)
    names = [n for n, _ in m.named_parameters()]

    def twin():
        t = reference.ResNetEncoder(*m.config)
        t.load_state_dict({k: v.detach().float().cpu() for k, v in m.state_dict().items()})
        return t

    old = twin()
    dy1 = away_from_kinks(old, x1, dy1)
    x1d, x2d = x1.to(DEVICE, ACC_DTYPE), x2.to(DEVICE, ACC_DTYPE)
    for _ in range(2):  # the training graphs captured and replayed before the accumulation starts
        kfuse_grads(m, x1d, dy1.to(DEVICE, ACC_DTYPE))
    m.zero_grad(set_to_none=True)
    m(x1d).backward(dy1.to(DEVICE, ACC_DTYPE))
    with torch.no_grad():
        masters_apply(m, ctx)
    new = twin()
    dy2 = away_from_kinks(new, x2, dy2)
    m(x2d).backward(dy2.to(DEVICE, ACC_DTYPE))
    got = {n: p.grad for n, p in m.named_parameters()}
    g_old1 = reference_grads(old, x1, dy1)[1]
    g_new2 = reference_grads(new, x2, dy2)[1]
    g_old2 = reference_grads(old, x2, dy2)[1]
    want = {n: g_old1[n] + g_new2[n] for n in names}
    stale = {n: g_old1[n] + g_old2[n] for n in names}
    moved = rel_err(_flat(want, names), _flat(stale, names))
    assert moved >= CHANGED, f"the write moved the accumulated reference gradient by only {moved:.2e}"
    m1 = torch_mixed_grads(old, x1, dy1, torch.float16, realizations=3)
    m2 = torch_mixed_grads(new, x2, dy2, torch.float16, realizations=3)
    mixed = [{n: a[n] + b[n] for n in names} for a, b in zip(m1, m2)]
    assert_grads_close(got, want, mixed)


def test_mlp_gradients_accumulate_across_a_data_copy():
    """As above for the MLP (fp16 module, fp32 masters)."""
    m = make_mlp(32, [64, 64], 16, dtype=ACC_DTYPE, seed=6200)
    gen = torch.Generator().manual_seed(6201)
    x1, x2 = (torch.randn(MLP_BATCH, 32, generator=gen).to(DEVICE, ACC_DTYPE) for _ in range(2))
    dy1, dy2 = (torch.randn(MLP_BATCH, 16, generator=gen).to(DEVICE, ACC_DTYPE) for _ in range(2))
    ctx = SimpleNamespace(gen=torch.Generator().manual_seed(6202))
    masters_setup(m, ctx)
    params = [p for _, p in m.named_parameters()]
    for _ in range(2):
        torch.autograd.grad(m(x1), params, dy1)
    m.zero_grad(set_to_none=True)

    def ref_grads(x, dy, dtype):
        r, y = mlp_reference(m, x, dtype)
        return [g.double() for g in torch.autograd.grad(y, list(r.parameters()), dy.to(dtype))]

    old64, oldh = ref_grads(x1, dy1, torch.float64), ref_grads(x1, dy1, torch.float16)
    old64_2 = ref_grads(x2, dy2, torch.float64)
    m(x1).backward(dy1)
    with torch.no_grad():
        masters_apply(m, ctx)
    new64, newh = ref_grads(x2, dy2, torch.float64), ref_grads(x2, dy2, torch.float16)
    m(x2).backward(dy2)
    names = [n for n, _ in m.named_parameters()]
    want = [a + b for a, b in zip(old64, new64)]
    stale = [a + b for a, b in zip(old64, old64_2)]
    torch_ = [a + b for a, b in zip(oldh, newh)]
    flat = lambda gs: torch.cat([g.flatten().cpu() for g in gs])  # noqa: E731
    assert rel(flat(want), flat(stale)) >= CHANGED
    for n, p, w, t in zip(names, params, want, torch_):
        e, et = rel(p.grad, w), rel(t, w)
        assert e <= max(MLP_TOL[torch.float16], 4 * et), f"{n}.grad: {e:.2e} (torch {et:.2e})"


def test_encoder_in_a_callers_cuda_graph_follows_writes(make_reference):
    """The caller captures kfuse's forward in its own CUDA graph (as torch.compile's reduce-overhead mode does). After
    a write through .data, the replay must compute with the new weights; and so must kfuse's own graphs when a
    geometry with prepared filters is first run between the write and the replay (the caller's graph repacks only
    what existed at its capture, and must not consume the change that kfuse's own graphs still have to see)."""
    ref = make_reference(in_channels=3, seed=41)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(42)
    x = torch.rand(4, 3, 64, 64, generator=gen)
    x_big = torch.rand(64, 3, 64, 64, generator=gen)
    xd, xd_big = x.cuda().half(), x_big.cuda().half()
    graph, y = captured_by_caller(enc, xd)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, reference64(ref, x)) <= ENC_TOL, "replay before the write"
    with torch.no_grad():
        enc(xd_big)  # a geometry first run after the capture: its prepared filters are not in the caller's graph
    for step in range(2):
        with torch.no_grad():
            for p, q in zip(enc.parameters(), ref.parameters()):
                new = q * (0.6 if step == 0 else 1.3)
                q.copy_(new)
                p.data.copy_(new)
            graph.replay()  # the caller's graph sees the write first
            torch.cuda.synchronize()
            assert rel_err(y, reference64(ref, x)) <= ENC_TOL, f"the caller's graph after write {step}"
            for k in range(3):  # kfuse's own graph of the other geometry must still see it
                assert rel_err(enc(xd_big), reference64(ref, x_big)) <= ENC_TOL, f"kfuse's graph, call {k}, write {step}"


# -- each parameter alone -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [16, 128])
def test_encoder_inference_follows_a_write_of_each_parameter_alone(make_reference, batch):
    """Writing any single parameter through .data, with nothing else changed, must reach the next replay of the
    captured inference forward: the fingerprint must cover every parameter (the first and the last of its chunk
    table, the one-element FixUp scalars, the stem), and a forward that checked some of them late (after their first
    reader; block i + 1's fixup_bias1a is read by block i's last kernel) would compute with an old value. Batch 128 is
    the benchmark's shape (its own kernel choices); 16 the other tests'."""
    ref = make_reference(in_channels=3, seed=77)
    enc = kfuse.ResNetEncoder.from_torch(ref).to(DEVICE, torch.float16)
    gen = torch.Generator().manual_seed(78)
    x = torch.rand(batch, 3, 64, 64, generator=gen)
    xd = x.to(DEVICE, torch.float16)
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed
            before = enc(xd).clone()
    failures = []
    params = dict(enc.named_parameters())
    ref_params = dict(ref.named_parameters())
    for name, p in params.items():
        with torch.no_grad():
            new = perturbed(p, gen)
            p.data.copy_(new)
            ref_params[name].copy_(p.detach().float().cpu())  # the values the module holds (fp16-rounded)
            outs = [enc(xd).clone() for _ in range(2)]
        y64 = reference64(ref, x)
        for i, y in enumerate(outs):
            e = rel_err(y, y64)
            if not e <= ENC_TOL:
                failures.append(f"{name}, call {i}: output off by {e:.2e} (bound {ENC_TOL:.0e})")
        if torch.equal(outs[0], before):
            failures.append(f"{name}: output bit-identical to the one before its write")
        before = outs[-1]
    assert not failures, "; ".join(failures)
