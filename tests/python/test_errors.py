"""Bad input gives a clear exception naming the problem, never a crash or a silent wrong answer."""

import pytest
import torch

import kfuse
from kfuse import _C

CFG = (3, 16, (1, 1, 1, 1))


@pytest.fixture
def enc(make_reference):
    return kfuse.ResNetEncoder.from_torch(make_reference(in_channels=3, base_planes=16, seed=1))


@pytest.mark.parametrize("shape, match", [
    ((3, 64, 64), "rank 4"),
    ((2, 4, 64, 64), "4 channels"),
    ((2, 3, 64, 40), "multiples of 32"),
    ((0, 3, 64, 64), "batch"),
])
def test_misshapen_input(enc, shape, match):
    with pytest.raises(ValueError, match=match):
        enc(torch.rand(shape))


def test_wrong_dtype(enc):
    with pytest.raises(ValueError, match="float64 does not match"):
        enc(torch.rand(1, 3, 32, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 or float64"):
        enc.half()(torch.rand(1, 3, 32, 32).half())


def test_not_a_tensor(enc):
    with pytest.raises(TypeError, match="torch.Tensor"):
        enc([[1.0]])


def test_gradient_release_names_its_choices():
    with pytest.raises(ValueError, match=r"gradient_release must be one of \('at_end', 'per_block'\), got 'later'"):
        kfuse.ResNetEncoder(gradient_release="later")
    assert kfuse.ResNetEncoder(gradient_release="per_block").gradient_release == "per_block"


def test_device_mismatch_and_unsupported_device(enc):
    with pytest.raises(ValueError, match="input is on meta"):
        enc(torch.empty(1, 3, 32, 32, device="meta"))
    with pytest.raises(NotImplementedError, match="meta"):
        enc.to("meta")(torch.empty(1, 3, 32, 32, device="meta"))


def test_non_contiguous_input_gives_the_contiguous_answer(enc):
    x = torch.rand(2, 3, 32, 32)
    x_nc = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channels_last strides
    assert not x_nc.is_contiguous()
    with torch.no_grad():
        assert torch.equal(enc(x_nc), enc(x))


def _params(dtype=torch.float32):
    return [torch.rand(s, dtype=dtype) for _, s in _C.param_specs(CFG)]


def test_low_level_api_names_the_offending_tensor():
    params = _params()
    x = torch.rand(1, 3, 32, 32)
    out = torch.full((1, 128, 1, 1), float("nan"))
    _C.reference_forward(CFG, params, x, out)  # well-formed call works and writes every element
    assert not out.isnan().any()
    with pytest.raises(ValueError, match="contiguous"):
        _C.reference_forward(CFG, params, x.transpose(2, 3), out)
    bad = list(params)
    bad[3] = torch.rand(2)
    with pytest.raises(ValueError, match=r"parameter 'layers.0.0.fixup_bias2a' has shape \[2\], expected \[1\]"):
        _C.reference_forward(CFG, bad, x, out)
    with pytest.raises(ValueError, match="int32"):
        _C.reference_forward(CFG, params, x.to(torch.int32), out)
    with pytest.raises(ValueError, match="expected 48 parameter tensors"):
        _C.reference_forward(CFG, params[:-1], x, out)
    with pytest.raises(ValueError, match=r"output has shape \[1, 128, 2, 1\], expected \[1, 128, 1, 1\]"):
        _C.reference_forward(CFG, params, x, torch.empty(1, 128, 2, 1))
    with pytest.raises(ValueError, match="output must be contiguous"):
        _C.reference_forward(CFG, params, x, torch.empty(1, 128, 1, 2)[..., :1])
    grads = [torch.empty_like(p) for p in params]
    with pytest.raises(ValueError, match="grad_output has shape"):
        _C.reference_backward(CFG, params, x, torch.rand(1, 128, 2, 2), grads)
    with pytest.raises(ValueError, match="expected 48 parameter gradient tensors"):
        _C.reference_backward(CFG, params, x, torch.rand(1, 128, 1, 1), grads[:3])
    with pytest.raises(ValueError, match="base_planes"):
        _C.param_specs((3, 8, (1, 1, 1, 1)))


def test_bad_configuration():
    with pytest.raises(ValueError, match="in_channels"):
        kfuse.ResNetEncoder(in_channels=0)
    with pytest.raises(ValueError, match="layers"):
        kfuse.ResNetEncoder(layers=(1, 0))


def test_from_torch_rejects_other_modules():
    with pytest.raises(ValueError, match="not a bps-nav SE-ResNet-FixUp encoder"):
        kfuse.ResNetEncoder.from_torch(torch.nn.Linear(3, 4))


@pytest.mark.skipif(not hasattr(_C, "EncoderGpu"), reason="a build without CUDA has no EncoderGpu")
def test_encoder_options_are_checked_before_anything_else():
    # Checked before the device is looked at: these run on machines without a GPU too.
    with pytest.raises(ValueError, match="unknown encoder option 'fused_blockz'.*fused_blocks"):
        _C.EncoderGpu(CFG, "float16", 0, {"fused_blockz": 1})
    with pytest.raises(ValueError, match="fused_stem is a flag"):
        _C.EncoderGpu(CFG, "float16", 0, {"fused_stem": 2})
