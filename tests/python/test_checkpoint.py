"""Checkpoints: bps-nav state_dict keys, safetensors files written by the safetensors package, and clear errors."""

import pytest
import torch
from safetensors.torch import save_file

import kfuse
from kfuse import _C

# bps-nav's se_resnet9_fixup(3, 64, ...) state_dict keys, in order, as its module tree registers them.
BPS_NAV_BLOCK_KEYS = ["fixup_bias1a", "fixup_bias1b", "fixup_bias2a", "fixup_scale", "fixup_bias2b", "conv1.weight",
                      "conv2.weight", "se.excite.0.weight", "se.excite.0.bias", "se.excite.2.weight", "se.excite.2.bias"]


def expected_keys():
    keys = ["stem.1.weight"]
    for i in range(4):
        block = [f"layers.{i}.0.{k}" for k in BPS_NAV_BLOCK_KEYS]
        if i > 0:
            block.insert(7, f"layers.{i}.0.downsample.1.weight")
        keys += block
    return keys


def test_state_dict_keys_and_count_are_bps_navs():
    enc = kfuse.ResNetEncoder()
    assert list(enc.state_dict().keys()) == expected_keys()
    assert [n for n, _ in _C.param_specs(enc.config)] == expected_keys()
    assert sum(p.numel() for p in enc.parameters()) == 4_938_256
    assert enc.layers[1][0].downsample[0].stride == 2  # index 0 is the pool


def test_bps_nav_init():
    enc = kfuse.ResNetEncoder()
    for stage in enc.layers:
        b = stage[0]
        assert torch.count_nonzero(b.conv2.weight) == 0
        assert b.fixup_scale.item() == 1.0 and b.fixup_bias1a.item() == 0.0
        planes = b.conv1.weight.shape[0]
        assert abs(b.conv1.weight.std().item() / ((2 / (planes * 9)) ** 0.5 / 2) - 1) < 0.05


def test_safetensors_from_a_state_dict_loads_as_is(tmp_path, make_reference):
    ref = make_reference(in_channels=11, seed=2)
    path = tmp_path / "backbone.safetensors"
    save_file(ref.state_dict(), str(path))
    enc = kfuse.ResNetEncoder.from_checkpoint(path)
    assert enc.config == (11, 64, (1, 1, 1, 1))
    for (n, p), q in zip(enc.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_save_load_round_trip_and_prefix(tmp_path, make_reference):
    enc = kfuse.ResNetEncoder.from_torch(make_reference(in_channels=1, base_planes=32, layers=(1, 2, 1, 1), seed=3))
    enc.save_checkpoint(tmp_path / "a.safetensors")
    back = kfuse.ResNetEncoder.from_checkpoint(tmp_path / "a.safetensors")
    assert back.config == enc.config
    for p, q in zip(back.parameters(), enc.parameters()):
        assert torch.equal(p, q)
    policy = {f"net.visual_encoder.backbone.{k}": v for k, v in enc.state_dict().items()}
    policy["net.critic.weight"] = torch.zeros(3)
    save_file(policy, str(tmp_path / "policy.safetensors"))
    inner = kfuse.ResNetEncoder.from_checkpoint(tmp_path / "policy.safetensors", prefix="net.visual_encoder.backbone.")
    assert inner.config == enc.config


def test_half_precision_checkpoint_converts(tmp_path, make_reference):
    ref = make_reference(seed=4)
    save_file({k: v.half() for k, v in ref.state_dict().items()}, str(tmp_path / "h.safetensors"))
    enc = kfuse.ResNetEncoder.from_checkpoint(tmp_path / "h.safetensors")
    assert torch.equal(enc.stem[1].weight, ref.stem[1].weight.half().float())


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop("layers.2.0.fixup_scale"), "lacks 1 tensor.*layers.2.0.fixup_scale"),
    (lambda sd: sd.update({"layers.0.0.bn.weight": torch.ones(3)}), "does not have: 'layers.0.0.bn.weight'"),
    (lambda sd: sd.update({"layers.1.0.conv1.weight": torch.ones(128, 64, 3, 1)}),
     r"layers.1.0.conv1.weight' has shape \[128, 64, 3, 1\], expected \[128, 64, 3, 3\]"),
    (lambda sd: sd.update({"layers.0.0.fixup_bias2a": torch.ones(1, dtype=torch.int32)}),
     "fixup_bias2a' has dtype I32"),
    (lambda sd: sd.pop("stem.1.weight"), "missing tensor 'stem.1.weight'"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, match):
    sd = kfuse.ResNetEncoder().state_dict()
    edit(sd)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(kfuse.CheckpointError, match=match):
        kfuse.ResNetEncoder.from_checkpoint(path)


def test_truncated_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "ok.safetensors"
    kfuse.ResNetEncoder().save_checkpoint(path)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(kfuse.CheckpointError, match="trunc.safetensors.*truncated"):
        kfuse.ResNetEncoder.from_checkpoint(tmp_path / "trunc.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(kfuse.CheckpointError, match="not a JSON object"):
        kfuse.ResNetEncoder.from_checkpoint(tmp_path / "garbage.safetensors")
    with pytest.raises(kfuse.CheckpointError, match="cannot open .*nothing.safetensors"):
        kfuse.ResNetEncoder.from_checkpoint(tmp_path / "nothing.safetensors")
    assert issubclass(kfuse.CheckpointError, ValueError)
