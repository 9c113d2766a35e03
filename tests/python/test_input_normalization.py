"""CPU tier: the uint8 input normalization that the CUDA engine folds into the stem's read (ResNetEncoder
set_input_normalization -> the per-channel scale and shift handed to the engine) follows every change, although it
is computed once per normalization rather than per call."""
import copy
import pickle

import torch

import kfuse


def _expected(mean, var):
    mean, var = torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64)
    inv = torch.rsqrt(var.clamp_min(1e-2))
    return (inv / 255).tolist(), (-mean * inv).tolist()


def test_the_affine_follows_each_normalization():
    enc = kfuse.ResNetEncoder.default_network(3)
    assert enc._uint8_affine() == ([1 / 255] * 3, [0.0] * 3)
    enc.set_input_normalization([0.1, 0.2, 0.3], [0.04, 0.5, 0.001])  # the last var below the 1e-2 floor
    assert enc._uint8_affine() == _expected([0.1, 0.2, 0.3], [0.04, 0.5, 0.001])
    assert enc._uint8_affine() is enc._uint8_affine()  # computed once
    enc.set_input_normalization([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    assert enc._uint8_affine() == _expected([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    enc.set_input_normalization()
    assert enc._uint8_affine() == ([1 / 255] * 3, [0.0] * 3)


def test_copies_keep_their_own_normalization():
    enc = kfuse.ResNetEncoder.default_network(3)
    enc.set_input_normalization([0.1, 0.2, 0.3], [0.04, 0.5, 0.2])
    want = _expected([0.1, 0.2, 0.3], [0.04, 0.5, 0.2])
    enc._uint8_affine()
    for other in (copy.deepcopy(enc), pickle.loads(pickle.dumps(enc))):
        assert other._uint8_affine() == want
        other.set_input_normalization([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
        assert other._uint8_affine() == _expected([0.0] * 3, [1.0] * 3)
    assert enc._uint8_affine() == want
