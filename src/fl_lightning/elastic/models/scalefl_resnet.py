"""ScaleFL's depth-width-scalable ResNet-18 with early exits (Ilhan, Su and Liu, CVPR 2023).

The substrate is the CIFAR ResNet-18 of :mod:`~fl_lightning.elastic.models.resnet` (the same
stems, BasicBlocks and state-dict names, hidden widths [64, 128, 256, 512], two BasicBlocks per
stage) with an exit classifier after every block named in ``exit_blocks``. An operating point is
a :class:`DepthWidthSpec`: the first ``depth`` BasicBlocks, every layer at the leading
``width`` fraction of its channels (HeteroFL's and ScaleFL's top-left slices), and the classifier
that sits after block ``depth`` (an exit, or the final ``fc`` after the last block). So ScaleFL's
level ``(blocks, width)`` is ``DepthWidthSpec(blocks, width)``, and the model of a level-k client
holds the exits of levels 1..k; its final classifier is the level-k exit.

Forward passes:

- ``forward(x)`` is the served model: the blocks up to the active depth and the one classifier
  there; the other exits are not computed, so MACs counted on an extracted model
  (``fl_lightning.elastic.macs.spec_macs``) are what a client is served.
- ``forward_exits(x)`` runs the same trunk once and returns the logits of every classifier up to
  the active depth, shallowest first (ScaleFL's training forward); its last entry equals
  ``forward(x)``.

Exit design (``exit_convs``): ScaleFL's code puts ``exit_convs`` conv3x3-BN-ReLU layers before
the pooling and the linear layer of each ResNet exit (3 in its CIFAR ResNet-110 config); the
FEAST paper's adaptation to ResNet-18 (35M MACs at level 1, Supp. E.1; 11.27M parameters in
all, Supp. E.5) matches plain pool + linear exits, the default here (``docs/scalefl.md``).

At 32x32 with 100 classes and the default exits (after blocks 3, 4 and 5) the full model has
11.27M parameters; see ``docs/scalefl.md`` for the measured MACs of the four levels.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.models.base import (REGION_KINDS, LayerKit, WidthElasticModel, _tensor_groups, kaiming_init,
                                              tag)
from fl_lightning.elastic.models.resnet import STEMS, BasicBlock, Stem
from fl_lightning.elastic.routing import RegionMap
from fl_lightning.elastic.specs import WidthSpec, scale_channels
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import NonNegativeInt, PositiveInt, UnitFraction, WidthMultiplier

DEFAULT_EXIT_BLOCKS = (3, 4, 5)
"""Blocks after which ScaleFL's levels 1-3 end (levels (3, 0.40), (4, 0.50), (5, 0.60), (8, 1.00))."""


@dataclass(frozen=True)
class DepthWidthSpec:
    """One ScaleFL operating point: the first ``depth`` BasicBlocks at width ratio ``width``.

    Ordered coordinate-wise (``fl_lightning.elastic.specs.spec_le``): a smaller depth and width
    is a sub-model of a larger one (its blocks and leading channels are among the larger's).
    """

    depth: int
    width: float

    def __post_init__(self):
        if isinstance(self.depth, bool) or int(self.depth) != self.depth or self.depth < 1:
            raise ValueError(f"depth must be an integer >= 1 (BasicBlocks), got {self.depth!r}")
        if not 0.0 < float(self.width) <= 1.0:
            raise ValueError(f"width ratio must lie in (0, 1], got {self.width!r}")
        object.__setattr__(self, "depth", int(self.depth))
        object.__setattr__(self, "width", float(self.width))

    def __str__(self) -> str:
        return f"blocks={self.depth},width={self.width:g}"


