"""kfuse.FusedMLP, CPU tier: construction and from_torch validation, the plain-PyTorch CPU path, activations, the
CUDA path's autograd plumbing with a stand-in engine."""

import copy
import ctypes

import pytest
import torch
from torch import nn

import kfuse
from kfuse import Activation, FusedMLP


def softsign_activation():
    return Activation("softsign", "x / (1.0f + fabsf(x))", "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))",
                      torch_fn=lambda x: x / (1 + x.abs()))


def test_from_torch_copies_structure_and_weights():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 64), nn.LeakyReLU(0.2), nn.Linear(64, 32, bias=False), nn.Softplus(beta=2.0),
                        nn.Linear(32, 48), nn.GELU(approximate="tanh"), nn.Linear(48, 5), nn.Sigmoid())
    m = FusedMLP.from_torch(seq)
    assert (m.input_width, m.hidden_widths, m.output_width) == (3, [64, 32, 48], 5)
    assert [a.name for a in m.activations] == ["leaky_relu", "softplus", "gelu"]
    assert m.output_activation.name == "sigmoid"
    assert m.bias_flags == [True, False, True, True]
    assert "0.2" in m.activations[0].expression and "2.0f" in m.activations[1].expression
    x = torch.randn(11, 3)
    torch.testing.assert_close(m(x), seq(x), rtol=1e-6, atol=1e-6)


def test_consecutive_linears_get_identity_between():
    seq = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    m = FusedMLP.from_torch(seq)
    assert [a.name for a in m.activations] == ["identity", "relu"]
    x = torch.randn(4, 8)
    torch.testing.assert_close(m(x), seq(x))


@pytest.mark.parametrize("seq, message", [
    (nn.Sequential(nn.Linear(4, 40), nn.ReLU(), nn.Linear(40, 2)), "hidden layer 0 has width 40"),
    (nn.Sequential(nn.Linear(4, 272), nn.ReLU(), nn.Linear(272, 2)), "multiples of 16 up to 256"),
    (nn.Sequential(nn.Linear(4, 16), nn.Softmax(dim=-1), nn.Linear(16, 2)), "layer 1 (Softmax) is not supported"),
    (nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2)), "approximate='tanh'"),
    (nn.Sequential(nn.ReLU(), nn.Linear(4, 16), nn.Linear(16, 2)), "comes before the first Linear"),
    (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Tanh(), nn.Linear(16, 2)), "follows another activation"),
    (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(8, 2)), "takes 8 features"),
    (nn.Sequential(nn.Linear(4, 16)), "at least two Linear layers"),
    (nn.Sequential(nn.Linear(4, 16), nn.Softplus(threshold=10), nn.Linear(16, 2)), "threshold=20"),
])
def test_from_torch_rejects_what_it_cannot_run(seq, message):
    with pytest.raises(ValueError, match=None) as e:
        FusedMLP.from_torch(seq)
    assert message in str(e.value)


def test_from_torch_needs_a_sequential():
    with pytest.raises(TypeError, match="nn.Sequential"):
        FusedMLP.from_torch(nn.Linear(4, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_widths=[64, 40]), "hidden width 1 is 40"),
    (dict(hidden_widths=[512]), "at most 256"),
    (dict(hidden_widths=[]), "at least one hidden layer"),
    (dict(hidden_widths=[16, 16], activation=["relu"]), "one activation per hidden layer"),
    (dict(activation="swish"), "unknown activation 'swish'"),
    (dict(bias=[True, False]), "one bias flag per layer"),
])
def test_constructor_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError) as e:
        FusedMLP(32, 16, **kwargs)
    assert message in str(e.value)


def test_options_fill_in_defaults_and_name_unknown_fields():
    assert FusedMLP(8, 4, [16]).options == {"packed_relu": True, "staged_stores": True, "mma_bias": True}
    m = FusedMLP(8, 4, [16], options={"mma_bias": False})
    assert m.options == {"packed_relu": True, "staged_stores": True, "mma_bias": False}
    assert copy.deepcopy(m).options == m.options
    with pytest.raises(ValueError, match="unknown MLP option 'packed_gelu'.*packed_relu, staged_stores, mma_bias"):
        FusedMLP(8, 4, [16], options={"packed_gelu": False})


def test_io_width_limits():
    with pytest.raises(ValueError, match="input width"):
        FusedMLP(0, 16, [16])
    with pytest.raises(ValueError, match="output width"):
        FusedMLP(16, 300, [16])


def test_input_checks():
    m = FusedMLP(8, 3, [16])
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 8\)"):
        m(torch.randn(4, 7))
    with pytest.raises(TypeError):
        m([1.0] * 8)
    with pytest.raises(ValueError, match="floating point"):
        m(torch.ones(4, 8, dtype=torch.int64))


def test_cpu_path_trains_and_keeps_leading_dims():
    torch.manual_seed(1)
    m = FusedMLP(6, 4, [32, 16], activation=["silu", "tanh"], output_activation=("leaky_relu", 0.1))
    x = torch.randn(2, 3, 6, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 3, 4)
    y.square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


