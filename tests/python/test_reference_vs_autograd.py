"""The C++ reference (float32 storage, float64 sums) against PyTorch autograd in float64: output, input gradient
and every parameter gradient within 1e-5 normwise relative error."""

import pytest
import torch
from conftest import rel_err

import kfuse

TOL = 1e-5


@pytest.mark.parametrize("hw", [(64, 64), (32, 96)])
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("c", [1, 3, 11])
def test_forward_and_every_gradient_match_float64_autograd(make_reference, c, n, hw):
    seed = 100 * c + 10 * n + hw[1]
    ref = make_reference(in_channels=c, seed=seed, dtype=torch.float64)
    enc = kfuse.ResNetEncoder.from_torch(ref).float()  # the oracle's precision: float32 storage

    gen = torch.Generator().manual_seed(seed)
    x64 = torch.rand(n, c, *hw, generator=gen, dtype=torch.float64).requires_grad_()
    r = torch.randn(n, 512, hw[0] // 32, hw[1] // 32, generator=gen, dtype=torch.float64)

    y_ref = ref(x64)
    (y_ref * r).sum().backward()

    x32 = x64.detach().float().requires_grad_()
    y = enc(x32)
    (y * r.float()).sum().backward()

    assert y.shape == y_ref.shape
    assert rel_err(y, y_ref) < TOL
    assert rel_err(x32.grad, x64.grad) < TOL
    ref_grads = dict(ref.named_parameters())
    for name, p in enc.named_parameters():
        g_ref = ref_grads[name].grad
        assert p.grad is not None, name
        assert g_ref.norm() > 0, f"{name}: zero reference gradient proves nothing"
        assert rel_err(p.grad, g_ref) < TOL, name


def test_float64_reference_is_exact_to_rounding(make_reference):
    ref = make_reference(in_channels=3, base_planes=32, seed=5, dtype=torch.float64)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    assert enc.stem[1].weight.dtype == torch.float64
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64, requires_grad=True)
    (ref(x) ** 2).sum().backward()
    g_ref = x.grad.clone()
    x.grad = None
    (enc(x) ** 2).sum().backward()
    assert rel_err(x.grad, g_ref) < 1e-12
    for (name, p), q in zip(enc.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-12, name


def test_nan_propagates_as_in_pytorch(make_reference):
    ref = make_reference(in_channels=3, base_planes=16, seed=9, dtype=torch.float64)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    x[1, 2, 10, 20] = float("nan")
    with torch.no_grad():
        y, y_ref = enc(x), ref(x)
    assert torch.isnan(y_ref).any()
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    finite = ~torch.isnan(y_ref)
    assert torch.allclose(y[finite], y_ref[finite], rtol=1e-10, atol=1e-12)
    assert not torch.isnan(y[0]).any()  # the other image is untouched


def test_gradients_accumulate_and_input_grad_is_optional(make_reference):
    ref = make_reference(in_channels=1, base_planes=16, seed=3)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    x = torch.rand(2, 1, 32, 32)  # does not require grad: no input gradient is computed
    enc(x).sum().backward()
    first = {n: p.grad.clone() for n, p in enc.named_parameters()}
    enc(x).sum().backward()
    for n, p in enc.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-6, atol=1e-9)
    assert x.grad is None


def test_trains_with_torch_optim(make_reference):
    torch.manual_seed(0)
    enc = kfuse.ResNetEncoder.from_torch(make_reference(in_channels=3, base_planes=16, seed=4))
    opt = torch.optim.SGD(enc.parameters(), lr=0.05)
    x = torch.rand(4, 3, 32, 32)
    target = torch.rand(4, 128, 1, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((enc(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_plain_reference_is_scriptable_for_the_jit_baseline(make_reference):
    ref = make_reference(in_channels=3, base_planes=16, seed=8).eval()
    scripted = torch.jit.script(ref)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(scripted(x), ref(x))
