"""FEAST's shared elastic supernet: a Once-for-All-style ResNet (FEAST Sec. 3.2, Supp. B).

Architecture ``a = (d, e, w)`` (:class:`OFASpec`):

- ``d[l]`` in {0..8}: extra blocks of stage ``l`` after its base block (OFA keeps the *first*
  ``1 + d[l]`` blocks of a stage);
- ``e[l]`` in {0.10, 0.14, 0.18, 0.22, 0.25}: stage expansion, a block's middle width being
  ``make_divisible(out * e)`` (a leading slice of the middle channels; see ``round_middle``);
- ``w[j]`` in {0..9}: width-multiplier index (multipliers 0.1..1.0) of the stem (``j = 0``)
  and of each stage's output width (leading slices of the channels).

Two constructions share this space (``block``; docs/feast_supernet.md):

- ``"basic_pair"`` (the default), FEAST's own (the DeepFedNAS ``GenericOFAResNet`` as the
  FEAST code builds it): 3x3 stem of 64 channels; four stages of nine blocks of two 3x3
  convolutions (in -> mid -> out) with output widths [128, 256, 512, 1024]; 55,682,916
  parameters at 100 classes;
- ``"bottleneck"`` (kept for runs and caches made with it; pass it explicitly): 3x3 stem of 128
  channels; four stages of nine 1x1-3x3-1x1 bottlenecks with output widths
  [256, 512, 1024, 2048]; 55,677,412 parameters at 100 classes.

Both put a projection shortcut (average pool, 1x1 conv, BN; OFA's ``avgpool_conv``) on the
first block of every stage and an identity elsewhere, and end in global average pooling and a
linear head.

The same class with smaller maxima (``max_extra_blocks``, ``max_width_index``) is the reduced
supernet that FEAST routes to a client (``fl_lightning.elastic.envelope``); its tensors are
leading slices of the full supernet's same-named tensors, so specs keep their meaning there.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models.base import LAYER_KITS, ElasticModel, LayerKit, kaiming_init, shapes_only
from fl_lightning.elastic.regions import Full, LeadingSlice
from fl_lightning.elastic.routing import RegionMap
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import NonNegativeInt, PositiveFloat, PositiveInt, WidthMultiplier

EXPANSION_CHOICES = (0.10, 0.14, 0.18, 0.22, 0.25)
WIDTH_MULTIPLIERS = tuple(round(0.1 * (i + 1), 1) for i in range(10))
MAX_EXTRA_BLOCKS = 8
CHANNEL_DIVISOR = 8


def make_divisible(value: float, divisor: int) -> int:
    """Nearest multiple of ``divisor`` (at least ``divisor``), bumped up when rounding down
    would lose more than 10% (Once-for-All's rule). Monotone in ``value``, so larger width or
    expansion choices never give fewer channels."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


@dataclass(frozen=True)
class OFASpec:
    """One architecture ``a = (d, e, w)`` of the supernet (FEAST Eq. 9).

    ``d``: extra blocks per stage; ``e``: expansion ratio per stage; ``w``: width-multiplier
    index of the stem and of each stage (``len(w) == len(d) + 1``).
    """

    d: tuple[int, ...]
    e: tuple[float, ...]
    w: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "d", tuple(int(v) for v in self.d))
        object.__setattr__(self, "e", tuple(float(v) for v in self.e))
        object.__setattr__(self, "w", tuple(int(v) for v in self.w))
        if len(self.e) != len(self.d) or len(self.w) != len(self.d) + 1:
            raise ValueError(f"OFASpec needs len(e) == len(d) and len(w) == len(d) + 1, "
                             f"got d={self.d}, e={self.e}, w={self.w}")

    def __str__(self) -> str:
        e = ",".join(f"{v:g}" for v in self.e)
        return f"d={''.join(map(str, self.d))} e=({e}) w={''.join(map(str, self.w))}"


# ------------------------------------------------------------------------------------------
# Building blocks, shared by the elastic supernet and its plain extractions
# ------------------------------------------------------------------------------------------

