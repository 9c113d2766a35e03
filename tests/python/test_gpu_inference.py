"""GPU tier: the fused CUDA inference path against the float64 reference (skipped without a CUDA GPU)."""

import copy
import json

import pytest
import torch
from conftest import plan_count, rel_err

import kfuse
from kfuse import _C

pytestmark = pytest.mark.skipif(not kfuse.cuda_available(), reason="needs a CUDA GPU and a CUDA build of kfuse")

TOL = 1e-2  # fp16 / bf16 storage, fp32 accumulation


def reference64(ref: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 reference output (plain PyTorch in float64 on the GPU, on a copy: `ref` stays as it is)."""
    r = copy.deepcopy(ref).double().cuda()
    with torch.no_grad():
        return r(x.double().cuda())


def normalized_uint8(img: torch.Tensor, norm=None) -> torch.Tensor:
    """Renderer frames (N, H, W, 3 or 4) uint8 as the encoder reads them, in float64 NCHW: x / 255, then with norm =
    (mean, var) (x / 255 - mean) * rsqrt(max(var, 1e-2)) per channel (ResNetEncoder.set_input_normalization)."""
    v = img[..., :3].permute(0, 3, 1, 2).double() / 255
    if norm is None:
        return v
    mean, var = norm
    return (v - mean.double().view(1, 3, 1, 1)) * torch.rsqrt(var.double().clamp_min(1e-2)).view(1, 3, 1, 1)


@pytest.mark.parametrize("precision", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 128, 300])
@pytest.mark.parametrize("c", [1, 3, 11])
def test_matches_float64_reference(make_reference, c, n, precision):
    seed = 1000 + 10 * c + n
    ref = make_reference(in_channels=c, seed=seed)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", precision)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, c, 64, 64, generator=gen)
    y_ref = reference64(ref, x)
    with torch.no_grad():
        y = enc(x.cuda().to(precision))
    assert y.dtype == precision and y.shape == (n, 512, 2, 2)
    assert not torch.isnan(y).any()
    assert rel_err(y, y_ref) <= TOL


@pytest.mark.parametrize("layout", ["nchw-f32", "channels_last-f16", "nhwc-uint8-rgba", "nchw-bf16-32x96"])
def test_input_layouts_and_dtypes(make_reference, layout):
    ref = make_reference(in_channels=3, seed=7)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(8)
    h, w = (32, 96) if "32x96" in layout else (64, 64)
    if layout.startswith("nhwc-uint8"):
        img = torch.randint(0, 256, (5, h, w, 4), generator=gen, dtype=torch.uint8)
        mean, var = torch.tensor([0.4, 0.5, 0.6]), torch.tensor([0.05, 0.005, 0.2])  # one var under the 1e-2 clamp
        enc.set_input_normalization(mean, var)
        x_ref = normalized_uint8(img, (mean, var))
        x = img.cuda()
    else:
        x_ref = torch.rand(5, 3, h, w, generator=gen, dtype=torch.float64)
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[layout.split("-")[1]]
        x = x_ref.to(dtype).cuda()
        if layout.startswith("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
            assert not x.is_contiguous()
    with torch.no_grad():
        y = enc(x)
    assert rel_err(y, reference64(ref, x_ref)) <= TOL
    if layout.startswith("nhwc-uint8"):  # the CPU path reads uint8 the same way
        cpu = kfuse.ResNetEncoder.from_torch(ref)
        cpu.set_input_normalization(mean, var)
        with torch.no_grad():
            assert rel_err(y, cpu(img)) <= TOL


def test_new_normalization_values_keep_the_captured_graphs_and_reach_them(make_reference):
    """A training loop updates its observation statistics every iteration: new values of the uint8 input's
    normalization must reach the captured graphs (inference and training) without recapturing them (a recapture
    per iteration left every training step eager). Switching between uint8 and float input recaptures (the graphs
    bake whether there is a map: a float input has none). Outputs against float64 with the values in force (TOL)."""
    ref = make_reference(in_channels=3, seed=13)
    enc = kfuse.ResNetEncoder.from_torch(ref).cuda().half()
    gen = torch.Generator().manual_seed(13)
    img = torch.randint(0, 256, (6, 64, 64, 4), generator=gen, dtype=torch.uint8)
    x = img.cuda()

    def want(norm):
        return reference64(ref, normalized_uint8(img, norm))

    def run(norm, label):
        enc.set_input_normalization(*(norm if norm is not None else (None, None)))
        enc.eval()
        with torch.no_grad():
            y = enc(x)
        enc.train()
        y_train = enc(x)
        y_train.backward(torch.ones_like(y_train))
        torch.cuda.synchronize()
        assert rel_err(y, want(norm)) <= TOL, f"{label}: inference"
        assert rel_err(y_train.detach(), want(norm)) <= TOL, f"{label}: training forward"

    first = (torch.tensor([0.4, 0.5, 0.6]), torch.tensor([0.05, 0.02, 0.2]))
    for _ in range(3):  # eager, captured, replayed: inference, training forward and backward
        run(first, "first values")
    (engine, *_), = enc.__dict__["_gpu_engines"].values()
    held = engine.graph_count
    assert held >= 3, "the inference forward and the training step were not captured"
    for i, norm in enumerate([(torch.tensor([0.1, 0.9, 0.3]), torch.tensor([0.3, 0.01, 0.08])),
                              (torch.tensor([0.6, 0.2, 0.5]), torch.tensor([0.002, 0.5, 0.1]))]):
        run(norm, f"new values {i}")
        assert engine.graph_count == held, f"new values {i}: the graphs were recaptured"
    run(None, "normalization off")  # plain x / 255: still a map, so the graphs stay
    assert engine.graph_count == held, "normalization off: the graphs were recaptured"
    # A float input has no map (the graphs bake that): switching to it and back recaptures, each reading its own.
    xf = normalized_uint8(img)
    enc.eval()
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(enc(xf.cuda().half()), reference64(ref, xf)) <= TOL, "float input after uint8"
    run(first, "uint8 again")


def test_float32_module_runs_in_fp16_with_float32_output(make_reference):
    ref = make_reference(in_channels=3, seed=9)
    enc = kfuse.ResNetEncoder.from_torch(ref).cuda()
    x = torch.rand(4, 3, 64, 64)
    with torch.no_grad():
        y = enc(x.cuda())
    assert y.dtype == torch.float32
    assert rel_err(y, reference64(ref, x)) <= TOL


def test_every_output_written_and_repeat_runs_bit_identical(make_reference):
    """Low-level engine: the output is poisoned with NaN first; graph replays, fresh pointers and the graph-free path
    all give the same bits."""
    ref = make_reference(in_channels=3, seed=11)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    engine = _C.EncoderGpu(enc.config, "float16", 0)
    engine.set_weights([p.detach().float().contiguous() for p in enc.parameters()])
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.rand(33, 3, 64, 64, device="cuda", dtype=torch.float16)
    outs = []
    for i in range(4):
        y = torch.full((33, 512, 2, 2), float("nan"), device="cuda", dtype=torch.float16)
        xi = x.clone() if i == 2 else x  # a new input address: the graph's stem is patched
        engine.forward(xi, y, stream)
        outs.append(y)
    engine.set_use_graphs(False)
    y = torch.full((33, 512, 2, 2), float("nan"), device="cuda", dtype=torch.float16)
    engine.forward(x, y, stream)
    outs.append(y)
    torch.cuda.synchronize()
    assert engine.graph_count == 1
    assert not torch.isnan(outs[0]).any()
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert rel_err(outs[0], reference64(ref, x.float())) <= TOL


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [7, 128])
def test_programmatic_launch_gives_the_same_bits(make_reference, monkeypatch, n, precision):
    """Programmatic dependent launch (sm_90+) lets each kernel start before its predecessor ends and wait on the
    device: the forward must give exactly the bits of the forward without it (KFUSE_PDL=0), eager, captured and
    replayed, with the caller's pointers moved between replays."""
    ref = make_reference(in_channels=3, seed=21 + n)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    x = torch.rand(n, 3, 64, 64, device="cuda", dtype=dtype)

    def run(engine):
        outs = []
        for i in range(4):  # eager, capture, replay, replay with new input and output addresses
            xi = x.clone() if i == 3 else x
            y = torch.full((n, 512, 2, 2), float("nan"), device="cuda", dtype=dtype)
            engine.forward(xi, y, stream)
            outs.append(y)
        torch.cuda.synchronize()
        return outs

    monkeypatch.setenv("KFUSE_TUNE", "off")  # every engine runs the heuristic's kernels: same tiles, same sums
    engines = {}
    for policy in ("0", "1", "2", "3"):  # off, then the three sets of early-launched boundaries
        monkeypatch.setenv("KFUSE_PDL", policy)  # read when the engine is created
        engine = _C.EncoderGpu(enc.config, precision, 0)
        engine.set_weights(params)
        engines[policy] = engine
    major, _ = torch.cuda.get_device_capability()
    plain = run(engines["0"])
    assert not engines["0"].uses_programmatic_launch
    assert not torch.isnan(plain[0]).any()
    for policy in ("1", "2", "3"):
        for y in run(engines[policy]):
            assert torch.equal(y, plain[0]), f"KFUSE_PDL={policy}"
        assert engines[policy].uses_programmatic_launch == (major >= 9)  # and no capture fell back
    for y in plain[1:]:
        assert torch.equal(y, plain[0])
    assert rel_err(plain[0], reference64(ref, x.float())) <= TOL


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,h,w", [(7, 64, 64), (5, 32, 96), (3, 32, 32), (2, 128, 128)])
def test_fused_block_matches_separate_kernels(make_reference, monkeypatch, precision, n, h, w):
    """Block 1 as one kernel (conv1, conv2 and the squeeze-excite with the image on chip, where the device's shared
    memory allows it) against the same forward with the block as three kernels (KFUSE_FUSED_BLOCK=0) and against
    float64: both within tolerance, outputs poisoned first. 8x8, 8x24 and 16x16 images fuse; 32x32 (128x128 inputs)
    is too large for the kernel and must take the three kernels."""
    ref = make_reference(in_channels=3, seed=300 + n + h + w)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    gen = torch.Generator().manual_seed(n + h)
    x = torch.rand(n, 3, h, w, generator=gen)
    xd = x.cuda().to(dtype)
    bh, bw = h // 4, w // 4
    fits = bh * bw <= 256 and (bh * bw) % 16 == 0 and (bh + 2) * (bw + 2) <= 640
    smem = 2 * 64 * 576 * 2 + (bh + 2) * (bw + 2) * 128 + 4 * (8 * 64 + 2 * (64 + 4) + 2 * 256)
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin

    def chosen(engine, on):
        expected = 1 if on == "1" and fits and smem <= optin else 0
        assert plan_count(engine, "fused_block", n, h, w) == expected, f"KFUSE_FUSED_BLOCK={on}"

    outs = _forward_per_switch(monkeypatch, "KFUSE_FUSED_BLOCK", ("0", "1"), enc, precision, params, xd,
                               (n, 512, h // 32, w // 32), dtype, stream, chosen, calls=1)
    _assert_near_reference(outs, reference64(ref, x), "KFUSE_FUSED_BLOCK")
    assert rel_err(outs["1"], outs["0"].double()) <= TOL


def _hopper() -> bool:
    return torch.cuda.get_device_capability(0) == (9, 0)


def _repeat_forward(engine, x, out_shape, out_dtype, stream, label, calls=3, new_input_last=False):
    """engine.forward `calls` times (eager, then captured, then replayed), each into a new output poisoned with NaN
    (a new address: the graph's tail is patched), the last one from a copy of x when new_input_last (the stem patched
    too); asserts that all give the same bits and returns the first output."""
    ys = []
    for i in range(calls):
        y = torch.full(out_shape, float("nan"), device="cuda", dtype=out_dtype)
        engine.forward(x.clone() if new_input_last and i == calls - 1 else x, y, stream)
        torch.cuda.synchronize()
        ys.append(y)
    assert all(torch.equal(ys[0], y) for y in ys[1:]), f"{label}: repeated forwards differ"
    return ys[0]


def _forward_per_switch(monkeypatch, var, values, enc, precision, params, x, out_shape, out_dtype, stream,
                        setup=None, **repeat):
    """{value: output} for each value of the A/B switch `var` (read when the engine is created): a new engine per
    value with `params`, setup(engine, value) (what the engine chose, asserted; extra configuration), then
    _repeat_forward(**repeat)."""
    outs = {}
    for v in values:
        monkeypatch.setenv(var, v)
        engine = _C.EncoderGpu(enc.config, precision, 0)
        engine.set_weights(params)
        if setup:
            setup(engine, v)
        outs[v] = _repeat_forward(engine, x, out_shape, out_dtype, stream, f"{var}={v}", **repeat)
    return outs


def _assert_near_reference(outs, y64, var):
    """Every output of _forward_per_switch written (no NaN left of the poison) and within TOL of the float64 one."""
    for v, y in outs.items():
        assert not torch.isnan(y).any(), f"{var}={v}"
        assert rel_err(y, y64) <= TOL, f"{var}={v}"


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_wgmma_block_matches_float64_reference(make_reference, monkeypatch, precision, n):
    """Block 1 on Hopper warpgroup MMAs (KFUSE_WGMMA_BLOCK=1: a persistent kernel, so n = 300 gives some CTAs three
    images and others two) against the mma.sync fused block (KFUSE_WGMMA_BLOCK=0) and the float64 reference, outputs
    poisoned with NaN first; twice, bit for bit. Elsewhere than on compute capability 9.0 the kernel must not be
    chosen."""
    ref = make_reference(in_channels=3, seed=400 + n)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    x = torch.rand(n, 3, 64, 64, generator=torch.Generator().manual_seed(n))
    xd = x.cuda().to(dtype)

    def chosen(engine, on):
        assert plan_count(engine, "fused_block_wgmma", n, 64, 64) == (1 if on == "1" and _hopper() else 0), f"KFUSE_WGMMA_BLOCK={on}"

    outs = _forward_per_switch(monkeypatch, "KFUSE_WGMMA_BLOCK", ("0", "1"), enc, precision, params, xd,
                               (n, 512, 2, 2), dtype, stream, chosen, calls=2)
    _assert_near_reference(outs, reference64(ref, x), "KFUSE_WGMMA_BLOCK")
    assert rel_err(outs["1"], outs["0"].double()) <= TOL


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,c", [(1, 3), (7, 1), (128, 3), (300, 11)])
def test_fused_down_block_matches_float64_reference(make_reference, monkeypatch, precision, n, c):
    """Blocks 2 and 3 as one Hopper kernel each (pool + shortcut, conv1, conv2, squeeze-excite; block 2 one CTA per
    image, n = 300 runs three waves; block 3 a group of 4 CTAs per 4 images that exchange data through L2, n = 1 and 7
    leave images of the last group empty, n = 300 has more groups than fit on the GPU at once): KFUSE_FUSED_DOWN=1
    (both), 2 (block 2 only) and 0 (the separate kernels) against each other and the float64 reference, outputs poisoned with NaN first; eager, captured and replayed, bit for bit. Elsewhere than
    on compute capability 9.0, or at an image size whose block inputs are not 16 x 16 and 8 x 8, no kernel is chosen."""
    ref = make_reference(in_channels=c, seed=700 + n + c)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    x = torch.rand(n, c, 64, 64, generator=torch.Generator().manual_seed(800 + n))
    xd = x.cuda().to(dtype)

    def chosen(engine, on):
        fused = {"0": 0, "2": 1, "1": 2}[on] if _hopper() else 0
        assert plan_count(engine, "fused_down_block", n, 64, 64) == fused, f"KFUSE_FUSED_DOWN={on}"
        assert plan_count(engine, "fused_down_block", n, 96, 96) == 0

    outs = _forward_per_switch(monkeypatch, "KFUSE_FUSED_DOWN", ("0", "2", "1"), enc, precision, params, xd,
                               (n, 512, 2, 2), dtype, stream, chosen)
    _assert_near_reference(outs, reference64(ref, x), "KFUSE_FUSED_DOWN")
    assert rel_err(outs["1"], outs["0"].double()) <= TOL
    assert rel_err(outs["1"], outs["2"].double()) <= TOL


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [7, 128, 300])
def test_squeeze_excite_weights_as_t_match_float64_reference(make_reference, monkeypatch, precision, n):
    """Block 4's squeeze-excite reads its fc weights as T at one image per CTA (n = 7, 128; n = 300 runs 4 images per
    CTA from the fp32 weights): KFUSE_SE_WEIGHTS_T=1 against =0 and the float64 reference of an fp32 checkpoint
    (whose fc weights T rounds), NaN-poisoned outputs, eager / captured / replayed bit for bit."""
    ref = make_reference(in_channels=3, seed=2100 + n)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    x = torch.rand(n, 3, 64, 64, generator=torch.Generator().manual_seed(2200 + n))
    xd = x.cuda().to(dtype)
    outs = _forward_per_switch(monkeypatch, "KFUSE_SE_WEIGHTS_T", ("0", "1"), enc, precision, params, xd,
                               (n, 512, 2, 2), dtype, stream)
    _assert_near_reference(outs, reference64(ref, x), "KFUSE_SE_WEIGHTS_T")
    if n == 300:  # four images per CTA: the fp32 weights either way
        assert torch.equal(outs["1"], outs["0"])
    else:
        assert rel_err(outs["1"], outs["0"].double()) <= TOL


def test_fused_down_block_follows_new_weights(make_reference, monkeypatch):
    """The fused blocks 2 and 3 stream their filters from their own packed copy (block 3's in four output-channel
    slices), block 4's squeeze-excite kernel its fc weights as T: new weights through either path (set_weights from
    the host, set_weights_device from device tensors) must reach them, in the same engine and its captured graph."""
    monkeypatch.setenv("KFUSE_FUSED_DOWN", "1")
    refs = [make_reference(in_channels=3, seed=900 + k) for k in range(3)]
    encs = [kfuse.ResNetEncoder.from_torch(r) for r in refs]
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.rand(5, 3, 64, 64, generator=torch.Generator().manual_seed(901))
    xd = x.cuda().half()
    engine = _C.EncoderGpu(encs[0].config, "float16", 0)
    engine.set_weights([p.detach().float().contiguous() for p in encs[0].parameters()])
    for k in range(3):
        if k == 1:
            engine.set_weights([p.detach().float().contiguous() for p in encs[1].parameters()])
        if k == 2:
            dev = [p.detach().half().cuda().contiguous() for p in encs[2].parameters()]
            engine.set_weights_device([t.data_ptr() for t in dev], "float16", stream)
        for _ in range(2):  # eager or captured, then replayed
            y = torch.full((5, 512, 2, 2), float("nan"), device="cuda", dtype=torch.float16)
            engine.forward(xd, y, stream)
            torch.cuda.synchronize()
            assert rel_err(y, reference64(refs[k], x)) <= TOL, f"weights {k}"


def _fused_stem_inputs(kind: str, n: int, c: int, gen: torch.Generator):
    """(device input, float64 NCHW reference input, normalization or None) for one input kind of the stem."""
    if kind == "nhwc-uint8-rgba":
        img = torch.randint(0, 256, (n, 64, 64, 4), generator=gen, dtype=torch.uint8)
        mean, var = torch.tensor([0.4, 0.5, 0.6]), torch.tensor([0.05, 0.005, 0.2])
        x_ref = normalized_uint8(img, (mean, var))
        return img.cuda().permute(0, 3, 1, 2)[:, :3], x_ref, (mean, var)  # the engine takes the NCHW view
    x_ref = torch.rand(n, c, 64, 64, generator=gen, dtype=torch.float64)
    if kind == "nchw-f32":
        return x_ref.float().cuda(), x_ref, None
    if kind == "channels_last-bf16":
        return x_ref.to(torch.bfloat16).cuda().contiguous(memory_format=torch.channels_last), x_ref, None
    if kind == "nchw-f16-misaligned":  # a view one element into its storage: no vector loads
        flat = torch.empty(x_ref.numel() + 1, dtype=torch.float16, device="cuda")
        x = flat[1:].view(n, c, 64, 64)
        x.copy_(x_ref)
        return x, x_ref, None
    return x_ref.half().cuda(), x_ref, None


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,c,kind", [(1, 3, "nchw-f16"), (7, 1, "nchw-f16"), (128, 3, "nchw-f16"),
                                      (5, 11, "nchw-f32"), (6, 3, "channels_last-bf16"),
                                      (4, 3, "nhwc-uint8-rgba"), (3, 3, "nchw-f16-misaligned")])
