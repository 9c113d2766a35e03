"""kfuse.FusedMLP, GPU tier (skipped without a CUDA device): forward and backward of the generated kernels against
a float64 reference for the benchmark's widths, batches and activations; both weight-gradient paths (fused in the
backward kernel, and dz + cuBLAS); poisoned outputs; dL/dx; autograd; the kernel cache across engines."""

import gc
import math
import os

import pytest
import torch
from torch import nn

import kfuse
from kfuse import Activation, FusedMLP

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU (sm_80+) and a CUDA build")

WIDTHS = [16, 32, 48, 64, 80, 128, 256]
BATCHES = [1, 127, 65539]
BUILTINS = ["relu", "leaky_relu", "sigmoid", "tanh", "silu", "gelu", "softplus", "identity"]
# Normwise relative error bounds: a few units of the storage format's rounding through the layers, and never
# worse than 4x PyTorch's own error in the same dtype (whichever is larger).
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def softsign():
    return Activation("softsign", "x / (1.0f + fabsf(x))", "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))",
                      torch_fn=lambda x: x / (1 + x.abs()))


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(in_w, hidden, out_w, act="relu", out_act="identity", dtype=torch.float16, seed=0, bias=True):
    torch.manual_seed(seed)
    m = FusedMLP(in_w, out_w, hidden, activation=act, output_activation=out_act, bias=bias)
    with torch.no_grad():  # biases of the size of the weights' contribution: they matter
        for layer in m.layers:
            if layer.bias is not None:
                layer.bias.uniform_(-0.5, 0.5)
    return m.cuda().to(dtype)


def reference(m: FusedMLP, x: torch.Tensor, dtype=torch.float64):
    """The same MLP in plain PyTorch at `dtype` (float64: the reference; the module's dtype: PyTorch's own error)."""
    ref = FusedMLP(m.input_width, m.output_width, m.hidden_widths, m.activations, m.output_activation, m.bias_flags)
    ref.load_state_dict(m.state_dict())
    ref = ref.to(device=x.device, dtype=dtype)
    return ref, ref.forward_torch(x.to(dtype))


def check_forward_backward(m, x, dtype, need_dx=True):
    x = x.detach().clone().requires_grad_(need_dx)
    y = m(x)
    assert y.dtype == dtype and y.shape == (x.shape[0], m.output_width)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref64, y64 = reference(m, x.detach().requires_grad_(need_dx), torch.float64)
    xr = x.detach().double().requires_grad_(need_dx)
    y64 = ref64.forward_torch(xr)
    y64.backward(dy.double())
    refh, _ = reference(m, x.detach(), dtype)
    xh = x.detach().clone().requires_grad_(need_dx)
    yh = refh.forward_torch(xh)
    yh.backward(dy)
    bound = lambda torch_err: max(TOL[dtype], 4 * torch_err)  # noqa: E731
    assert rel(y, y64) <= bound(rel(yh, y64)), f"forward: {rel(y, y64):.2e} (torch {rel(yh, y64):.2e})"
    for (name, p), p64, ph in zip(m.named_parameters(), ref64.parameters(), refh.parameters()):
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        e, et = rel(p.grad, p64.grad), rel(ph.grad, p64.grad)
        assert e <= bound(et), f"{name}.grad: {e:.2e} (torch {et:.2e})"
    if need_dx:
        e, et = rel(x.grad, xr.grad), rel(xh.grad, xr.grad)
        assert e <= bound(et), f"dL/dx: {e:.2e} (torch {et:.2e})"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("batch", BATCHES)
def test_widths_and_batches_fp16(width, batch):
    m = make(32, [width] * 4, 16)
    x = torch.randn(batch, 32, device="cuda")
    check_forward_backward(m, x, torch.float16)