def test_builtin_activations_match_torch_on_cpu():
    x = torch.linspace(-30, 30, 101, dtype=torch.float64)
    ref = {"relu": torch.relu(x), "sigmoid": torch.sigmoid(x), "tanh": torch.tanh(x),
           "silu": torch.nn.functional.silu(x), "gelu": torch.nn.functional.gelu(x, approximate="tanh"),
           "softplus": torch.nn.functional.softplus(x), "identity": x,
           "leaky_relu": torch.nn.functional.leaky_relu(x, 0.01)}
    assert sorted(ref) == sorted(kfuse._C.mlp_builtin_activation_names())
    for name, r in ref.items():
        torch.testing.assert_close(Activation.builtin(name)(x), r)


def test_user_activation_runs_on_cpu_with_torch_fn_only():
    m = FusedMLP(4, 2, [16], activation=softsign_activation())
    m(torch.randn(3, 4))
    bare = Activation("softsign", "x / (1.0f + fabsf(x))", "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))")
    with pytest.raises(NotImplementedError, match="torch_fn"):
        FusedMLP(4, 2, [16], activation=bare)(torch.randn(3, 4))


def test_user_activation_syntax_errors():
    with pytest.raises(ValueError, match="single CUDA expression"):
        Activation("bad", "x; return 0", "1.0f")
    with pytest.raises(ValueError, match="may use x only"):
        Activation("bad", "y", "1.0f")


@pytest.mark.skipif(not kfuse._C.built_with_cuda(), reason="NVRTC checks user expressions in CUDA builds")
def test_user_expression_that_does_not_compile_quotes_nvrtc():
    with pytest.raises(ValueError) as e:
        Activation("mine", "x / (1.0f + fabsf(x)", "1.0f")
    msg = str(e.value)
    assert "activation 'mine' does not compile" in msg and "x / (1.0f + fabsf(x)" in msg
    assert "NVRTC's log" in msg and "error" in msg
    with pytest.raises(ValueError, match="undefined_fn"):
        Activation("mine", "x", "undefined_fn(y)")


def test_tune_needs_a_cuda_device():
    m = FusedMLP(8, 4, [16])
    with pytest.raises(ValueError, match="CUDA device"):
        m.tune(128)
    with pytest.raises(ValueError, match="CUDA device"):
        m.variants()


class _RecordingEngine:
    """Stands in for the generated kernels (no GPU): records the raw calls and writes known values into the
    gradient buffer, so that the autograd plumbing of FusedMLP's CUDA path runs on CPU tensors."""

    def __init__(self, num_parameters):
        self.num_parameters = num_parameters
        self.calls = []

    def stash_bytes(self, batch):
        return 64

    def backward_workspace_bytes(self, batch):
        return 128

    def forward_train_raw(self, packed, x, y, stash, batch, stream):
        self.calls.append(("forward_train", batch))

    def forward_raw(self, packed, x, y, batch, stream):
        self.calls.append(("forward", batch))

    def backward_raw(self, packed, x, y, dy, stash, workspace, grads, grads_16bit, dx, batch, stream):
        self.calls.append(("backward", grads_16bit, dx != 0))
        dtype = torch.float16 if grads_16bit else torch.float32
        values = torch.arange(self.num_parameters, dtype=dtype)  # entry i = i: the flat layout, visible per view
        ctypes.memmove(grads, values.data_ptr(), values.numel() * values.element_size())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_autograd_plumbing_maps_the_flat_gradients_onto_the_parameters(monkeypatch, dtype):
    """The CUDA path's autograd Function on CPU tensors with a stand-in engine: the training forward and one backward
    run; the gradient vector comes back as one view per parameter in nn.Sequential's order and in the parameters'
    dtype (16-bit written by the kernels directly, no cast); parameters that need no gradient get None; dL/dx only
    when x requires it."""
    monkeypatch.setattr(kfuse.mlp, "_cuda_stream", lambda device: 0)
    m = FusedMLP(8, 4, [16, 16], bias=[True, False, True], dtype=dtype)
    params = m._params()
    engine = _RecordingEngine(sum(p.numel() for p in params))
    packed = torch.empty(16, dtype=torch.uint8)
    m.layers[1].weight.requires_grad_(False)
    x = torch.randn(5, 8, dtype=torch.float16, requires_grad=True)
    y = kfuse.mlp._FusedFunction.apply((engine, engine, packed, True, 4), x, *params)
    assert y.shape == (5, 4) and y.dtype == torch.float16
    grads = torch.autograd.grad(y, [x] + [p for p in params if p.requires_grad], torch.ones_like(y))
    assert engine.calls == [("forward_train", 5), ("backward", dtype == torch.float16, True)]
    assert grads[0].shape == x.shape
    offset, got = 0, iter(grads[1:])
    for p in params:
        if p.requires_grad:
            g = next(got)
            assert g.shape == p.shape and g.dtype == p.dtype
            assert torch.equal(g.flatten().float(), torch.arange(offset, offset + p.numel(), dtype=torch.float32))
        offset += p.numel()
