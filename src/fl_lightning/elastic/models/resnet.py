"""ResNet-18 with every hidden width elastic (HeteroFL's pre-activation-free variant).

BasicBlocks [2, 2, 2, 2] at widths [64, 128, 256, 512] scaled per stage, after one of three
stems (:data:`STEMS`): CIFAR's 3x3 conv at stride 1 without max pool (the default), the same
conv followed by a max pool for 64x64 TinyImageNet, or ImageNet's 7x7 stride-2 conv and max pool
for larger images (DomainNet). Image channels and classes are fixed. At 32x32 with 100 classes
the full CIFAR model has 11.22M parameters and ~0.56G MACs (docs/elastic.md).

``pretrained`` loads a torchvision ``resnet18`` state dict from a local file
(:meth:`ResNet18.load_torchvision`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models.base import LayerKit, WidthElasticModel, kaiming_init, tag
from fl_lightning.elastic.pretrained import copy_matching, read_state_dict, warn_skipped
from fl_lightning.elastic.specs import WidthSpec, scale_channels
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveInt, UnitFraction, WidthMultiplier


@dataclass(frozen=True)
class StemShape:
    """The stem's conv kernel and stride, and whether a 3x3 stride-2 max pool follows."""

    kernel: int
    stride: int
    max_pool: bool


# Stage 1 should see maps of about 32x32, the resolution the CIFAR ResNet was designed around:
# - "cifar" (32x32 inputs): a 3x3 conv at stride 1 and no pooling keeps the 32x32 map.
# - "tiny" (64x64 TinyImageNet): the same 3x3 conv keeps fine detail at full resolution, then one
#   3x3 stride-2 max pool halves the map to 32x32, so stages 1-4 run at CIFAR's resolutions
#   (32, 16, 8, 4) and cost CIFAR's MACs instead of four times as many; ImageNet's 7x7 stride-2
#   conv would throw away a quarter of the pixels before any 3x3 conv saw them.
# - "imagenet" (DomainNet, larger images): torchvision's 7x7 stride-2 conv (padding 3) and 3x3
#   stride-2 max pool (padding 1), a 4x reduction, as the ImageNet ResNet-18 and its pretrained
#   weights assume (224x224 -> 56x56).
STEMS = {
    "cifar": StemShape(kernel=3, stride=1, max_pool=False),
    "tiny": StemShape(kernel=3, stride=1, max_pool=True),
    "imagenet": StemShape(kernel=7, stride=2, max_pool=True),
}

# torchvision resnet18 state-dict names -> this model's (applied in order; fc and layerX.Y.conv/bn
# names are the same in both).
TORCHVISION_NAMES = (
    (re.compile(r"^conv1\."), "stem.conv."),
    (re.compile(r"^bn1\."), "stem.bn."),
    (re.compile(r"\.downsample\."), ".shortcut."),
)


def torchvision_to_local(key: str) -> str:
    """A torchvision ``resnet18`` state-dict key under this model's name for the same tensor."""
    for pattern, replacement in TORCHVISION_NAMES:
        key = pattern.sub(replacement, key)
    return key


class Stem(nn.Module):
    """conv - BN - ReLU, then a max pool for the larger-image stems (:data:`STEMS`)."""

    def __init__(self, kit: LayerKit, in_channels: int, out_channels: int, shape: StemShape = STEMS["cifar"]):
        super().__init__()
        self.conv = tag(kit.conv(in_channels, out_channels, shape.kernel, stride=shape.stride), 0, None)
        self.bn = tag(kit.bn(out_channels), 0)
        # no parameters: routing and regions are those of the conv and BN alone
        self.pool = nn.MaxPool2d(3, stride=2, padding=1) if shape.max_pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.bn(self.conv(x))))


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


