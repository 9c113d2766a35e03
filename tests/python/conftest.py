import pytest
import torch

from kfuse import reference


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights with every residual branch non-trivial: conv2 non-zero, FixUp scalars away from 0 and 1.
    (At bps-nav's init every branch is exactly zero, and a test that uses it proves almost nothing.)

    Each FixUp bias is drawn within +-0.5 standard deviations of the activation it is added to (measured on a
    random input), so that it shifts the ReLUs without killing them: activations shrink with depth, and a fixed
    range would switch off whole layers of the deeper blocks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv2.weight"):
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (2.0 / fan_in) ** 0.5 / 2)
            elif name.endswith("fixup_scale"):
                p.copy_(torch.rand(1, generator=gen, dtype=torch.float64) + 0.5)
            elif name.endswith("se.excite.0.bias"):
                # The SE bottleneck has planes/16 units fed by small means: positive biases keep them alive.
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) * 0.1 + 0.02)
            elif "fixup_bias" not in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.detach().std().clamp_min(1e-2) * 0.1)

        def bias(t: torch.Tensor) -> float:
            return float((torch.rand(1, generator=gen, dtype=torch.float64) - 0.5) * t.std())

        x = model.stem(torch.rand(2, model.in_channels, 64, 64, generator=gen).to(model.stem[1].weight.dtype))
        for stage in model.layers:
            for b in stage:
                b.fixup_bias1a.fill_(bias(x))
                c1 = b.conv1(x + b.fixup_bias1a)
                b.fixup_bias1b.fill_(bias(c1))
                h = torch.relu(c1 + b.fixup_bias1b)
                b.fixup_bias2a.fill_(bias(h))
                o = b.conv2(h + b.fixup_bias2a) * b.fixup_scale
                b.fixup_bias2b.fill_(bias(o))
                x = b(x)
    return model


def plan_count(engine, token: str, n: int, h: int, w: int, training: bool = False) -> int:
    """How many steps of the engine's launch plan (EncoderGpu.launch_plan) name `token`."""
    return sum(token in step for step in engine.launch_plan(n, h, w, training))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative error ||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def captured_by_caller(module, x, warmup: int = 3):
    """module(x) captured in a CUDA graph of the caller's (as torch.compile's reduce-overhead mode does), after eager
    warm-up calls on a side stream, without gradients: (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(warmup):
            module(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = module(x)
    return graph, y


@pytest.fixture
def make_reference():
    def make(in_channels=3, base_planes=64, layers=(1, 1, 1, 1), seed=0, dtype=torch.float32):
        torch.manual_seed(seed)
        return randomize(reference.ResNetEncoder(in_channels, base_planes, layers), seed + 1).to(dtype)

    return make


def _block_with_scalar_terms(b: torch.nn.Module, x: torch.Tensor, leaves: dict, prefix: str) -> torch.Tensor:
    """reference.SEFixupBasicBlock.forward with each FixUp scalar broadcast to a full tensor (a leaf of its own), so
    that the gradient of that leaf holds the terms whose sum is the scalar's gradient."""
    def full(name, like):
        t = getattr(b, name).detach().expand_as(like).clone().requires_grad_(True)
        leaves[prefix + name] = t
        return t

    a = x + full("fixup_bias1a", x)
    c1 = b.conv1(a)
    h = torch.relu(c1 + full("fixup_bias1b", c1))
    c2 = b.conv2(h + full("fixup_bias2a", h))
    o = c2 * full("fixup_scale", c2) + full("fixup_bias2b", c2)
    identity = x if b.downsample is None else b.downsample(a)
    return torch.relu(o * b.se(o) + identity)


def scalar_gradient_conditioning(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """{name: ||t|| / |sum t|} for each FixUp scalar, t the terms of its gradient's sum (run it in float64).

    A sum whose terms each carry an independent relative error d is off by about d * ||t|| / |sum t| relative to the
    sum: the factor measures how much a problem amplifies storage rounding into that scalar's gradient."""
    leaves = {}
    h = model.stem(x)
    for i, stage in enumerate(model.layers):
        for j, b in enumerate(stage):
            h = _block_with_scalar_terms(b, h, leaves, f"layers.{i}.{j}.")
    names = list(leaves)
    terms = torch.autograd.grad(h, [leaves[k] for k in names], dy)
    return {k: (t.norm() / t.sum().abs()).item() for k, t in zip(names, terms)}


def final_pre_activation(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The encoder's output before its last ReLU."""
    h = model.stem(x)
    blocks = [b for stage in model.layers for b in stage]
    for b in blocks[:-1]:
        h = b(h)
    return blocks[-1].pre_activation(h)