@pytest.mark.parametrize("act", BUILTINS + ["user"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_activation(act, dtype):
    a = softsign() if act == "user" else act
    m = make(19, [64, 48, 80], 7, act=a, out_act=a if act in ("sigmoid", "tanh", "user") else "identity",
             dtype=dtype, seed=3)
    check_forward_backward(m, torch.randn(127, 19, device="cuda"), dtype)


@pytest.mark.parametrize("width", [64, 256])
def test_bf16_and_odd_io_widths(width):
    m = make(3, [width, 16, width], 5, act="silu", dtype=torch.bfloat16, bias=[True, False, True, False])
    check_forward_backward(m, torch.randn(65539, 3, device="cuda"), torch.bfloat16)


@pytest.mark.parametrize("variant", [(1, 4, True, 64), (2, 4, True, 64), (1, 8, False, 32), (2, 4, False, 64)])
def test_every_variant_agrees_with_the_reference(variant):
    m = make(32, [64, 128, 64], 16, act="gelu")
    engine = m.engine(torch.device("cuda", 0), torch.float16, variant)
    m._engines[(0, torch.float16, None)] = engine  # forward() uses this variant
    check_forward_backward(m, torch.randn(1000, 32, device="cuda"), torch.float16)


# Both backward paths on the same shapes: fused weight gradients (accumulated in the backward kernel, per-CTA
# partials summed by a reduction kernel) and the dz + cuBLAS path, with the same row tiling.
FUSED_CASES = {
    "w64_relu": dict(in_w=32, hidden=[64] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                     variant=(1, 8, True, 64), batches=[1, 127, 65539]),
    "odd_io_silu_bf16": dict(in_w=3, hidden=[48, 16, 32], out_w=5, act="silu", dtype=torch.bfloat16,
                             bias=[True, False, True, False], variant=(1, 8, True, 64), batches=[1000]),
    "in24_tanh_mt2": dict(in_w=24, hidden=[32, 32], out_w=8, act="tanh", dtype=torch.float16, bias=True,
                          variant=(2, 4, True, 64), batches=[127, 4099]),
    "w64_relu_recompute4": dict(in_w=32, hidden=[64] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                                variant=(1, 8, True, 64), recompute=4, batches=[1, 127, 65539]),
    "odd_tanh_bf16_recompute2": dict(in_w=3, hidden=[48, 16, 32], out_w=5, act="tanh", dtype=torch.bfloat16,
                                     bias=[False, True, False, True], variant=(1, 8, True, 64), recompute=2,
                                     batches=[1000]),
    "w16_sigmoid_out": dict(in_w=19, hidden=[16, 16, 16], out_w=7, act="relu", out_act="sigmoid",
                            dtype=torch.float16, bias=True, variant=(2, 4, True, 64), batches=[65539]),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused_wgrad", "cublas_wgrad"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_both_weight_gradient_paths_agree_with_the_reference(case, fused):
    c = FUSED_CASES[case]
    m = make(c["in_w"], c["hidden"], c["out_w"], act=c["act"], out_act=c.get("out_act", "identity"),
             dtype=c["dtype"], seed=4, bias=c["bias"])
    rc = c.get("recompute", 0)
    if rc and not fused:  # recomputed activations exist only beside the fused weight gradients: a clear error
        with pytest.raises(ValueError, match="recomputed activations need the fused weight gradients"):
            m.engine(torch.device("cuda", 0), c["dtype"], (*c["variant"], False, False, rc))
        return
    engine = m.engine(torch.device("cuda", 0), c["dtype"], (*c["variant"], fused) + ((False, rc) if rc else ()))
    assert ("_fw" in engine.build_info["variant"]) == fused
    assert engine.build_info["variant"].endswith(f"_rc{rc}" if rc else ("_fw" if fused else "_resident"))
    m._engines[(0, c["dtype"], None)] = engine  # forward() and backward use this variant
    for batch in c["batches"]:
        m.zero_grad(set_to_none=True)
        check_forward_backward(m, torch.randn(batch, c["in_w"], device="cuda"), c["dtype"])


def is_hopper():
    return torch.cuda.get_device_capability(0) == (9, 0)


# The wgmma forward (sm_90a): two chains per warpgroup at width 64, one past it, odd input/output widths, bf16, a
# stashed pre-activation (gelu), layers without bias; forward, training forward (its stash feeds the mma.sync
# backward) and every gradient.
WGMMA_CASES = {
    "w64_mt2_w8": dict(in_w=32, hidden=[64] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                       variant=(2, 8, True, 64, False, True)),
    "w64_mt1_w8_fw_recompute4": dict(in_w=32, hidden=[64] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                                     variant=(1, 8, True, 64, True, True, 4)),
    "w128_mt1_w8": dict(in_w=32, hidden=[128] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                        variant=(1, 8, True, 64, False, True)),
    "odd_io_silu_bf16_mt1_w4": dict(in_w=3, hidden=[48, 16, 80], out_w=5, act="silu", dtype=torch.bfloat16,
                                    bias=[True, False, True, False], variant=(1, 4, True, 64, False, True)),
    "gelu_mixed_mt2_w4_fw": dict(in_w=19, hidden=[64, 48, 32], out_w=7, act="gelu", dtype=torch.float16, bias=True,
                                 variant=(2, 4, True, 64, True, True)),
    # The wgmma backward: two warpgroups at the bench's shape; one warpgroup, bf16 tanh; an odd network with both
    # weight-gradient orientations, a padded M, a layer without bias and a sigmoid output (derivative from y).
    "w64_wgmma_backward_w8": dict(in_w=32, hidden=[64] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                                  variant=(1, 8, True, 64, True, True, 4, True)),
    "w64_wgmma_backward_w4_tanh_bf16": dict(in_w=32, hidden=[64] * 4, out_w=16, act="tanh", dtype=torch.bfloat16,
                                            bias=True, variant=(1, 4, True, 64, True, True, 4, True)),
    "odd_wgmma_backward_bf16": dict(in_w=3, hidden=[64, 48], out_w=5, act="tanh", out_act="sigmoid",
                                    dtype=torch.bfloat16, bias=[True, False, True],
                                    variant=(1, 8, True, 64, True, True, 2, True)),
    # With external weight gradients (cuBLAS over the h and dz the kernel stores): the bench's width 128 with one and
    # two warpgroups; bf16 tanh, whose f' of an external layer's input comes back from the stash, with an external
    # layer without bias.
    "w128_wgmma_backward_w8": dict(in_w=32, hidden=[128] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                                   variant=(1, 8, True, 64, True, True, 4, True)),
    "w128_wgmma_backward_w4": dict(in_w=32, hidden=[128] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                                   variant=(1, 4, True, 64, True, True, 4, True)),
    # Every hidden output from the stash (recompute 0: tiles by cp.async, f' read back), at 128 and at 64, and one
    # of two recomputed in an odd bf16 network.
    "w128_wgmma_backward_stashed": dict(in_w=32, hidden=[128] * 4, out_w=16, act="relu", dtype=torch.float16,
                                        bias=True, variant=(1, 8, True, 64, True, True, 0, True)),
    "w64_wgmma_backward_stashed_w4_tanh": dict(in_w=32, hidden=[64] * 4, out_w=16, act="tanh", dtype=torch.float16,
                                               bias=True, variant=(1, 4, True, 64, True, True, 0, True)),
    "odd_wgmma_backward_recompute1_bf16": dict(in_w=3, hidden=[64, 48], out_w=5, act="tanh", out_act="sigmoid",
                                               dtype=torch.bfloat16, bias=[True, False, True],
                                               variant=(1, 8, True, 64, True, True, 1, True)),
    "external_tanh_bf16_wgmma_backward": dict(in_w=32, hidden=[128] * 3, out_w=16, act="tanh", dtype=torch.bfloat16,
                                              bias=[True, False, True, True],
                                              variant=(1, 8, True, 64, True, True, 3, True)),
    # Streamed weights (the default at width 256 on Hopper): the bench's network, and an odd bf16 network with a loop
    # over two hidden layers that stash their pre-activation (gelu), missing biases, one warpgroup, 32-column chunks.
    "w256_stream_w8": dict(in_w=32, hidden=[256] * 4, out_w=16, act="relu", dtype=torch.float16, bias=True,
                           variant=(1, 8, False, 64, False, True)),
    "odd_stream_gelu_bf16_w4": dict(in_w=3, hidden=[48, 256, 256, 256, 80], out_w=5, act="gelu",
                                    dtype=torch.bfloat16, bias=[True, False, False, False, True, False],
                                    variant=(1, 4, False, 32, False, True)),
}


@pytest.mark.parametrize("case", list(WGMMA_CASES))
def test_wgmma_forward_agrees_with_the_reference(case):
    if not is_hopper():
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    c = WGMMA_CASES[case]
    m = make(c["in_w"], c["hidden"], c["out_w"], act=c["act"], out_act=c.get("out_act", "identity"), dtype=c["dtype"],
             seed=5, bias=c["bias"])
    engine = m.engine(torch.device("cuda", 0), c["dtype"], c["variant"])
    assert "_wg" in engine.build_info["variant"] and engine.build_info["arch"] == "sm_90a"
    assert engine.build_info["variant"].endswith("_wgb") == (len(c["variant"]) == 8 and c["variant"][7])
    m._engines[(0, c["dtype"], None)] = engine  # forward() and backward use this variant
    for batch in [1, 127, 65539]:
        x = torch.randn(batch, c["in_w"], device="cuda")
        with torch.no_grad():
            y = m(x.to(c["dtype"]))
            _, y64 = reference(m, x, torch.float64)
            _, yh = reference(m, x, c["dtype"])
        assert rel(y, y64) <= max(TOL[c["dtype"]], 4 * rel(yh, y64)), f"inference forward, batch {batch}"
        m.zero_grad(set_to_none=True)
        check_forward_backward(m, x, c["dtype"])


def test_wgmma_variant_needs_hopper():
    if is_hopper():
        pytest.skip("runs on GPUs other than compute capability 9.0")
    m = make(32, [64] * 2, 16)
    with pytest.raises(NotImplementedError, match="wgmma forward needs a compute capability 9.0"):
        m.engine(torch.device("cuda", 0), torch.float16, (1, 4, True, 64, False, True))


@pytest.mark.parametrize("variant", [(1, 8, True, 64, True), (1, 8, True, 64, True, True, 4, True)],
                         ids=["mma_sync", "wgmma_backward"])
def test_fused_weight_gradients_are_deterministic(variant):
    if len(variant) > 5 and not is_hopper():
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    m = make(32, [64] * 4, 16, seed=6)
    engine = m.engine(torch.device("cuda", 0), torch.float16, variant)
    m._engines[(0, torch.float16, None)] = engine
    x = torch.randn(100_003, 32, device="cuda", dtype=torch.float16)
    dy = torch.randn(100_003, 16, device="cuda", dtype=torch.float16)
    runs = []
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        m(x).backward(dy)
        runs.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.equal(runs[0], runs[1])


def test_default_variant_fuses_weight_gradients_where_they_fit():
    # width 64: every gradient inside the kernel; 128: the biases and the first layer's weights (the rest by
    # cuBLAS); 256: streamed weights, no fused gradients, and on Hopper the wgmma forward
    for width, fused in ((64, True), (128, True), (256, False)):
        m = make(32, [width] * 4, 16)
        name = m.engine(torch.device("cuda", 0), torch.float16).build_info["variant"]
        assert name.endswith("_fw") == fused
        if width == 256:
            assert name == ("mt1_w8_stream64_wg" if is_hopper() else "mt1_w8_stream64")


@pytest.mark.parametrize("variant", [None, (1, 4, True, 64, False), (1, 8, True, 64, True, False, 2),
                                     (1, 8, True, 64, True, True, 2, True), (1, 8, True, 64, True, True, 0, True),
                                     (1, 8, False, 32, False, True)],
                         ids=["default", "cublas_wgrad", "recompute2", "wgmma_backward", "wgmma_backward_stashed",
                              "wgmma_stream"])
@pytest.mark.parametrize("width", [64, 128])
def test_outputs_poisoned_before_the_run_are_overwritten(variant, width):
    """Outputs and the stash start as NaN: every output is written, and the backward reads only stash arrays its
    forward_train wrote (with recomputed activations, the first layers' arrays stay NaN) or it wrote itself (the
    wgmma backward's inputs of external weight gradients, at width 128)."""
    if variant is not None and len(variant) > 5 and variant[5] and not is_hopper():
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    if width == 128 and variant is not None and len(variant) == 7:
        pytest.skip("the mma.sync backward cannot recompute at width 128 (its layer 1 weight gradient is cuBLAS's)")
    m = make(32, [width, width], 10, act="tanh")
    dev = torch.device("cuda", 0)
    e = m.engine(dev, torch.float16, variant)
    params = m._params()
    packed = m._packed_weights(e, params, torch.float16)
    batch = 333
    x = torch.randn(batch, 32, device=dev, dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    for train in (False, True):
        y = torch.full((batch, 10), float("nan"), device=dev, dtype=torch.float16)
        stash = torch.full((e.stash_bytes(batch),), 0xFF, dtype=torch.uint8, device=dev)
        (e.forward_train(packed, x, y, stash, stream) if train else e.forward(packed, x, y, stream))
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
        _, y64 = reference(m, x, torch.float64)
        assert rel(y, y64) < TOL[torch.float16]
    dy = torch.randn(batch, 10, device=dev, dtype=torch.float16)
    ws = torch.full((e.backward_workspace_bytes(batch),), 0xFF, dtype=torch.uint8, device=dev)
    grads = torch.full((e.num_parameters,), float("nan"), device=dev)
    dx = torch.full((batch, 32), float("nan"), device=dev, dtype=torch.float16)
    e.backward(packed, x, y, dy, stash, ws, grads, dx, stream)
    torch.cuda.synchronize()
    assert torch.isfinite(grads).all() and torch.isfinite(dx).all()
    ref, y64 = reference(m, x.detach().requires_grad_(True), torch.float64)
    xr = x.double().requires_grad_(True)
    ref.forward_torch(xr).backward(dy.double())
    flat = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert rel(grads, flat) < 1e-2
    assert rel(dx, xr.grad) < 1e-2
    # The gradients in the MLP's dtype (what FusedMLP asks for): the float32 sums rounded once, every entry written.
    grads16 = torch.full((e.num_parameters,), float("nan"), device=dev, dtype=torch.float16)
    e.backward(packed, x, y, dy, stash, ws, grads16, None, stream)
    torch.cuda.synchronize()
    assert torch.isfinite(grads16).all()
    assert rel(grads16, grads) < 2e-3
    with pytest.raises(ValueError, match="gradient buffer has dtype bfloat16, expected float16"):
        e.backward(packed, x, y, dy, stash, ws, grads16.view(torch.bfloat16), None, stream)


def test_dx_only_when_asked_and_parameter_grads_only_when_needed():
    m = make(32, [64, 64], 16)
    x = torch.randn(100, 32, device="cuda", dtype=torch.float16)
    m(x).sum().backward()  # x does not require grad: no dL/dx
    assert x.grad is None and all(p.grad is not None for p in m.parameters())
    m.zero_grad(set_to_none=True)
    for p in m.parameters():
        p.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    m(xg).sum().backward()
    assert xg.grad is not None and all(p.grad is None for p in m.parameters())


def test_autograd_training_loop_follows_pytorch_and_accumulates():
    torch.manual_seed(5)
    target = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    m = make(8, [64, 64], 4)
    plain, _ = reference(m, torch.zeros(1, 8, device="cuda"), torch.float16)  # same weights, PyTorch ops
    x = torch.randn(4096, 8, device="cuda")
    with torch.no_grad():
        t = target(x).half()
    losses = {}
    for name, mod, fwd in (("kfuse", m, m), ("torch", plain, plain.forward_torch)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.05)
        curve = []
        for _ in range(30):
            opt.zero_grad()
            loss = (fwd(x.half()).float() - t.float()).square().mean()
            loss.backward()
            opt.step()  # parameters change in place: kfuse's next forward repacks them
            curve.append(loss.item())
        losses[name] = curve
    k, p = losses["kfuse"], losses["torch"]
    assert k[-1] < 0.9 * k[0], k
    for a, b in zip(k, p):
        assert abs(a - b) <= 0.05 * b + 1e-4, (k, p)
    # Two backward passes accumulate into .grad like any module.
    m.zero_grad()
    m(x[:10].half()).sum().backward()
    g1 = m.layers[0].weight.grad.clone()
    m(x[:10].half()).sum().backward()
    torch.testing.assert_close(m.layers[0].weight.grad, 2 * g1, rtol=1e-2, atol=1e-3)


def test_inference_mode_and_float32_module():
    torch.manual_seed(2)
    seq = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).cuda()
    m = FusedMLP.from_torch(seq)  # float32: computes in float16, returns float32
    x = torch.randn(5, 7, 32, device="cuda")
    with torch.inference_mode():
        y = m(x)
    assert y.dtype == torch.float32 and y.shape == (5, 7, 16)
    assert rel(y, seq.double()(x.double())) < 5e-3
    m.zero_grad()
    m(x).sum().backward()
    assert m.layers[0].weight.grad.dtype == torch.float32


def test_device_and_shape_errors():
    m = make(32, [64], 16)
    with pytest.raises(ValueError, match="parameters are on"):
        m(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\)"):
        m(torch.randn(4, 31, device="cuda"))
    e = m.engine(torch.device("cuda", 0), torch.float16)
    packed = m._packed_weights(e, m._params(), torch.float16)
    x = torch.randn(4, 32, device="cuda", dtype=torch.float16)
    s = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="output has shape"):
        e.forward(packed, x, torch.empty(4, 15, device="cuda", dtype=torch.float16), s)
    with pytest.raises(ValueError, match="expected float16"):
        e.forward(packed, x.float(), torch.empty(4, 16, device="cuda", dtype=torch.float16), s)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        e.forward(packed, x.cpu(), torch.empty(4, 16, device="cuda", dtype=torch.float16), s)
    with pytest.raises(ValueError, match="packed weight buffer holds"):
        e.forward(packed[:16], x, torch.empty(4, 16, device="cuda", dtype=torch.float16), s)


def test_kernel_cache_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("KFUSE_CACHE_DIR", str(tmp_path))
    # A spec no other test uses, so that neither the process's module registry nor an old cache has it.
    m = make(29, [48, 112], 3, act="softplus", seed=9)
    e = m.engine(torch.device("cuda", 0), torch.float16)
    info = e.build_info
    assert not info["from_disk_cache"] and not info["from_memory"] and info["compile_seconds"] > 0
    assert os.path.dirname(info["cache_file"]) == str(tmp_path / "kernels") and os.path.exists(info["cache_file"])
    x = torch.randn(50, 29, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y1 = m(x)
    m2 = make(29, [48, 112], 3, act="softplus", seed=9)
    assert m2.engine(torch.device("cuda", 0), torch.float16).build_info["from_memory"]
    del e, m2
    m._engines.clear()
    m._packed = None
    gc.collect()
    e3 = m.engine(torch.device("cuda", 0), torch.float16)
    info3 = e3.build_info
    assert info3["from_disk_cache"] and info3["compile_seconds"] == 0
    assert info3["cache_file"] == info["cache_file"]
    with torch.no_grad():
        torch.testing.assert_close(m(x), y1, rtol=0, atol=0)
    # A corrupt file is ignored (warning on stderr) and rebuilt.
    with open(info["cache_file"], "r+b") as f:
        f.seek(-20, os.SEEK_END)
        f.write(b"\0" * 8)
    del e3
    m._engines.clear()
    m._packed = None
    gc.collect()
    info4 = m.engine(torch.device("cuda", 0), torch.float16).build_info
    assert not info4["from_disk_cache"] and info4["compile_seconds"] > 0
    with torch.no_grad():
        torch.testing.assert_close(m(x), y1, rtol=0, atol=0)


def test_compile_and_cache_load_times_are_reported():
    m = make(32, [64] * 4, 16, seed=11)
    info = m.engine(torch.device("cuda", 0), torch.float16).build_info
    assert info["arch"].startswith(("sm_", "compute_"))
    assert math.isfinite(info["compile_seconds"]) and math.isfinite(info["load_seconds"])


@pytest.mark.parametrize("act", ["silu", "relu"])
def test_tune_chooses_checked_variants_and_caches_them(tmp_path, monkeypatch, act):
    """FusedMLP.tune times every candidate variant of the forward and of the training step (training forward +
    backward), keeps the choice in the tuning cache (a second call times nothing), and the chosen pair (possibly two
    different variants) computes what the float64 reference computes. With ReLU the training candidates include
    recomputed activations (the tuner poisons the stash before each candidate's checked run)."""
    monkeypatch.setenv("KFUSE_CACHE_DIR", str(tmp_path))
    m = make(8, [32, 48], 5, act=act, seed=7)
    rows = m.tune(4099)
    assert [r["op"] for r in rows] == ["mlp_forward", "mlp_train"]
    for r in rows:
        assert not r["from_cache"] and len(r["candidates"]) >= 2, r
        assert not any(c["rejected"] for c in r["candidates"]), r  # every variant computes the same MLP
        assert r["choice"] in [c["name"] for c in r["candidates"]], r
    fwd, bwd = m.variants()
    # (m_tiles, warps, weights_resident, k_chunk, fused_wgrad, wgmma, recompute, wgmma_backward)
    assert len(fwd) == 8 and len(bwd) == 8
    # The forward ignores fused_wgrad, recompute and wgmma_backward: its candidates are listed without them.
    assert fwd[4] is False and fwd[6] == 0 and fwd[7] is False
    assert not any("_rc" in c["name"] for c in rows[0]["candidates"]), rows[0]["candidates"]
    assert any("_rc" in c["name"] for c in rows[1]["candidates"]) == (act == "relu"), rows[1]["candidates"]
    wgmma_candidates = [c["name"] for c in rows[0]["candidates"] if c["name"].endswith("_wg")]
    assert bool(wgmma_candidates) == is_hopper(), wgmma_candidates
    again = make(8, [32, 48], 5, act=act, seed=7)
    rows2 = again.tune(4099)
    assert all(r["from_cache"] for r in rows2)
    assert again.variants() == (fwd, bwd)
    x = torch.randn(4099, 8, device="cuda", dtype=torch.float16)
    check_forward_backward(m, x, torch.float16)
    with pytest.raises(ValueError, match="mode"):
        m.tune(4099, mode="sometimes")


def test_backward_on_a_fresh_thread():
    """The first backward loads the backward module through the driver API, which needs a current context. PyTorch
    calls backward from its autograd worker thread, and a thread that has made no CUDA runtime call has none (this
    failed with 'invalid device context' when an MLP was the first CUDA work of a process). Here the engine's
    backward is the first CUDA call of a fresh thread."""
    import threading
    from kfuse.mlp import _cuda_stream
    m = make(24, [48], 8, act="tanh", seed=11)  # a spec no other test uses: its backward module is not loaded yet
    dev, dt = torch.device("cuda"), torch.float16
    engine = m.engine(dev, dt)
    params = m._params()
    packed = m._packed_weights(engine, params, dt)
    batch = 300
    x = torch.randn(batch, 24, device=dev, dtype=dt)
    y = torch.empty(batch, 8, device=dev, dtype=dt)
    stash = torch.empty(max(engine.stash_bytes(batch), 16), dtype=torch.uint8, device=dev)
    stream = _cuda_stream(dev)
    engine.forward_train(packed, x, y, stash, stream)
    dy = torch.randn_like(y)
    ws = torch.empty(engine.backward_workspace_bytes(batch), dtype=torch.uint8, device=dev)
    grads = torch.full((engine.num_parameters,), float("nan"), device=dev)
    torch.cuda.synchronize()
    errors = []

    def run():
        try:
            engine.backward(packed, x, y, dy, stash, ws, grads, None, stream)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert torch.isfinite(grads).all()