class ExitHead(nn.Module):
    """``convs`` x (conv3x3 - BN - ReLU) at the block's width, global average pool, linear."""

    def __init__(self, kit: LayerKit, channels: int, num_classes: int, group: int, convs: int = 0):
        super().__init__()
        layers = []
        for _ in range(convs):
            layers += [tag(kit.conv(channels, channels, 3), group, group), tag(kit.bn(channels), group), nn.ReLU()]
        self.convs = nn.Sequential(*layers)
        self.fc = tag(kit.linear(channels, num_classes), None, group)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.convs(h), 1).flatten(1))


class ScaleFLResNet18(WidthElasticModel):
    """ResNet-18 whose operating points are (depth in BasicBlocks, one width ratio), with exits.

    Args:
        num_classes: classifier outputs of every exit (fixed across operating points).
        input_shape: (channels, height, width) of one input.
        exit_blocks: BasicBlocks (1-based, counted over all stages) after which an exit
            classifier sits; the final ``fc`` after the last block is always there. ScaleFL's
            four levels end after blocks 3, 4, 5 and 8, hence the default (3, 4, 5).
        exit_convs: conv3x3-BN-ReLU layers in each exit before its pooling and linear layer
            (0: pool + linear, the FEAST paper's ResNet-18 adaptation; ScaleFL's ResNet-110
            code uses 3).
        width: multiplier of the full model's stage widths [64, 128, 256, 512].
        channels: explicit full stage widths (overrides ``width``).
        min_width: smallest width ratio, returned by ``min_spec()``.
        stem: ``"cifar"`` (3x3 stride-1 conv, no pooling), ``"tiny"`` or ``"imagenet"``, as in
            ``resnet18``.
        elastic: elastic layers (a server model) or plain ones (a deployed or client model).
        max_width: largest width ratio this instance holds (default 1); smaller values build a
            reduced copy (a client's local model) whose specs keep their global meaning.
        max_depth: BasicBlocks this instance holds (default all 8); a reduced copy holds the
            exits up to it and the final ``fc`` only at full depth. Must be a classifier depth.
    """

    base_channels = (64, 128, 256, 512)
    depths = (2, 2, 2, 2)
    spec_type = DepthWidthSpec

    def __init__(self, num_classes: int, input_shape: Sequence[int],
                 exit_blocks: Sequence[PositiveInt] = DEFAULT_EXIT_BLOCKS, exit_convs: NonNegativeInt = 0,
                 width: WidthMultiplier = 1.0,
                 channels: Optional[Sequence[PositiveInt]] = None, min_width: UnitFraction = 0.0625,
                 stem: str = "cifar", elastic: bool = True, max_width: float = 1.0, max_depth: Optional[int] = None):
        total = sum(self.depths)
        if stem not in STEMS:
            raise ConfigError("model.stem", f"unknown stem {stem!r}; known: {', '.join(STEMS)}")
        exits = tuple(exit_blocks)
        if any(not 1 <= b < total for b in exits) or list(exits) != sorted(set(exits)):
            raise ConfigError("model.exit_blocks",
                              f"must be increasing distinct block counts in 1..{total - 1}, got {list(exits)}")
        if not 0 < float(max_width) <= 1:
            raise ValueError(f"max_width must lie in (0, 1], got {max_width}")
        max_depth = total if max_depth is None else int(max_depth)
        if max_depth not in exits + (total,):
            raise ValueError(f"max_depth {max_depth} has no classifier; "
                             f"classifiers follow blocks {list(exits) + [total]}")
        full = tuple(channels) if channels is not None else tuple(scale_channels(c, width) for c in self.base_channels)
        if len(full) != len(self.depths):
            raise ConfigError("model.channels", f"must list one width per stage (ScaleFLResNet18 has {len(self.depths)}), "
                                                f"got {list(full)}")
        super().__init__(full, elastic, min_width, (float(max_width),) * len(full), num_classes=num_classes,
                         input_shape=tuple(input_shape), stem=stem, exit_blocks=exits, exit_convs=exit_convs,
                         max_depth=max_depth)
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.stem_kind = stem
        self.exit_blocks = exits
        self.exit_convs = exit_convs
        self.total_depth = total
        self.max_depth = max_depth
        self.max_width = float(max_width)
        # (stage, index in stage) of each global block, 1-based block numbers -> position
        self.block_positions = [(s, i) for s, d in enumerate(self.depths) for i in range(d)]
        held = self.held_channels
        self.stem = Stem(self.kit, self.input_shape[0], held[0], STEMS[stem])
        in_channels, in_group, number = held[0], 0, 0
        for stage, (out_channels, depth) in enumerate(zip(held, self.depths)):
            blocks = []
            for i in range(depth):
                number += 1
                if number > max_depth:
                    break
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(self.kit, in_channels, out_channels, stride, in_group, stage))
                in_channels, in_group = out_channels, stage
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        self.exits = nn.ModuleDict({
            str(b): ExitHead(self.kit, held[self.stage_of(b)], num_classes, self.stage_of(b), exit_convs)
            for b in exits if b <= max_depth})
        self.has_final = max_depth == total
        if self.has_final:
            self.fc = tag(self.kit.linear(held[-1], num_classes), None, len(held) - 1)
        kaiming_init(self)

    # -- structure ----------------------------------------------------------------------------
    def stage_of(self, block: int) -> int:
        """Stage (0-based) of the 1-based global block number ``block``."""
        return self.block_positions[block - 1][0]

    def classifier_depths(self) -> list[int]:
        """Depths (in blocks) after which this instance holds a classifier, shallowest first."""
        return [b for b in self.exit_blocks if b <= self.max_depth] + ([self.total_depth] if self.has_final else [])

    def _block(self, number: int) -> nn.Module:
        stage, i = self.block_positions[number - 1]
        return getattr(self, f"layer{stage + 1}")[i]

    def _classify(self, depth: int, h: torch.Tensor) -> torch.Tensor:
        if depth == self.total_depth:
            return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return self.exits[str(depth)](h)

    def _held_prefixes(self, depth: int) -> list[str]:
        """State-dict prefixes of the modules a model of ``depth`` blocks holds."""
        prefixes = ["stem"]
        for number in range(1, depth + 1):
            stage, i = self.block_positions[number - 1]
            prefixes.append(f"layer{stage + 1}.{i}")
        prefixes += [f"exits.{b}" for b in self.exit_blocks if b <= depth]
        if depth == self.total_depth:
            prefixes.append("fc")
        return prefixes

    # -- operating points ---------------------------------------------------------------------
    def max_spec(self) -> DepthWidthSpec:
        return DepthWidthSpec(self.max_depth, self.max_width)

    def min_spec(self) -> DepthWidthSpec:
        return DepthWidthSpec(self.classifier_depths()[0], min(self.min_width, self.max_width))

    def _widths(self, spec: DepthWidthSpec) -> WidthSpec:
        if not isinstance(spec, DepthWidthSpec):
            raise ValueError(f"{type(self).__name__} needs a DepthWidthSpec, got {spec!r}")
        if spec.depth not in self.classifier_depths():
            raise ValueError(f"{spec}: no classifier after block {spec.depth}; this model's classifiers follow "
                             f"blocks {self.classifier_depths()}")
        return WidthSpec.uniform(spec.width, len(self.channels))

    def set_active(self, spec: DepthWidthSpec) -> None:
        sizes = self._held_sizes(self._widths(spec))
        if not self.elastic and (sizes != self.held_channels or spec.depth != self.max_depth):
            raise ValueError(f"a plain {type(self).__name__} only runs at its own size {self.max_spec()}, got {spec}")
        for module in self._tagged().values():
            if hasattr(module, "active_out"):
                out_group = module.channel_groups[0]
                module.active_out = None if out_group is None else sizes[out_group]
        self.active_spec = spec

    @property
    def active_depth(self) -> int:
        return (self.active_spec or self.max_spec()).depth

    # -- forward ------------------------------------------------------------------------------
    def blocks(self):
        out = OrderedDict(stem=self.stem)
        for number in range(1, self.active_depth + 1):
            stage, i = self.block_positions[number - 1]
            out[f"layer{stage + 1}.{i}"] = self._block(number)
        return out

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """The classifier after the active depth (an exit, or ``fc`` at full depth)."""
        return self._classify(self.active_depth, features)

    def forward_exits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Logits of every classifier up to the active depth, shallowest first (one trunk pass)."""
        depth = self.active_depth
        heads = [d for d in self.classifier_depths() if d <= depth]
        h = self.stem(x)
        outs = []
        for number in range(1, depth + 1):
            h = self._block(number)(h)
            if number in heads:
                outs.append(self._classify(number, h))
        return outs

    # -- routing ------------------------------------------------------------------------------
    def regions(self, spec: DepthWidthSpec, kind: str = "leading", offset: int = 0) -> RegionMap:
        """Every tensor of the blocks up to ``spec.depth`` and of the classifiers there, each
        at the leading ``spec.width`` slice of its channel groups."""
        if kind not in REGION_KINDS:
            raise ValueError(f"unknown region kind {kind!r}; known: {sorted(REGION_KINDS)}")
        make = REGION_KINDS[kind]
        sizes = self._held_sizes(self._widths(spec))
        prefixes = self._held_prefixes(spec.depth)

        def held(key: str) -> bool:
            return any(key == p or key.startswith(p + ".") for p in prefixes)

        regions: RegionMap = {}
        for prefix, module in self._tagged().items():
            if not held(prefix):
                continue
            tensors = {**module._parameters, **module._buffers}
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                groups = _tensor_groups(name, module.channel_groups)
                local = [tensor.shape[d] if g is None else sizes[g] for d, g in enumerate(groups)]
                key = f"{prefix}.{name}"
                regions[key] = (key, make(tensor.shape, local, groups, offset))
        missing = {k for k in self.state_dict() if held(k)} - set(regions)
        if missing:
            raise RuntimeError(f"untagged tensors in {type(self).__name__}: {sorted(missing)}")
        return regions

    def build_local(self, spec: DepthWidthSpec, elastic: bool) -> "ScaleFLResNet18":
        return ScaleFLResNet18(self.num_classes, self.input_shape, exit_blocks=self.exit_blocks,
                               exit_convs=self.exit_convs, channels=self.channels, min_width=self.min_width,
                               stem=self.stem_kind, elastic=elastic, max_width=spec.width, max_depth=spec.depth)


class AllExits(nn.Module):
    """``model.forward_exits`` stacked into one tensor [exits, batch, classes]: the training
    forward as a module, so fvcore can count its MACs (``count_macs(AllExits(local), shape)``)."""

    def __init__(self, model: ScaleFLResNet18):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.model.forward_exits(x))


def exit_costs(model: ScaleFLResNet18, spec: DepthWidthSpec, input_shape: Sequence[int]) -> dict:
    """Per-example figures of the local model of ``spec`` (fvcore, batch 1, eval mode):
    ``served_macs`` (the single classifier at ``spec.depth``), ``train_macs`` (every exit up to
    it, ScaleFL's training forward), ``params`` (the routed model: its blocks and all its exits)
    and ``served_params`` (without the shallower exits)."""
    from fl_lightning.elastic.macs import count_macs, count_params

    local = model.extract(spec).module
    served = count_macs(local, input_shape)
    train = count_macs(AllExits(local), input_shape)
    shallower = sum(count_params(local.exits[str(b)]) for b in local.classifier_depths()[:-1])
    params = count_params(local)
    return {"served_macs": served, "train_macs": train, "params": params, "served_params": params - shallower}


__all__ = ["ScaleFLResNet18", "DepthWidthSpec", "ExitHead", "AllExits", "exit_costs", "DEFAULT_EXIT_BLOCKS"]
