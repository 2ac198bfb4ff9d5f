"""CIFAR ResNet-18 with every hidden width elastic (HeteroFL's pre-activation-free variant).

3x3 stem at stride 1 without max pool, BasicBlocks [2, 2, 2, 2] at widths [64, 128, 256, 512]
scaled per stage; image channels and classes are fixed. At 32x32 with 100 classes the full
model has 11.22M parameters and ~0.56G MACs (docs/elastic.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models import register_model
from fl_lightning.elastic.models.base import LayerKit, WidthElasticModel, kaiming_init, tag
from fl_lightning.elastic.specs import WidthSpec, scale_channels


class Stem(nn.Module):
    def __init__(self, kit: LayerKit, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = tag(kit.conv(in_channels, out_channels, 3), 0, None)
        self.bn = tag(kit.bn(out_channels), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; a 1x1 conv + BN shortcut when the shape changes."""

    def __init__(self, kit: LayerKit, in_channels: int, out_channels: int, stride: int,
                 in_group: int, group: int):
        super().__init__()
        self.conv1 = tag(kit.conv(in_channels, out_channels, 3, stride=stride), group, in_group)
        self.bn1 = tag(kit.bn(out_channels), group)
        self.conv2 = tag(kit.conv(out_channels, out_channels, 3), group, group)
        self.bn2 = tag(kit.bn(out_channels), group)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_group != group:
            self.shortcut = nn.Sequential(
                tag(kit.conv(in_channels, out_channels, 1, stride=stride, padding=0), group, in_group),
                tag(kit.bn(out_channels), group),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


@register_model("resnet18")
class ResNet18(WidthElasticModel):
    """CIFAR ResNet-18; one width ratio per stage (the stem shares stage 1's width).

    Args:
        num_classes: classifier outputs (fixed across widths).
        input_shape: (channels, height, width) of one input; any resolution works.
        width: multiplier of the full model's stage widths [64, 128, 256, 512].
        channels: explicit full stage widths (overrides ``width``).
        min_width: smallest width ratio, returned by ``min_spec()``.
        elastic: elastic layers (a server model) or plain ones (a deployed subnet).
        max_widths: largest width ratio per stage this instance holds (default all 1); smaller
            values build a reduced copy (a client's local model) whose specs keep their meaning.
    """

    base_channels = (64, 128, 256, 512)
    depths = (2, 2, 2, 2)

    def __init__(self, num_classes: int, input_shape: Sequence[int], width: float = 1.0,
                 channels: Sequence[int] | None = None, min_width: float = 0.0625, elastic: bool = True,
                 max_widths: Sequence[float] | None = None):
        full = tuple(channels) if channels is not None else tuple(
            scale_channels(c, width) for c in self.base_channels)
        if len(full) != len(self.depths):
            raise ValueError(f"ResNet18 has {len(self.depths)} stages, got channels {full}")
        super().__init__(full, elastic, min_width, max_widths, num_classes=num_classes, input_shape=tuple(input_shape))
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        held = self.held_channels
        self.stem = Stem(self.kit, self.input_shape[0], held[0])
        in_channels, in_group = held[0], 0
        for stage, (out_channels, depth) in enumerate(zip(held, self.depths)):
            blocks = []
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(self.kit, in_channels, out_channels, stride, in_group, stage))
                in_channels, in_group = out_channels, stage
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.fc = tag(self.kit.linear(in_channels, num_classes), None, in_group)
        self._init_weights()

    def _init_weights(self) -> None:
        kaiming_init(self)

    def blocks(self):
        blocks = OrderedDict(stem=self.stem)
        for stage in range(1, len(self.depths) + 1):
            for i, block in enumerate(getattr(self, f"layer{stage}")):
                blocks[f"layer{stage}.{i}"] = block
        return blocks

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(features, 1).flatten(1))

    def build_local(self, spec: WidthSpec, elastic: bool) -> "ResNet18":
        return ResNet18(self.num_classes, self.input_shape, channels=self.channels,
                        min_width=self.min_width, elastic=elastic, max_widths=spec.widths)
