"""A small width-elastic CNN for digits, EMNIST and CIFAR-sized images."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models.base import LayerKit, WidthElasticModel, tag
from fl_lightning.elastic.specs import WidthSpec, scale_channels
from fl_lightning.option_types import PositiveInt, UnitFraction, WidthMultiplier


class ConvBlock(nn.Module):
    """conv3x3 - BN - ReLU - optional 2x2 max pool."""

    def __init__(self, kit: LayerKit, in_channels: int, out_channels: int,
                 in_group, out_group: int, pool: bool):
        super().__init__()
        self.conv = tag(kit.conv(in_channels, out_channels, 3), out_group, in_group)
        self.bn = tag(kit.bn(out_channels), out_group)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.bn(self.conv(x))))


class CNN(WidthElasticModel):
    """Conv blocks (each a stage of the width spec), global average pool, linear head.

    Args:
        num_classes: classifier outputs (fixed across widths).
        input_shape: (channels, height, width) of one input; any size works. Blocks after the
            first halve the resolution with a max pool while it is at least 2.
        channels: full output channels of each conv block.
        width: multiplier applied to ``channels`` to build the full (server) model.
        min_width: smallest width ratio, returned by ``min_spec()``.
        elastic: elastic layers (a server model) or plain ones (a deployed subnet).
        max_widths: largest width ratio per block this instance holds (default all 1); smaller
            values build a reduced copy (a client's local model) whose specs keep their meaning.
    """

    def __init__(self, num_classes: int, input_shape: Sequence[int], channels: Sequence[PositiveInt] = (32, 64, 128),
                 width: WidthMultiplier = 1.0, min_width: UnitFraction = 0.0625, elastic: bool = True,
                 max_widths: Optional[Sequence[float]] = None):
        full = tuple(scale_channels(c, width) for c in channels)
        super().__init__(full, elastic, min_width, max_widths, num_classes=num_classes, input_shape=tuple(input_shape))
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        in_channels, side = self.input_shape[0], min(self.input_shape[1:])
        blocks, in_group = OrderedDict(), None
        held = self.held_channels
        for stage, out_channels in enumerate(held):
            # Pool after every block but the last (global pooling follows) while resolution allows.
            pool = stage < len(held) - 1 and side >= 2
            side = side // 2 if pool else side
            blocks[f"block{stage}"] = ConvBlock(self.kit, in_channels, out_channels, in_group, stage, pool)
            in_channels, in_group = out_channels, stage
        self.features = nn.ModuleDict(blocks)
        self.fc = tag(self.kit.linear(in_channels, num_classes), None, in_group)

    def blocks(self):
        return OrderedDict(self.features.items())

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(features, 1).flatten(1))

    def head_modules(self) -> "OrderedDict[str, nn.Module]":
        return OrderedDict(fc=self.fc)

    def build_local(self, spec: WidthSpec, elastic: bool) -> "CNN":
        return CNN(self.num_classes, self.input_shape, channels=self.channels, width=1.0,
                   min_width=self.min_width, elastic=elastic, max_widths=spec.widths)
