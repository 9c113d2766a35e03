"""GPU tier: the training backward with gradient_release="per_block" (one autograd node per backward stage, each
handing on the gradients it finalized) against the same module's "at_end" backward: the same kernels in the same
order, so the output is bitwise equal and every gradient and dL/dx equal up to the summation order of the cuDNN
graphs' per-channel sums, which varies from run to run in either mode (float32 sums: a few units of float32's
roundoff; after the cast to fp16/bf16 at most one unit of theirs). A stage that skipped, repeated or mixed up a
gradient differs by O(1). The stages' gradients reach autograd last block first. (Skipped without a CUDA GPU.)"""

import copy

import pytest
import torch

import kfuse
from conftest import rel_err

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")


def _pair(make_reference, dtype, seed, layers=(1, 1, 1, 1)):
    enc = kfuse.ResNetEncoder.from_torch(make_reference(in_channels=3, seed=seed, layers=layers)).cuda().to(dtype)
    enc.train()
    staged = copy.deepcopy(enc)
    staged.gradient_release = "per_block"
    return enc, staged


# Normwise bound of a gradient's run-to-run difference per parameter dtype (see the module's docstring).
_SUM_ORDER_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _step(enc, x, dy, input_grad):
    xk = x.detach().clone().requires_grad_(input_grad)
    enc.zero_grad(set_to_none=True)
    y = enc(xk)
    y.backward(dy.to(y.dtype))
    # Host copies: the step frees every device tensor it allocated, so each step allocates at the same addresses and
    # the CUDA graphs' keys (pointers) repeat, from the second step on.
    return (y.detach().cpu(), {n: p.grad.cpu() for n, p in enc.named_parameters()},
            None if xk.grad is None else xk.grad.cpu())


def _assert_same_step(a, b, tol, where):
    (y0, g0, dx0), (y1, g1, dx1) = a, b
    assert torch.equal(y0, y1), where
    for name in g0:
        assert g1[name] is not None and g1[name].dtype == g0[name].dtype, name
        assert rel_err(g1[name], g0[name]) <= tol, f"{name} ({where}): {rel_err(g1[name], g0[name]):.2e}"
    assert (dx0 is None) == (dx1 is None)
    assert dx0 is None or rel_err(dx1, dx0) <= tol, f"dL/dx ({where}): {rel_err(dx1, dx0):.2e}"


@pytest.mark.parametrize("dtype,layers", [(torch.float16, (1, 1, 1, 1)), (torch.bfloat16, (1, 1, 1, 1)),
                                          (torch.float32, (1, 1, 1, 1)), (torch.float16, (2, 2, 1, 1))])
@pytest.mark.parametrize("input_grad", [False, True])
def test_per_block_release_equals_at_end(make_reference, dtype, layers, input_grad):
    """(2, 2, 1, 1): blocks with identity shortcuts after the first, whose fixup_bias1a their own stage finalizes.)"""
    enc, staged = _pair(make_reference, dtype, seed=61, layers=layers)
    gen = torch.Generator().manual_seed(62)
    x = torch.rand(9, 3, 64, 64, generator=gen).cuda()
    dy = (torch.randn(9, 512, 2, 2, generator=gen) + 1.0).cuda()
    for replay in range(5):  # eager (twice: the allocator settles), captured, replayed
        _assert_same_step(_step(enc, x, dy, input_grad), _step(staged, x, dy, input_grad), _SUM_ORDER_TOL[dtype],
                          f"call {replay}")
    gpu = staged._gpu_engines[(0, torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)][0]
    assert gpu.graph_count >= 1 + gpu.backward_stages  # the steps were captured: a forward and every stage


def test_per_block_release_with_uint8_input(make_reference):
    enc, staged = _pair(make_reference, torch.float16, seed=63)
    x = torch.randint(0, 256, (5, 64, 64, 4), dtype=torch.uint8, device="cuda")  # the renderer's RGBA frames
    dy = torch.randn(5, 512, 2, 2, device="cuda")
    _assert_same_step(_step(enc, x, dy, False), _step(staged, x, dy, False), _SUM_ORDER_TOL[torch.float16], "uint8")


