"""A plain-PyTorch implementation of the SE-ResNet-FixUp encoder (bps-nav's ``ResNet(in_channels, base_planes,
ngroups, SEFixupBasicBlock, layers, use_normalization=False)``), written from shared/spec/se-resnet9-fixup.md.

Its module tree, and so its ``state_dict`` keys, are bps-nav's, so checkpoints move both ways. It is the baseline
of the benchmark, the model the tests differentiate with torch.autograd, and the structure that
:class:`kfuse.ResNetEncoder` inherits.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

__all__ = ["SpaceToDepth", "SqueezeExcitation", "SEFixupBasicBlock", "ResNetEncoder", "se_resnet9_fixup"]


class SpaceToDepth(nn.Module):
    """(N, C, H, W) -> (N, 16C, H/4, W/4); channel dy*4C + dx*C + c holds pixel (4i+dy, 4j+dx) of channel c."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        x = x.view(n, c, h // 4, 4, w // 4, 4).permute(0, 3, 5, 1, 2, 4)
        return x.reshape(n, c * 16, h // 4, w // 4)


class SqueezeExcitation(nn.Module):
    """g = sigmoid(fc2(relu(fc1(mean_hw(x))))), shape (N, P, 1, 1); fc1 has P/16 units."""

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__()
        self.squeeze = nn.AdaptiveAvgPool2d(1)
        self.excite = nn.Sequential(
            nn.Linear(planes, int(planes / reduction)),
            nn.ReLU(True),
            nn.Linear(int(planes / reduction), planes),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        return self.excite(self.squeeze(x).view(n, c)).view(n, c, 1, 1)


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, bias=False)


class SEFixupBasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        # Registration order follows bps-nav, so that state_dict() lists the keys in the same order.
        self.fixup_bias1a = nn.Parameter(torch.zeros(1))
        self.fixup_bias1b = nn.Parameter(torch.zeros(1))
        self.fixup_bias2a = nn.Parameter(torch.zeros(1))
        self.fixup_scale = nn.Parameter(torch.ones(1))
        self.fixup_bias2b = nn.Parameter(torch.zeros(1))
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.conv2 = _conv3x3(planes, planes)
        self.downsample: nn.Module | None = None
        if stride != 1:
            self.downsample = nn.Sequential(nn.AvgPool2d(3, stride, padding=1), _conv1x1(inplanes, planes))
        elif inplanes != planes:
            self.downsample = nn.Sequential(_conv1x1(inplanes, planes))
        self.se = SqueezeExcitation(planes)

    def layer_init(self, num_fixups: int) -> None:
        """bps-nav's FixupBasicBlock.layer_init."""
        w = self.conv1.weight
        nn.init.normal_(w, mean=0, std=math.sqrt(2 / (w.shape[0] * w.shape[2] * w.shape[3])) * num_fixups**-0.5)
        nn.init.constant_(self.conv2.weight, 0)
        if self.downsample is not None:
            for m in self.downsample.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.normal_(m.weight, mean=0, std=math.sqrt(2 / (m.weight.shape[0] * m.weight[0, 0].numel())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.pre_activation(x))

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output before its last ReLU: o * g + identity."""
        a = x + self.fixup_bias1a
        h = torch.relu(self.conv1(a) + self.fixup_bias1b)
        o = self.conv2(h + self.fixup_bias2a) * self.fixup_scale + self.fixup_bias2b
        identity = x if self.downsample is None else self.downsample(a)
        return o * self.se(o) + identity


class ResNetEncoder(nn.Module):
    """The encoder: stem (space-to-depth, 1x1 conv, ReLU) and stages of SE-FixUp basic blocks.

    ``layers`` gives the blocks per stage; stage i has ``base_planes * 2**i`` channels. Input (N, C, H, W) with H
    and W multiples of 32 (four stages) -> (N, base_planes * 8, H/32, W/32).
    """

    # torch.jit.script (a benchmark baseline) compiles properties unless told otherwise.
    __jit_unused_properties__ = ["config"]

    def __init__(self, in_channels: int = 3, base_planes: int = 64, layers: Sequence[int] = (1, 1, 1, 1)):
        super().__init__()
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        if base_planes < 16:
            raise ValueError(f"base_planes must be >= 16 (the SE layer has planes/16 units), got {base_planes}")
        layers = tuple(int(n) for n in layers)
        if not layers or any(n < 1 for n in layers):
            raise ValueError(f"layers must be a non-empty sequence of positive block counts, got {layers}")
        self.in_channels, self.base_planes, self.layer_counts = in_channels, base_planes, layers
        self.stem = nn.Sequential(SpaceToDepth(), nn.Conv2d(in_channels * 16, base_planes, 1, bias=False), nn.ReLU(True))
        self.layers = nn.ModuleList()
        inplanes = base_planes
        for i, count in enumerate(layers):
            planes = base_planes * 2**i
            stride = 1 if i == 0 and len(layers) == 4 else 2
            blocks = []
            for j in range(count):
                blocks.append(SEFixupBasicBlock(inplanes, planes, stride if j == 0 else 1))
                inplanes = planes
            self.layers.append(nn.Sequential(*blocks))
        self.out_channels = inplanes
        num_fixups = sum(layers)
        for m in self.modules():
            if isinstance(m, SEFixupBasicBlock):
                m.layer_init(num_fixups)

    @property
    def config(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.in_channels, self.base_planes, self.layer_counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.layers:
            x = stage(x)
        return x


def se_resnet9_fixup(in_channels: int = 3, base_planes: int = 64) -> ResNetEncoder:
    return ResNetEncoder(in_channels, base_planes, (1, 1, 1, 1))