def test_fused_stem_matches_stem_kernel(make_reference, monkeypatch, precision, n, c, kind):
    """The stem computed inside block 1's Hopper kernel (KFUSE_FUSED_STEM=1, each CTA its own image) gives exactly the
    bits of the separate stem kernel (KFUSE_FUSED_STEM=0: the same warp GEMM, the same roundings), eager and replayed
    with a patched input pointer, outputs poisoned with NaN first; and both match the float64 reference. It applies
    only on compute capability 9.0 and up to one image per SM."""
    ref = make_reference(in_channels=c, seed=500 + 10 * n + c)
    enc = kfuse.ResNetEncoder.from_torch(ref)
    gen = torch.Generator().manual_seed(600 + n)
    x, x_ref, norm = _fused_stem_inputs(kind, n, c, gen)
    if norm is not None:
        enc.set_input_normalization(*norm)
    params = [p.detach().float().contiguous() for p in enc.parameters()]
    stream = torch.cuda.current_stream().cuda_stream
    dtype = getattr(torch, precision)
    monkeypatch.setenv("KFUSE_TUNE", "off")  # both engines run the heuristic's kernels: same tiles, same sums
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def setup(engine, on):
        if norm is not None:
            engine.set_input_affine(*enc._uint8_affine())
        assert plan_count(engine, "+stem", n, 64, 64) == (on == "1" and _hopper()), f"KFUSE_FUSED_STEM={on}"
        assert not plan_count(engine, "+stem", sms + 1, 64, 64)

    outs = _forward_per_switch(monkeypatch, "KFUSE_FUSED_STEM", ("0", "1"), enc, precision, params, x,
                               (n, 512, 2, 2), dtype, stream, setup, new_input_last=True)
    assert not torch.isnan(outs["1"]).any()
    assert torch.equal(outs["1"], outs["0"])
    assert rel_err(outs["1"], reference64(ref, x_ref)) <= TOL