class ResNet18(WidthElasticModel):
    """ResNet-18; one width ratio per stage (the stem shares stage 1's width).

    Args:
        num_classes: classifier outputs (fixed across widths).
        input_shape: (channels, height, width) of one input; any resolution works.
        stem: ``"cifar"`` (3x3 conv, stride 1, no pooling: 32x32 inputs), ``"tiny"`` (the same
            conv then a 3x3 stride-2 max pool: 64x64 TinyImageNet, so stage 1 sees 32x32 maps)
            or ``"imagenet"`` (7x7 stride-2 conv and 3x3 stride-2 max pool: DomainNet's larger
            images, torchvision's stem).
        width: multiplier of the full model's stage widths [64, 128, 256, 512].
        channels: explicit full stage widths (overrides ``width``).
        min_width: smallest width ratio, returned by ``min_spec()``.
        elastic: elastic layers (a server model) or plain ones (a deployed subnet).
        max_widths: largest width ratio per stage this instance holds (default all 1); smaller
            values build a reduced copy (a client's local model) whose specs keep their meaning.
        pretrained: path of a local torchvision ``resnet18`` state dict to start from (never
            downloaded); tensors whose shape differs here are skipped with one warning
            (:meth:`load_torchvision`). A local copy (``build_local``) does not reload it: its
            weights come from the global model by routing.
    """

    base_channels = (64, 128, 256, 512)
    depths = (2, 2, 2, 2)

    def __init__(self, num_classes: int, input_shape: Sequence[int], width: WidthMultiplier = 1.0,
                 channels: Optional[Sequence[PositiveInt]] = None, min_width: UnitFraction = 0.0625,
                 elastic: bool = True, max_widths: Sequence[float] | None = None, stem: str = "cifar",
                 pretrained: Optional[str] = None):
        if stem not in STEMS:
            raise ConfigError("model.stem", f"unknown stem {stem!r}; known: {', '.join(STEMS)}")
        full = tuple(channels) if channels is not None else tuple(
            scale_channels(c, width) for c in self.base_channels)
        if len(full) != len(self.depths):
            raise ConfigError("model.channels", f"must list one width per stage (ResNet18 has {len(self.depths)}), "
                                                f"got {list(full)}")
        super().__init__(full, elastic, min_width, max_widths, num_classes=num_classes, input_shape=tuple(input_shape),
                         stem=stem)
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.stem_kind = stem
        held = self.held_channels
        self.stem = Stem(self.kit, self.input_shape[0], held[0], STEMS[stem])
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
        if pretrained is not None:
            self.load_torchvision(pretrained)

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

    def head_modules(self) -> "OrderedDict[str, nn.Module]":
        return OrderedDict(fc=self.fc)

    def load_torchvision(self, path: str) -> None:
        """Copy a torchvision ``resnet18`` state dict saved at ``path`` into this model.

        Names are mapped (``conv1``/``bn1`` -> ``stem.conv``/``stem.bn``, ``downsample.0/1``
        -> ``shortcut.0/1``; blocks and ``fc`` keep theirs). A tensor whose shape differs here
        (the 7x7 ImageNet stem conv in a 3x3 stem, a 1000-class ``fc``, any tensor of a
        narrower model) is skipped, and everything skipped is named in one warning. A file
        holding no tensor of this model is a ConfigError.
        """
        source = {torchvision_to_local(k): v for k, v in read_state_dict(path).items()}
        outcome = copy_matching(self.state_dict(), source)
        if not outcome["loaded"] and not outcome["mismatched"]:
            raise ConfigError("model.pretrained", f"{path} holds no resnet18 tensor (names like "
                                                         f"conv1.weight, layer1.0.conv1.weight, fc.weight)")
        warn_skipped(path, outcome)

    def build_local(self, spec: WidthSpec, elastic: bool) -> "ResNet18":
        return ResNet18(self.num_classes, self.input_shape, channels=self.channels,
                        min_width=self.min_width, elastic=elastic, max_widths=spec.widths, stem=self.stem_kind)