class Stem(nn.Module):
    """conv3x3 - BN - ReLU."""

    def __init__(self, kit: LayerKit, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv = kit.conv(in_channels, out_channels, 3, stride=stride)
        self.bn = kit.bn(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _projection(kit: LayerKit, in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    """Average pool (when strided), 1x1 conv, BN: OFA's ``avgpool_conv`` shortcut (ResNet-D),
    so the 1x1 conv sees every input position instead of one in four."""
    pool = nn.AvgPool2d(stride, stride, ceil_mode=True) if stride > 1 else nn.Identity()
    return nn.Sequential(OrderedDict(
        pool=pool, conv=kit.conv(in_channels, out_channels, 1, padding=0), bn=kit.bn(out_channels)))


class Bottleneck(nn.Module):
    """1x1 reduce - 3x3 (carries the stride) - 1x1 expand, plus a shortcut; ReLU after the add."""

    def __init__(self, kit: LayerKit, in_channels: int, mid_channels: int, out_channels: int,
                 stride: int, projection: bool):
        super().__init__()
        self.conv1 = kit.conv(in_channels, mid_channels, 1, padding=0)
        self.bn1 = kit.bn(mid_channels)
        self.conv2 = kit.conv(mid_channels, mid_channels, 3, stride=stride)
        self.bn2 = kit.bn(mid_channels)
        self.conv3 = kit.conv(mid_channels, out_channels, 1, padding=0)
        self.bn3 = kit.bn(out_channels)
        self.shortcut: nn.Module = _projection(kit, in_channels, out_channels, stride) if projection else nn.Identity()

    def set_widths(self, mid_channels: int, out_channels: int) -> None:
        """Active widths of an elastic block (the input width is read from the input)."""
        self.conv1.active_out = self.conv2.active_out = mid_channels
        self.conv3.active_out = out_channels
        if isinstance(self.shortcut, nn.Sequential):
            self.shortcut.conv.active_out = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class BasicPair(nn.Module):
    """3x3 conv in -> mid (carries the stride) - BN - ReLU, 3x3 conv mid -> out - BN - ReLU,
    plus a shortcut, ReLU after the add (DeepFedNAS's residual block).

    Unlike a torchvision ``BasicBlock`` the middle width is ``out x e`` (at most a quarter of the
    output) and the second conv's BN is followed by a ReLU *before* the residual addition, as
    DeepFedNAS's ``DynamicResidualBlock`` / ``NewResidualBlock`` compute.
    """

    def __init__(self, kit: LayerKit, in_channels: int, mid_channels: int, out_channels: int,
                 stride: int, projection: bool):
        super().__init__()
        self.conv1 = kit.conv(in_channels, mid_channels, 3, stride=stride)
        self.bn1 = kit.bn(mid_channels)
        self.conv2 = kit.conv(mid_channels, out_channels, 3)
        self.bn2 = kit.bn(out_channels)
        self.shortcut: nn.Module = _projection(kit, in_channels, out_channels, stride) if projection else nn.Identity()

    def set_widths(self, mid_channels: int, out_channels: int) -> None:
        """Active widths of an elastic block (the input width is read from the input)."""
        self.conv1.active_out = mid_channels
        self.conv2.active_out = out_channels
        if isinstance(self.shortcut, nn.Sequential):
            self.shortcut.conv.active_out = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(out + self.shortcut(x))


@dataclass(frozen=True)
class Construction:
    """A block type and the widths and strides the supernet built from it uses by default."""

    block: type
    stem_channels: int
    stage_channels: tuple[int, ...]
    # Inputs of at least 64 px (TinyImageNet): the stride of the stem and of stage 1's first
    # block (later stages always stride 2), so the stages see what they see at 32 px.
    large_input_stem_stride: int
    large_input_first_stride: int
    # Middle width: make_divisible(round(out * e)) if True, make_divisible(out * e) if False.
    round_middle: bool


CONSTRUCTIONS: dict[str, Construction] = {
    # FEAST's code (configs/supernets/4-stage-supernet-*.json): stem stride 2 at 64 px; middle
    # widths as its cost counter (utils/subnet_cost.py), which produced the paper's figures.
    "basic_pair": Construction(BasicPair, 64, (128, 256, 512, 1024), 2, 1, False),
    # This repository's earlier reading of the paper: stage 1 strides at 64 px instead.
    "bottleneck": Construction(Bottleneck, 128, (256, 512, 1024, 2048), 1, 2, True),
}


@dataclass(frozen=True)
class StageShape:
    """Physical shape of one stage: number of blocks and channel widths."""

    blocks: int
    mid: int
    out: int


class _ResNetBody(nn.Module):
    """Stem, stages of residual blocks and a linear head at given physical sizes.

    Both the elastic supernet (at its maxima) and plain extractions (at a spec's sizes) are
    built here, so their state-dict keys coincide and every tensor of an extraction is a
    leading slice of the supernet tensor with the same key.
    """

    def _build(self, kit: LayerKit, block: type, num_classes: int, in_channels: int, stem: int,
               stages: Sequence[StageShape], strides: Sequence[int], stem_stride: int) -> None:
        self.stem = Stem(kit, in_channels, stem, stem_stride)
        self.stages = nn.ModuleList()
        width = stem
        for shape, stride in zip(stages, strides):
            blocks = nn.ModuleList()
            for b in range(shape.blocks):
                blocks.append(block(kit, width, shape.mid, shape.out, stride if b == 0 else 1,
                                    projection=b == 0))
                width = shape.out
            self.stages.append(blocks)
        self.classifier = kit.linear(width, num_classes)

    def _active_blocks(self, depths: Sequence[int]) -> "OrderedDict[str, nn.Module]":
        blocks: "OrderedDict[str, nn.Module]" = OrderedDict(stem=self.stem)
        for l, (stage, depth) in enumerate(zip(self.stages, depths)):
            for b in range(depth):
                blocks[f"stages.{l}.{b}"] = stage[b]
        return blocks

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks().values():
            x = block(x)
        return x

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(F.adaptive_avg_pool2d(features, 1).flatten(1))

    def head_modules(self) -> "OrderedDict[str, nn.Module]":
        """The classifier, which :meth:`forward_head` reads (the back half of a split owns it)."""
        return OrderedDict(classifier=self.classifier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def _init_weights(self) -> None:
        kaiming_init(self)


class OFASubnet(_ResNetBody):
    """A plain (deployable) network for one spec; built by :meth:`OFAResNet.build_local`."""

    def __init__(self, num_classes: int, in_channels: int, stem: int, stages: Sequence[StageShape],
                 strides: Sequence[int], stem_stride: int = 1, block: str = "basic_pair"):
        super().__init__()
        self._build(LAYER_KITS[False], CONSTRUCTIONS[block].block, num_classes, in_channels, stem, stages,
                    strides, stem_stride)
        self._depths = tuple(s.blocks for s in stages)

    def blocks(self) -> "OrderedDict[str, nn.Module]":
        return self._active_blocks(self._depths)


def leading_regions(global_state, local_state) -> RegionMap:
    """Every local tensor is the leading slice of the same-named global tensor."""
    regions: RegionMap = {}
    for key, local in local_state.items():
        shape = global_state[key].shape
        region = Full(shape) if local.shape == shape else LeadingSlice(shape, local.shape)
        regions[key] = (key, region)
    return regions


# ------------------------------------------------------------------------------------------
# The elastic supernet
# ------------------------------------------------------------------------------------------

class OFAResNet(_ResNetBody, ElasticModel):
    """FEAST's OFA-style elastic ResNet (``d``, ``e``, ``w`` elastic).

    Args:
        num_classes: classifier outputs (fixed).
        input_shape: (channels, height, width) of one input. Inputs of at least 64 px
            (TinyImageNet) are brought to the stage resolutions of a 32 px input (CIFAR) by a
            stride-2 stem (``basic_pair``, as FEAST's code) or a stride-2 first stage
            (``bottleneck``); smaller inputs keep both at stride 1.
        block: the construction: ``"basic_pair"`` (default; FEAST's supernet: two 3x3 convs per
            block, 64-channel stem, stage widths [128, 256, 512, 1024]) or ``"bottleneck"``
            (1x1-3x3-1x1 blocks, 128-channel stem, stage widths [256, 512, 1024, 2048]). Both
            have 55.68M parameters at 100 classes (docs/feast_supernet.md).
        stem_channels: full stem width (default: the construction's, 64 or 128).
        stage_channels: full output width of each stage (default: the construction's).
        width_scale: multiplies ``stem_channels`` and ``stage_channels``, for a narrowed
            CPU-sized supernet (1.0 is FEAST's).
        max_extra_blocks: most extra blocks per stage (int or one per stage; 8 in FEAST).
        expansions: stage expansion choices; the largest sizes the middle channels.
        width_multipliers: width choices indexed by ``w`` (0.1..1.0).
        max_width_index: largest ``w`` index of the stem and each stage (default: the last);
            smaller values make a reduced supernet holding leading slices only.
        divisor: channel counts are rounded to multiples of this (8 as OFA/DeepFedNAS; use
            1-4 for narrowed supernets so small widths stay distinct).
        stage_strides: stride of each stage's first block (default: see ``input_shape``).
        stem_stride: stride of the stem conv (default: see ``input_shape``).
        round_middle: whether a block's middle width rounds ``out * e`` to an integer before
            ``make_divisible`` (as OFA's and FEAST's network code do) or rounds ``out * e``
            directly (as DeepFedNAS's and FEAST's cost counter, which produced the paper's MAC
            and parameter figures, does). The two differ for a few (stage, width, expansion)
            choices, e.g. 176 x 0.1 = 17.6 gives 24 or 16 channels. Default: the
            construction's (``basic_pair``: False, ``bottleneck``: True).
    """

    spec_type = OFASpec

    @classmethod
    def check_options(cls, block: str = "basic_pair", stem_channels: Optional[int] = None,
                      stage_channels: Optional[Sequence[int]] = None, width_scale: float = 1.0, **_) -> None:
        """Rules between options, checked before anything is built: with ``basic_pair`` (the
        DeepFedNAS construction FEAST searches and counts MACs on), ``width_scale`` must give
        whole base channel counts."""
        construction = CONSTRUCTIONS.get(block)
        if block != "basic_pair" or construction is None:
            return
        stem = construction.stem_channels if stem_channels is None else stem_channels
        stages = construction.stage_channels if stage_channels is None else stage_channels
        fractional = [c for c in [stem, *stages] if not float(c * width_scale).is_integer()]
        if fractional:
            raise ConfigError("model.width_scale",
                              f"{width_scale} gives fractional base channels ({fractional[0]} x {width_scale} = "
                              f"{fractional[0] * width_scale:g}); with block basic_pair the base channels "
                              f"({stem}, {', '.join(map(str, stages))}) times width_scale must be whole numbers, "
                              "e.g. 0.25 or 0.5")

    def __init__(self, num_classes: int = 100, input_shape: Sequence[int] = (3, 32, 32),
                 block: str = "basic_pair", stem_channels: Optional[PositiveInt] = None,
                 stage_channels: Optional[Sequence[PositiveInt]] = None, width_scale: WidthMultiplier = 1.0,
                 max_extra_blocks: Union[NonNegativeInt, Sequence[NonNegativeInt]] = MAX_EXTRA_BLOCKS,
                 expansions: Sequence[PositiveFloat] = EXPANSION_CHOICES,
                 width_multipliers: Sequence[PositiveFloat] = WIDTH_MULTIPLIERS,
                 max_width_index: Optional[Sequence[NonNegativeInt]] = None, divisor: PositiveInt = CHANNEL_DIVISOR,
                 stage_strides: Optional[Sequence[PositiveInt]] = None, stem_stride: Optional[PositiveInt] = None,
                 round_middle: Optional[bool] = None):
        if block not in CONSTRUCTIONS:
            raise ConfigError("model.block",
                              f"unknown block {block!r}; known: {', '.join(sorted(CONSTRUCTIONS))}")
        construction = CONSTRUCTIONS[block]
        stem_channels = construction.stem_channels if stem_channels is None else stem_channels
        stage_channels = construction.stage_channels if stage_channels is None else stage_channels
        num_stages = len(stage_channels)
        if isinstance(max_extra_blocks, int):
            max_extra_blocks = (max_extra_blocks,) * num_stages
        if max_width_index is None:
            max_width_index = (len(width_multipliers) - 1,) * (num_stages + 1)
        large = min(input_shape[1:]) >= 64
        if stage_strides is None:
            stage_strides = (construction.large_input_first_stride if large else 1,) + (2,) * (num_stages - 1)
        if stem_stride is None:
            stem_stride = construction.large_input_stem_stride if large else 1
        if round_middle is None:
            round_middle = construction.round_middle
        arch = dict(num_classes=int(num_classes), input_shape=tuple(int(v) for v in input_shape), block=block,
                    stem_channels=int(stem_channels), stage_channels=tuple(int(c) for c in stage_channels),
                    width_scale=float(width_scale), max_extra_blocks=tuple(int(v) for v in max_extra_blocks),
                    expansions=tuple(sorted(float(v) for v in expansions)),
                    width_multipliers=tuple(sorted(float(v) for v in width_multipliers)),
                    max_width_index=tuple(int(v) for v in max_width_index), divisor=int(divisor),
                    stage_strides=tuple(int(v) for v in stage_strides), stem_stride=int(stem_stride),
                    round_middle=bool(round_middle))
        _check_arch(arch)
        ElasticModel.__init__(self, **arch)
        self.arch = arch
        self.num_classes = arch["num_classes"]
        self.input_shape = arch["input_shape"]
        self.num_stages = num_stages
        self.expansions = arch["expansions"]
        self.width_multipliers = arch["width_multipliers"]
        self.max_extra_blocks = arch["max_extra_blocks"]
        self.max_width_index = arch["max_width_index"]
        self._build(LAYER_KITS[True], construction.block, self.num_classes, self.input_shape[0],
                    *self._shapes(self.max_spec()), arch["stage_strides"], arch["stem_stride"])
        self._init_weights()
        self.set_active(self.max_spec())

    # -- channel arithmetic -----------------------------------------------------------------
    @property
    def max_expansion(self) -> float:
        return self.expansions[-1]

    def stem_width(self, index: int) -> int:
        base = self.arch["stem_channels"] * self.arch["width_scale"]
        return make_divisible(base * self.width_multipliers[index], self.arch["divisor"])

    def stage_width(self, stage: int, index: int) -> int:
        base = self.arch["stage_channels"][stage] * self.arch["width_scale"]
        return make_divisible(base * self.width_multipliers[index], self.arch["divisor"])

    def mid_width(self, out_channels: int, expansion: float) -> int:
        """A block's middle width at output width ``out_channels`` (see ``round_middle``)."""
        value = out_channels * expansion
        return make_divisible(round(value) if self.arch["round_middle"] else value, self.arch["divisor"])

    def _shapes(self, spec: OFASpec) -> tuple[int, list[StageShape]]:
        stages = []
        for l in range(self.num_stages):
            out = self.stage_width(l, spec.w[l + 1])
            stages.append(StageShape(1 + spec.d[l], self.mid_width(out, spec.e[l]), out))
        return self.stem_width(spec.w[0]), stages

    # -- specs ------------------------------------------------------------------------------
    def max_spec(self) -> OFASpec:
        return OFASpec(self.max_extra_blocks, (self.max_expansion,) * self.num_stages, self.max_width_index)

    def min_spec(self) -> OFASpec:
        return OFASpec((0,) * self.num_stages, (self.expansions[0],) * self.num_stages,
                       (0,) * (self.num_stages + 1))

    def check_spec(self, spec: OFASpec) -> OFASpec:
        """``spec`` with its expansions snapped to the exact choices; ValueError if it is
        not an architecture of this (possibly reduced) supernet."""
        if not isinstance(spec, OFASpec) or len(spec.d) != self.num_stages:
            raise ValueError(f"expected an OFASpec with {self.num_stages} stages, got {spec!r}")
        for l, (d, limit) in enumerate(zip(spec.d, self.max_extra_blocks)):
            if not 0 <= d <= limit:
                raise ValueError(f"d[{l}]={d} outside 0..{limit} of this supernet")
        for j, (w, limit) in enumerate(zip(spec.w, self.max_width_index)):
            if not 0 <= w <= limit:
                raise ValueError(f"w[{j}]={w} outside 0..{limit} of this supernet")
        snapped = []
        for l, e in enumerate(spec.e):
            match = [c for c in self.expansions if math.isclose(c, e, abs_tol=1e-9)]
            if not match:
                raise ValueError(f"e[{l}]={e} is not one of {self.expansions}")
            snapped.append(match[0])
        return OFASpec(spec.d, tuple(snapped), spec.w)

    def sample_spec(self, generator: Optional[torch.Generator] = None) -> OFASpec:
        """A uniformly random architecture of this supernet."""
        def pick(n: int) -> int:
            return int(torch.randint(n, (1,), generator=generator))
        return OFASpec(tuple(pick(m + 1) for m in self.max_extra_blocks),
                       tuple(self.expansions[pick(len(self.expansions))] for _ in range(self.num_stages)),
                       tuple(pick(m + 1) for m in self.max_width_index))

    def set_active(self, spec: OFASpec) -> None:
        spec = self.check_spec(spec)
        stem, stages = self._shapes(spec)
        self.stem.conv.active_out = stem
        for blocks, shape in zip(self.stages, stages):
            for block in list(blocks)[:shape.blocks]:
                block.set_widths(shape.mid, shape.out)
        self.active_spec = spec

    # -- forward ----------------------------------------------------------------------------
    def blocks(self) -> "OrderedDict[str, nn.Module]":
        """``stem`` and ``stages.<l>.<b>`` for the active blocks, in forward order."""
        return self._active_blocks([1 + d for d in self.active_spec.d])

    # -- routing ----------------------------------------------------------------------------
    def reduced(self, bounds: OFASpec) -> "OFAResNet":
        """The same supernet with maxima ``bounds.d`` / ``bounds.w`` (all expansions kept).

        Weights are freshly initialised; :meth:`extract` with ``elastic=True`` builds it on the
        meta device and fills it with leading slices of this model's tensors.
        """
        bounds = self.check_spec(bounds)
        return OFAResNet(**{**self.arch, "max_extra_blocks": bounds.d, "max_width_index": bounds.w})

    def routed_spec(self, spec: OFASpec, elastic: bool) -> OFASpec:
        """An elastic local model keeps every expansion choice (FEAST Supp. C): its middle
        channels are those of the largest expansion, whatever ``spec.e`` says."""
        spec = self.check_spec(spec)
        return OFASpec(spec.d, (self.max_expansion,) * self.num_stages, spec.w) if elastic else spec

    def build_local(self, spec: OFASpec, elastic: bool) -> nn.Module:
        """Plain: an :class:`OFASubnet` at the sizes of ``spec``. Elastic: the reduced supernet
        bounded by ``spec`` (:meth:`reduced`)."""
        if elastic:
            return self.reduced(spec)
        stem, stages = self._shapes(self.check_spec(spec))
        return OFASubnet(self.num_classes, self.input_shape[0], stem, stages,
                         self.arch["stage_strides"], self.arch["stem_stride"], self.arch["block"])

    def regions(self, spec: OFASpec, kind: str = "leading", offset: int = 0) -> RegionMap:
        _leading_only(kind)
        with shapes_only():
            local = self.build_local(spec, elastic=False)
        return leading_regions(self.state_dict(), local.state_dict())


def _leading_only(kind: str) -> None:
    if kind != "leading":
        raise ValueError(f"ofa_resnet routes leading slices only (FEAST), got kind={kind!r}")


def _check_arch(arch: dict) -> None:
    """Fail early, naming the option, on inconsistent architecture options."""
    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"model.{key}", problem)

    stages = len(arch["stage_channels"])
    if stages < 1:
        raise bad("stage_channels", "need at least one stage")
    if len(arch["max_extra_blocks"]) != stages or min(arch["max_extra_blocks"]) < 0:
        raise bad("max_extra_blocks", f"need {stages} values >= 0, got {arch['max_extra_blocks']}")
    if len(arch["stage_strides"]) != stages:
        raise bad("stage_strides", f"need {stages} values, got {arch['stage_strides']}")
    widths = arch["max_width_index"]
    if len(widths) != stages + 1 or any(not 0 <= w < len(arch["width_multipliers"]) for w in widths):
        raise bad("max_width_index", f"need {stages + 1} indexes into width_multipliers, got {widths}")
    if not arch["expansions"] or not all(0 < e <= 1 for e in arch["expansions"]):
        raise bad("expansions", f"need ratios in (0, 1], got {arch['expansions']}")
    if not arch["width_multipliers"] or not all(0 < m <= 1 for m in arch["width_multipliers"]):
        raise bad("width_multipliers", f"need values in (0, 1], got {arch['width_multipliers']}")
    if arch["width_scale"] <= 0:
        raise bad("width_scale", f"must be > 0, got {arch['width_scale']}")
    if arch["divisor"] < 1:
        raise bad("divisor", f"must be >= 1, got {arch['divisor']}")