def test_weights_update_is_picked_up(make_reference):
    ref = make_reference(in_channels=1, seed=12)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    x = torch.rand(2, 1, 64, 64)
    with torch.no_grad():
        enc(x.cuda().half())
        enc.layers[3][0].fixup_scale.mul_(1.5)
        ref.layers[3][0].fixup_scale.mul_(1.5)
        y = enc(x.cuda().half())
    assert rel_err(y, reference64(ref, x)) <= TOL


def test_module_follows_every_kind_of_parameter_change(make_reference):
    """The module's hot path launches a call like the previous one before it checks the parameters (which saves
    host time before the launch): an in-place update, a parameter replaced by assignment, new storage through .data,
    a dtype conversion and a deep copy must each give the new model's output, on the eager call of a new kind and on
    the replayed one."""
    ref = make_reference(in_channels=3, seed=31)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    x = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(32))
    xd = x.cuda().half()
    changes = [
        lambda m: None,
        lambda m: m.layers[1][0].conv2.weight.mul_(0.5),
        lambda m: setattr(m.layers[2][0], "fixup_scale", torch.nn.Parameter(m.layers[2][0].fixup_scale * 2.0)),
        lambda m: setattr(m.stem[1].weight, "data", m.stem[1].weight.data * 1.25),
    ]
    with torch.no_grad():
        for k, change in enumerate(changes):
            change(enc)
            change(ref)
            for _ in range(3):
                assert rel_err(enc(xd), reference64(ref, x)) <= TOL, f"change {k}"
        copy_ = copy.deepcopy(enc)
        copy_.layers[3][0].fixup_bias2b.add_(0.5)
        ref.layers[3][0].fixup_bias2b.add_(0.5)
        for _ in range(3):
            assert rel_err(copy_(xd), reference64(ref, x)) <= TOL, "deep copy"
        enc.layers[3][0].fixup_bias2b.add_(0.5)
        enc = enc.bfloat16()
        for _ in range(3):
            y = enc(xd)
            assert y.dtype == torch.bfloat16
            assert rel_err(y, reference64(ref, x)) <= TOL, "bfloat16"