def test_stages_release_the_last_block_first(make_reference):
    """Each parameter's gradient reaches autograd (its post-accumulate hook) in the order of the stage that
    finalizes it: every parameter of the last block before any of the stem's, the stages in order."""
    _, staged = _pair(make_reference, torch.float16, seed=64)
    order = []
    names = {p: n for n, p in staged.named_parameters()}
    for p in staged.parameters():
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[q]))
    x = torch.rand(4, 3, 64, 64, device="cuda")
    staged(x).sum().backward()
    entry = staged._gpu_engines[(0, torch.float16)]
    stage_of = dict(zip([n for n, _ in staged.named_parameters()], entry[0].backward_stage_of_parameters()))
    assert sorted(order) == sorted(names.values())
    stages = [stage_of[n] for n in order]
    assert stages == sorted(stages), list(zip(order, stages))
    assert stages[0] == 0 and stages[-1] == entry[0].backward_stages - 1
    assert stage_of["layers.3.0.conv2.weight"] == 0 and stage_of["stem.1.weight"] == stages[-1]


def test_per_block_release_accumulates_and_recomputes(make_reference):
    """Two backward calls accumulate as at_end's do; a second forward of the same geometry before the first one's
    backward makes the staged backward recompute the first (the stash is per geometry)."""
    enc, staged = _pair(make_reference, torch.float16, seed=65)
    gen = torch.Generator().manual_seed(66)
    xa, xb = (torch.rand(6, 3, 64, 64, generator=gen).cuda() for _ in range(2))
    dy = torch.randn(6, 512, 2, 2, generator=gen).cuda().half()
    grads = []
    for m in (enc, staged):
        m.zero_grad(set_to_none=True)
        ya = m(xa)
        m(xb)
        ya.backward(dy)
        m(xb).backward(dy)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) <= _SUM_ORDER_TOL[torch.float16], n


def test_stages_write_every_gradient_once_as_backward_does(make_reference):
    """Engine level: the stages run one after the other fill a NaN-poisoned gradient buffer and dL/dx completely,
    as backward() does (float32 sums: up to their summation order); a stage out of range is refused by name."""
    _, staged = _pair(make_reference, torch.float16, seed=67)
    x = torch.rand(3, 3, 64, 64, device="cuda")
    staged(x)  # builds the engine and binds the parameters
    gpu = staged._gpu_engines[(0, torch.float16)][0]
    stream = torch.cuda.current_stream().cuda_stream
    y = torch.empty(3, 512, 2, 2, device="cuda", dtype=torch.float16)
    dy = torch.randn_like(y)
    total = sum(p.numel() for p in staged.parameters())
    results = []
    for staged_call in (False, True):
        stash = gpu.forward_train(x, y, stream)
        grads = torch.full((total,), float("nan"), device="cuda")
        dx = torch.full_like(x, float("nan"))
        if staged_call:
            for stage in range(gpu.backward_stages):
                gpu.backward_stage(stage, stash, x, dy, grads, dx, stream)
        else:
            gpu.backward(stash, x, dy, grads, dx, stream)
        torch.cuda.synchronize()
        assert torch.isfinite(grads).all() and torch.isfinite(dx).all()
        results.append((grads, dx))
    assert rel_err(results[1][0], results[0][0]) <= _SUM_ORDER_TOL[torch.float32]
    assert rel_err(results[1][1], results[0][1]) <= _SUM_ORDER_TOL[torch.float32]
    with pytest.raises(ValueError, match="stage 5 is not in"):
        gpu.backward_stage(gpu.backward_stages, stash, x, dy, grads, None, stream)
    stash = gpu.forward_train(x, y, stream)
    with pytest.raises(ValueError, match="stage 2 cannot run now .next in order: 0.; run the stages in order"):
        gpu.backward_stage(2, stash, x, dy, grads, dx, stream)
