"""GPU tier: kfuse's ops and modules under PyTorch's compilers on CUDA tensors (skipped without a CUDA GPU). TorchScript
runs the modules' CUDA paths through the scripted program's call back into Python; torch.compile and torch.export
trace the modules into the dispatcher's ops (kfuse/ops.py), whose CUDA implementations run kfuse's engines.

Tolerances: the ops run the modules' own kernels, so op against module is exact (or within float32 rounding of the
gradients' summation order where a recompute replaced a stash); a compiled policy against eager differs by what
Inductor changes around kfuse (fused fp16 elementwise ops, LayerNorm and LSTM kernels): within 2e-2 normwise, the
fp16 bound of the other GPU tests (test_gpu_inference.TOL = 1e-2 for outputs, 2e-2 for gradients)."""

import pytest
import torch

import kfuse
from conftest import rel_err
from test_ops import Policy, _policy_inputs

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")


def _cuda_policy():
    return Policy(dtype=torch.float32).to("cuda", torch.float16)


def _cuda_inputs(uint8=False):
    x, goal, prev, h, c = _policy_inputs(n=8, uint8=uint8, dtype=torch.float32)
    half = torch.float16
    return (x.cuda() if uint8 else x.cuda().to(half), goal.cuda().to(half), prev.cuda(), h.cuda().to(half),
            c.cuda().to(half))


def _outputs_and_grads(policy, run, args):
    actor, critic = run(*args)[:2]
    loss = actor.float().sum() + critic.float().square().sum()
    return (actor, critic), torch.autograd.grad(loss, list(policy.parameters()), allow_unused=True)


@pytest.mark.parametrize("uint8", [False, True], ids=["float", "uint8"])
def test_scripted_policy_matches_eager_on_cuda(uint8):
    policy = _cuda_policy()
    args = _cuda_inputs(uint8)
    scripted = torch.jit.script(policy)
    (outs, grads), (outs_ref, grads_ref) = (_outputs_and_grads(policy, scripted, args),
                                            _outputs_and_grads(policy, policy, args))
    for a, b in zip(outs, outs_ref):
        assert torch.equal(a, b)  # the same kernels on the same inputs
    for name, a, b in zip([n for n, _ in policy.named_parameters()], grads, grads_ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert rel_err(a, b) <= 1e-6 or torch.equal(a, b), name


COMPILED_TOL = 2e-2


def _explain(policy, args, grad):
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad), torch._dynamo.config.patch(allow_rnn=True):
        return torch._dynamo.explain(policy)(*args)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_policy_compiles_fullgraph_on_cuda(grad):
    explained = _explain(_cuda_policy(), _cuda_inputs(), grad)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]


@pytest.mark.parametrize("uint8", [False, True], ids=["float", "uint8"])
def test_compiled_policy_matches_eager_on_cuda(uint8):
    # (the LSTM's final states are left out, as in test_ops.test_policy_compiles_fullgraph)
    torch._dynamo.reset()
    policy = _cuda_policy()
    args = _cuda_inputs(uint8)
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled = torch.compile(policy, fullgraph=True)
        (outs, grads) = _outputs_and_grads(policy, compiled, args)
    (outs_ref, grads_ref) = _outputs_and_grads(policy, policy, args)
    for a, b in zip(outs, outs_ref):
        assert rel_err(a, b) <= COMPILED_TOL
    # Gradients normwise per submodule: a single FixUp scalar's gradient is a sum that cancels to ~1e-5 of its terms
    # in fp16 (ill-conditioned: Inductor's own rounding upstream moves it by more than its size), and the LSTM's
    # recurrent weights get an exact zero from the zero initial state.
    names = [n for n, _ in policy.named_parameters()]
    for part in ("enc.", "actor.", "rnn.", "compress.", "fc."):
        got = [g.flatten().float() for n, g in zip(names, grads) if n.startswith(part) and g is not None]
        want = [g.flatten().float() for n, g in zip(names, grads_ref) if n.startswith(part) and g is not None]
        assert len(got) == len(want), part
        assert rel_err(torch.cat(got), torch.cat(want)) <= COMPILED_TOL, part


