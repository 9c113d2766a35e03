"""CPU tier: the per-block gradient release's autograd plumbing (ResNetEncoder(gradient_release="per_block")), on CPU
tensors with a stand-in for the CUDA engine: one autograd node per backward stage, run last block first, each handing
autograd exactly the gradients its stage finalized (the stage map of EncoderConfig::backward_stage_of_parameters),
in the parameters' dtype; dL/dx from the stem's stage; accumulation over calls; in-place changes detected. The CUDA
engine's stages themselves are checked on the GPU (test_gpu_gradient_release.py)."""

import ctypes

import pytest
import torch

import kfuse
from kfuse import _C
from kfuse import encoder as encoder_module


def _tensor_at(ptr, shape, dtype):
    """A CPU tensor over the memory at `ptr` (the stand-in receives data pointers, as the CUDA engine does)."""
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * n).from_address(ptr), dtype=dtype).view(shape)


class StandInEngine:
    """Writes, at stage s, gradient (i + 1) * sum(dy) for every parameter i of stage s (and dL/dx = 7 at the last),
    into the flat float32 buffer, as EncoderGpu::backward_stage writes the real ones; records the stages it ran."""

    def __init__(self, config, params):
        self.stage_of = _C.backward_stage_of_parameters(config)
        self.sizes = [p.numel() for p in params]
        self.stages = []

    def stash_valid(self, stash):
        return True

    def run_backward(self, spec, stage, stash, x_ptr, dy_ptr, grads_ptr, dx_ptr, stream):
        """EncoderGpu.run_backward's pointers as CPU tensors (spec here: the (shape, dtype) of y and of x), for
        backward_stage."""
        (y_shape, y_dtype), (x_shape, x_dtype) = spec
        dx = _tensor_at(dx_ptr, x_shape, x_dtype) if dx_ptr else None
        self.backward_stage(stage, stash, _tensor_at(x_ptr, x_shape, x_dtype), _tensor_at(dy_ptr, y_shape, y_dtype),
                            _tensor_at(grads_ptr, (sum(self.sizes),), torch.float32), dx, stream)

    def backward_stage(self, stage, stash, x, dy, grads, dx, stream):
        self.stages.append(stage)
        offset = 0
        for i, (s, n) in enumerate(zip(self.stage_of, self.sizes)):
            if s == stage:
                grads[offset:offset + n] = (i + 1) * dy.double().sum().item()
            offset += n
        if stage == max(self.stage_of) and dx is not None:
            dx.fill_(7.0)


def staged_output(enc, x, dtype=torch.float32):
    """The module's per-block chain over a stand-in engine: y (a random output) ends it, as on CUDA."""
    enc = enc.to(dtype)
    params = encoder_module._param_list(enc, enc.config)
    engine = StandInEngine(enc.config, params)
    entry = [engine, list(map(torch.Tensor.data_ptr, params)), None, None, None, None]
    y = torch.randn(x.shape[0], 512, 2, 2).to(dtype)
    spec = ((y.shape, y.dtype), (x.shape, x.dtype))
    return enc._staged_backward_chain(entry, 1, spec, y, x, params), engine, params


@pytest.fixture(autouse=True)
def no_cuda_stream(monkeypatch):
    monkeypatch.setattr(encoder_module, "_cuda_stream", lambda device: 0)


def test_stage_map_of_the_default_network():
    """Stage 0 is the last block's; each fixup_bias1a belongs to the stage after its block's where the block has a
    shortcut conv (its d(input) sum comes from the previous block's backward) and to the stem's for block 1."""
    config = kfuse.ResNetEncoder(3).config
    names = [name for name, _ in _C.param_specs(config)]
    stage = dict(zip(names, _C.backward_stage_of_parameters(config)))
    assert stage["layers.3.0.conv2.weight"] == 0 and stage["layers.3.0.fixup_bias1a"] == 1
    assert stage["layers.0.0.conv1.weight"] == 3 and stage["layers.0.0.fixup_bias1a"] == 4
    assert stage["stem.1.weight"] == 4
    assert sorted(set(stage.values())) == [0, 1, 2, 3, 4]
    # identity blocks after the first finalize their own fixup_bias1a (the sum of their input's gradient)
    config = kfuse.ResNetEncoder(3, layers=(2, 2, 1, 1)).config
    names = [name for name, _ in _C.param_specs(config)]
    stage = dict(zip(names, _C.backward_stage_of_parameters(config)))
    assert stage["layers.1.1.fixup_bias1a"] == stage["layers.1.1.conv1.weight"] == 2
    assert stage["layers.1.0.fixup_bias1a"] == 4 and stage["layers.0.1.fixup_bias1a"] == 4
    assert stage["layers.0.0.fixup_bias1a"] == stage["stem.1.weight"] == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_stage_hands_on_its_parameters_gradients_last_block_first(dtype):
    enc = kfuse.ResNetEncoder(3)
    x = torch.rand(2, 3, 64, 64).to(dtype).requires_grad_()
    order = []
    for name, p in enc.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, name=name: order.append(name))
    y, engine, params = staged_output(enc, x, dtype)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    assert engine.stages == [0, 1, 2, 3, 4]
    total = dy.double().sum().item()
    for i, (name, p) in enumerate(enc.named_parameters()):
        assert p.grad is not None and p.grad.dtype == dtype and p.grad.shape == p.shape, name
        assert torch.equal(p.grad, torch.full_like(p, (i + 1) * total)), name
    stage_of = dict(zip([n for n, _ in enc.named_parameters()], engine.stage_of))
    assert sorted(order) == sorted(stage_of) and [stage_of[n] for n in order] == sorted(stage_of[n] for n in order)
    assert torch.equal(x.grad, torch.full_like(x, 7.0))


def test_the_step_holds_no_cycle_and_a_retained_graph_runs_twice():
    """The output's node must not keep the step's buffers in a reference cycle (freed when the output goes, not at
    the next garbage collection); backward through a retained graph runs every stage again."""
    import gc
    import weakref

    enc = kfuse.ResNetEncoder(3)
    y, engine, _ = staged_output(enc, torch.rand(1, 3, 64, 64))
    step = weakref.ref(y.grad_fn.step)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert engine.stages == [0, 1, 2, 3, 4] * 2
    gc.disable()
    try:
        del y
        assert step() is None
    finally:
        gc.enable()


def test_gradients_accumulate_and_no_input_gradient_unless_asked():
    enc = kfuse.ResNetEncoder(3)
    x = torch.rand(2, 3, 64, 64)
    for _ in range(2):
        y, _, _ = staged_output(enc, x)
        y.backward(torch.ones(y.shape))
    total = 2 * 512 * 4  # sum(dy) per call
    for i, p in enumerate(encoder_module._param_list(enc, enc.config)):
        assert torch.equal(p.grad, torch.full_like(p, 2 * (i + 1) * total))
    assert x.grad is None


def test_a_parameter_changed_in_place_before_the_backward_is_an_error():
    enc = kfuse.ResNetEncoder(3)
    y, _, params = staged_output(enc, torch.rand(1, 3, 64, 64))
    with torch.no_grad():
        params[-1].add_(1.0)  # a parameter of the last block: its stage's node checks it first
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