def test_engine_rejects_bad_arguments(make_reference):
    enc = kfuse.ResNetEncoder.from_torch(make_reference(in_channels=3, seed=13))
    engine = _C.EncoderGpu(enc.config, "float16", 0)
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.rand(2, 3, 64, 64, device="cuda", dtype=torch.float16)
    y = torch.empty(2, 512, 2, 2, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="before set_weights"):
        engine.forward(x, y, stream)
    engine.set_weights([p.detach().float().contiguous() for p in enc.parameters()])
    with pytest.raises(ValueError, match="output has shape"):
        engine.forward(x, torch.empty(2, 512, 2, 1, device="cuda", dtype=torch.float16), stream)
    with pytest.raises(ValueError, match="contiguous NCHW"):
        engine.forward(x, torch.empty(2, 2, 2, 512, device="cuda", dtype=torch.float16).permute(0, 3, 1, 2), stream)
    with pytest.raises(ValueError, match="CUDA tensor"):
        engine.forward(x.cpu(), y, stream)
    with pytest.raises(ValueError, match="int32"):
        engine.forward(x.to(torch.int32), y, stream)
    with pytest.raises(ValueError, match="multiples of 32"):
        engine.forward(x[:, :, :48], y, stream)
    with pytest.raises(ValueError, match="precision"):
        _C.EncoderGpu(enc.config, "float64", 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        _C.EncoderGpu((3, 24, (1, 1, 1, 1)), "float16", 0)


def test_misaligned_input_replays_correctly(make_reference):
    """A view at an odd element offset reuses the graph captured for an aligned tensor of the same shape and
    strides: the kernels must not have baked the first pointer's alignment in."""
    ref = make_reference(in_channels=3, seed=21)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(22)
    x = torch.rand(6, 3, 64, 64, generator=gen, dtype=torch.float64)
    y_ref = reference64(ref, x)
    flat = torch.empty(x.numel() + 1, dtype=torch.float16, device="cuda")
    shifted = flat[1:].view(6, 3, 64, 64)
    shifted.copy_(x)
    with torch.no_grad():
        y_aligned = enc(x.half().cuda())
        y_shifted = enc(shifted)
    assert rel_err(y_aligned, y_ref) <= TOL
    assert rel_err(y_shifted, y_ref) <= TOL


@pytest.mark.parametrize("projection", ["0", "1"])
def test_prepared_dense_filter_follows_new_weights(make_reference, tmp_path, monkeypatch, projection):
    """Block 4's conv2 as the dense GEMM from a filter unrolled ahead of time (a tuning cache whose entry for that
    shape names dense_unrolled, so the choice does not depend on timings): it matches the float64 reference, eager and
    replayed, and still does after new weights go into the same engine (set_weights remakes the prepared filter in
    place; a stale one would give the old weights' answer). With KFUSE_SE_PROJECTION=1 that filter also carries the
    squeeze projection (fc1's pre-activations as extra GEMM rows, remade from the new fc1 weights as well), and the
    engine must say it uses it; with 0 it must not."""
    monkeypatch.setenv("KFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KFUSE_SE_PROJECTION", projection)
    shape = "n8_h2_w2_c512_k512_r3_s3_p1_u1"
    ref = make_reference(in_channels=3, seed=41)
    rows = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16).tune(batch=8, mode="retune", verbose=False)
    row = next(r for r in rows if r["shape"] == shape)
    assert "dense_unrolled" in [c["name"] for c in row["candidates"]]
    cache = json.loads((tmp_path / "tuning.json").read_text())
    keys = [k for k in cache["entries"] if shape in k]
    assert keys
    for k in keys:
        cache["entries"][k]["candidate"] = "dense_unrolled"
    (tmp_path / "tuning.json").write_text(json.dumps(cache))
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    rows = enc.tune(batch=8, mode="on", verbose=False)
    assert next(r for r in rows if r["shape"] == shape)["choice"] == "dense_unrolled"
    x = torch.rand(8, 3, 64, 64, generator=torch.Generator().manual_seed(43), dtype=torch.float64)
    for seed in (41, 42):
        if seed == 42:
            ref = make_reference(in_channels=3, seed=seed)
            enc.load_state_dict(ref.state_dict())
        y_ref = reference64(ref, x)
        for call in range(3):  # eager, captured, replayed
            with torch.no_grad():
                y = enc(x.half().cuda())
            assert not torch.isnan(y).any()
            assert rel_err(y, y_ref) <= TOL, f"weights {seed}, call {call}"
        engine = next(iter(enc._gpu_engines.values()))[0]
        assert plan_count(engine, "conv2_squeeze_projection", 8, 64, 64) == int(projection)