def test_reduce_overhead_captures_the_policy_and_follows_writes():
    """mode="reduce-overhead" puts the whole policy (kfuse's kernels included) in Inductor's CUDA graphs: no graph
    skipped, outputs as eager; a write through .data afterwards reaches the replays (the kfuse launches captured in
    the caller's graph check their parameters' bytes themselves)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    policy = _cuda_policy()
    args = _cuda_inputs()
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        compiled = torch.compile(policy, mode="reduce-overhead", fullgraph=True)
        for _ in range(4):  # warm-up, record, replays
            got = [t.clone() for t in compiled(*args)[:2]]
        want = policy(*args)[:2]
        for a, b in zip(got, want):
            assert rel_err(a, b) <= COMPILED_TOL
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        for p in list(policy.enc.parameters()) + list(policy.actor.parameters()):
            p.data.mul_(1.25)
        got = [t.clone() for t in compiled(*args)[:2]]
        want = policy(*args)[:2]
        for a, b in zip(got, want):
            assert rel_err(a, b) <= COMPILED_TOL, "the replay after a write through .data"


def test_encoder_exports_on_cuda():
    enc = kfuse.ResNetEncoder.default_network(3).to("cuda", torch.float16)
    x = torch.rand(4, 3, 64, 64, device="cuda").half()
    with torch.no_grad():
        exported = torch.export.export(enc, (x,))
        assert torch.equal(exported.module()(x), enc(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_encoder_ops_on_cuda_equal_the_module(dtype):
    enc = kfuse.ResNetEncoder.default_network(3, seed=3).to("cuda", dtype)
    params = list(enc.parameters())
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.rand(8, 3, 64, 64, device="cuda", generator=gen).to(dtype)
    dy = torch.randn(8, 512, 2, 2, device="cuda", generator=gen).to(dtype)
    cfg = (3, 64, [1, 1, 1, 1])
    with torch.no_grad():
        assert torch.equal(torch.ops.kfuse.encoder_forward(x, params, *cfg, False), enc(x))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.autograd.grad(enc(xa), [xa] + params, dy)
    y = torch.ops.kfuse.encoder_forward(xb, params, *cfg, True)
    got = torch.autograd.grad(y, [xb] + params, dy)
    for n, a, b in zip(["x"] + [n for n, _ in enc.named_parameters()], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a, b) or rel_err(a, b) <= 1e-6, n
    # The backward without its forward's stash (another training forward of this geometry came in between):
    # recomputed, same gradients.
    y = torch.ops.kfuse.encoder_forward(xb, params, *cfg, True)
    torch.ops.kfuse.encoder_forward(xb, params, *cfg, True)
    got = torch.autograd.grad(y, [xb] + params, dy)
    for n, a, b in zip(["x"] + [n for n, _ in enc.named_parameters()], got, want):
        assert torch.equal(a, b) or rel_err(a, b) <= 1e-6, n


def test_inference_op_on_cuda_follows_every_kind_of_parameter_change():
    """encoder_infer's fast path (launch first, check the parameters are the bound tensors afterwards) against the
    module, bit-exact: repeated calls; after a write through .data; after a parameter tensor is replaced (a new
    storage: the first launch used the old one and must be redone); with another module's parameters of the same
    configuration; a call that needs a gradient is refused."""
    cfg = (3, 64, [1, 1, 1, 1])
    a = kfuse.ResNetEncoder.default_network(3, seed=3).to("cuda", torch.float16)
    b = kfuse.ResNetEncoder.default_network(3, seed=4).to("cuda", torch.float16)
    x = torch.rand(16, 3, 64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).half()
    infer = lambda m: torch.ops.kfuse.encoder_infer(x, list(m.parameters()), *cfg)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(infer(a), a(x))
        p = a.layers[1][0].conv1.weight
        p.data.mul_(-0.5)
        assert torch.equal(infer(a), a(x)), "after a write through .data"
        p.data = p.data.clone() * 1.5
        assert torch.equal(infer(a), a(x)), "after a parameter tensor was replaced"
        assert torch.equal(infer(b), b(x)), "another module's parameters"
        assert torch.equal(infer(a), a(x)), "back to the first module's"
    with pytest.raises(RuntimeError, match="not differentiable"):
        infer(a)


def test_mlp_ops_on_cuda_equal_the_module():
    mlp = kfuse.FusedMLP(32, 16, (64, 64)).to("cuda", torch.float16)
    params = list(mlp.parameters())
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1000, 32, device="cuda", generator=gen).half()
    dy = torch.randn(1000, 16, device="cuda", generator=gen).half()
    with torch.no_grad():
        assert torch.equal(torch.ops.kfuse.mlp_forward(x, params, mlp._kfuse_uid, False), mlp(x))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.autograd.grad(mlp(xa), [xa] + params, dy)
    got = torch.autograd.grad(torch.ops.kfuse.mlp_forward(xb, params, mlp._kfuse_uid, True), [xb] + params, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b) or rel_err(a, b) <= 1e-6


def test_ops_name_parameters_on_another_device():
    enc = kfuse.ResNetEncoder.default_network(3).half()  # CPU parameters
    x = torch.rand(2, 3, 64, 64, device="cuda").half()
    with pytest.raises(ValueError, match="parameter is on cpu"):
        torch.ops.kfuse.encoder_forward(x, list(enc.parameters()), 3, 64, [1, 1, 1, 1], False)