def test_tune_reports_every_convolution_and_is_cached(make_reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KFUSE_CACHE_DIR", str(tmp_path))
    ref = make_reference(in_channels=3, seed=31)
    enc = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    rows = enc.tune(batch=8, mode="retune", verbose=False)
    assert len(rows) == 11  # blocks 2-4 have a shortcut: 2 + 3 * 3 convolutions
    for r in rows:
        names = [c["name"] for c in r["candidates"]]
        assert r["choice"] in names and r["default"] == names[0]
        # every candidate kernel agreed with the default one on random data (none rejected)
        assert not any(c["rejected"] for c in r["candidates"]), r
        assert r["tuned_ms"] is not None and r["default_ms"] is not None
    assert (tmp_path / "tuning.json").exists()
    gen = torch.Generator().manual_seed(32)
    x = torch.rand(8, 3, 64, 64, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y = enc(x.half().cuda())
    assert rel_err(y, reference64(ref, x)) <= TOL
    # A fresh engine (as in a new process) takes every choice from the cache without timing anything.
    again = kfuse.ResNetEncoder.from_torch(ref).to("cuda", torch.float16)
    rows2 = again.tune(batch=8, mode="on", verbose=False)
    assert all(r["from_cache"] and not r["candidates"] for r in rows2)
    assert [r["choice"] for r in rows2] == [r["choice"] for r in rows]
