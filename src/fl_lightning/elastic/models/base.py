"""The interface every elastic model implements, and a reusable base for width-only models.

:class:`ElasticModel` is what federation code, allocation policies, MAC counting and split
learning are written against:

- ``spec_type``: the frozen dataclass naming an operating point; ``max_spec()``/``min_spec()``
  bound the space (``fl_lightning.elastic.specs.spec_le`` orders it).
- ``set_active(spec)``: subsequent forwards of this (full, weight-sharing) model use the subnet.
- ``forward(x) = forward_head(forward_features(x))`` as in timm: features are the last
  block's output, the head pools and classifies.
- ``block_names``: named block boundaries in forward order. ``forward_until(x, name)`` runs the
  input through block ``name`` (inclusive) and ``forward_from(h, name)`` continues from there to
  the logits, so ``forward_from(forward_until(x, n), n) == forward(x)`` for every ``n``.
- ``split(name) -> (front, back)``: the same two pieces as modules sharing the model's tensors,
  for split learning; ``head_modules()`` names the modules ``forward_head`` uses, so that the
  back half owns them (``fl_lightning.elastic.split``).
- ``regions(spec, kind, offset)``: the RegionMap of a client holding that subnet: every
  state-dict key (parameters and buffers) -> (global key, region). ``kind`` is ``"leading"``
  (HeteroFL, FjORD, FEAST) or ``"rolling"`` (FedRolex, window start ``offset`` in every
  scaled dimension); models without a rolling meaning may refuse it.
- ``extract(spec, kind, offset, elastic=False) -> Routed``: the module a client holding that
  subnet trains, built directly at the subnet's size (never a copy of the global model) and
  holding copies of exactly those regions. Plain (``elastic=False``): a deployable network of
  ordinary layers whose forward is the subnet's. Elastic: the same model class with ``spec`` as
  its largest operating point, so ``set_active(q)`` for any ``q <= spec`` runs the subnet ``q``
  of the global model there (FjORD's ordered dropout inside one local model, FEAST's reduced
  supernet). ``write_back`` of an untouched extraction is the identity, and in eval mode its
  forward equals the global model's after ``set_active(spec)``.

  The mechanism lives here: a model says which regions a spec maps to (``regions``) and how
  to build its local module (``build_local``); ``extract`` builds that module on the meta
  device, materialises it on the global model's device and dtype, copies the routed slices in
  and sets the global model's train/eval mode on it.
- ``arch_key()``: a hashable description of the architecture (not the weights), which keys
  memoized per-spec figures such as MACs.
- ``input_dtype``: None for real-valued inputs; token models set ``torch.long`` so that MAC
  counting feeds them ids.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fl_lightning.elastic.layers.conv import ElasticConv2d
from fl_lightning.elastic.layers.linear import ElasticLinear
from fl_lightning.elastic.layers.norm import ElasticBatchNorm2d
from fl_lightning.elastic.regions import LeadingSlice, Region, RollingSlice
from fl_lightning.elastic.routing import RegionMap, Routed, load_routed_state
from fl_lightning.elastic.specs import WidthSpec, scale_channels
from fl_lightning.elastic.split import SplitBack, SplitFront, split_keys  # noqa: F401 (split_keys re-exported)

_instances = itertools.count()


def _hashable(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


class ElasticModel(nn.Module, abc.ABC):
    """A weight-sharing network whose operating points are described by ``spec_type``.

    Subclasses pass their architecture arguments to ``super().__init__(**arch)`` so that
    :meth:`arch_key` can tell identical architectures apart from different ones.
    """

    spec_type: ClassVar[type]
    input_dtype: ClassVar[Optional[torch.dtype]] = None

    def __init__(self, **arch: Any):
        super().__init__()
        # Without arguments, every instance is its own architecture (memoization stays correct).
        key = _hashable(arch) if arch else ("instance", next(_instances))
        self._arch_key = (type(self).__module__, type(self).__qualname__, key)
        self.active_spec: Any = None

    def arch_key(self) -> Hashable:
        return self._arch_key

    # -- operating points -------------------------------------------------------------------
    @abc.abstractmethod
    def max_spec(self) -> Any: ...

    @abc.abstractmethod
    def min_spec(self) -> Any: ...

    @abc.abstractmethod
    def set_active(self, spec: Any) -> None: ...

    # -- forward pieces ---------------------------------------------------------------------
    @abc.abstractmethod
    def blocks(self) -> "OrderedDict[str, Callable[[torch.Tensor], torch.Tensor]]":
        """Named blocks in forward order; their boundaries are the split points."""

    @abc.abstractmethod
    def forward_head(self, features: torch.Tensor) -> torch.Tensor: ...

    @property
    def block_names(self) -> list[str]:
        return list(self.blocks())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks().values():
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def _block_index(self, name: str) -> int:
        names = self.block_names
        if name not in names:
            raise KeyError(f"unknown block {name!r}; blocks are {names}")
        return names.index(name)

    def forward_until(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Run ``x`` through the blocks up to and including ``name``."""
        stop = self._block_index(name)
        for block in itertools.islice(self.blocks().values(), stop + 1):
            x = block(x)
        return x

    def forward_from(self, h: torch.Tensor, name: str) -> torch.Tensor:
        """Continue from the output of block ``name`` to the logits."""
        start = self._block_index(name)
        for block in itertools.islice(self.blocks().values(), start + 1, None):
            h = block(h)
        return self.forward_head(h)

    # -- split learning ---------------------------------------------------------------------
    def head_modules(self) -> "OrderedDict[str, nn.Module]":
        """The modules :meth:`forward_head` uses, by the attribute name it reads them under.

        The head is code, not a module, so the back half of a :meth:`split` cannot own its
        parameters unless the model names them. ``forward_head`` must read only these
        attributes of ``self``: the back half registers them under the same names and calls
        the class's ``forward_head`` with itself as ``self``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not name its head modules (head_modules), "
                                  f"so it cannot be split by ElasticModel.split")

    def split(self, cut: str) -> "tuple[nn.Module, nn.Module]":
        """``(front, back)`` halves of the model at block ``cut`` (a name in :attr:`block_names`),
        sharing (not copying) its parameters and buffers.

        ``front(x) == forward_until(x, cut)`` and ``back(h) == forward_from(h, cut)``. The front
        holds the blocks up to and including ``cut``; the back the remaining blocks and the
        :meth:`head_modules`, so the parameters of the two halves partition the model's (which
        state-dict keys each half owns: :func:`fl_lightning.elastic.split.split_keys`). The
        halves hold the blocks :meth:`blocks` names at the time of the call; widths set later by
        :meth:`set_active` apply to them (the layers are shared). This default needs every block
        to be an ``nn.Module``; models whose blocks are not override it.
        """
        stop = self._block_index(cut) + 1
        blocks = list(self.blocks().items())
        for name, block in blocks:
            if not isinstance(block, nn.Module):
                raise TypeError(f"{type(self).__name__} cannot be split by ElasticModel.split: block {name!r} "
                                f"is not an nn.Module")
        return SplitFront(blocks[:stop]), SplitBack(blocks[stop:], self.head_modules(), type(self).forward_head)

    # -- routing ----------------------------------------------------------------------------
    @abc.abstractmethod
    def regions(self, spec: Any, kind: str = "leading", offset: int = 0) -> RegionMap:
        """Every state-dict key of the local model of ``spec`` -> (global key, region)."""

    @abc.abstractmethod
    def build_local(self, spec: Any, elastic: bool) -> nn.Module:
        """The local module of ``spec`` with arbitrary weights: plain layers at the subnet's
        size, or (``elastic``) this model class with ``spec`` as its largest operating point.

        :meth:`extract` calls it under ``torch.device("meta")`` with initialisers skipped
        (:class:`uninitialized`), so building costs no memory and no initialisation work; its
        state-dict keys and shapes must be those of
        ``regions(routed_spec(spec, elastic))``.
        """

    def routed_spec(self, spec: Any, elastic: bool) -> Any:
        """The spec whose regions the local model of ``spec`` holds: ``spec`` itself unless an
        elastic local model needs more (the OFA supernet keeps every expansion choice)."""
        return spec

    def extract(self, spec: Any, kind: str = "leading", offset: int = 0, elastic: bool = False) -> Routed:
        """The local model of ``spec`` holding copies of its regions, and the map back."""
        spec = self.routed_spec(spec, elastic)
        regions = self.regions(spec, kind, offset)
        with shapes_only():
            module = self.build_local(spec, elastic)
        _check_covered(module, regions)  # every tensor gets overwritten below
        reference = next((t for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()),
                         torch.empty(0))
        if reference.dtype != torch.get_default_dtype():
            module = module.to(dtype=reference.dtype)  # on meta: no data to convert
        module = module.to_empty(device=reference.device)
        load_routed_state(module, self.state_dict(), regions)
        if isinstance(module, ElasticModel):
            module.set_active(module.max_spec())
        return Routed(module.train(self.training), regions)


def _check_covered(module: nn.Module, regions: RegionMap) -> None:
    """The local module's tensors are exactly the regions' local tensors, shape for shape."""
    tensors = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
    if set(tensors) != set(regions):
        # e.g. a non-persistent buffer: it would keep arbitrary values
        raise RuntimeError(f"local {type(module).__name__} and its regions disagree: only in the module "
                           f"{sorted(set(tensors) - set(regions))}, only in the regions "
                           f"{sorted(set(regions) - set(tensors))}")
    for key, (_, region) in regions.items():
        if tensors[key].shape != region.local_shape:
            raise RuntimeError(f"local {key} has shape {tuple(tensors[key].shape)}, "
                               f"its region {tuple(region.local_shape)}")


# ------------------------------------------------------------------------------------------
# Width-only models (HeteroFL / FjORD / FedRolex style)
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerKit:
    """Layer constructors; the elastic and the plain kit build the same state-dict keys."""

    conv: Callable[..., nn.Module]
    bn: Callable[[int], nn.Module]
    linear: Callable[[int, int], nn.Module]


def _plain_conv(in_channels, out_channels, kernel_size, stride=1, padding=None, bias=False):
    padding = kernel_size // 2 if padding is None else padding
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)


LAYER_KITS = {
    True: LayerKit(ElasticConv2d, ElasticBatchNorm2d, ElasticLinear),
    False: LayerKit(_plain_conv, nn.BatchNorm2d, nn.Linear),
}


def tag(module: nn.Module, *groups: Optional[int]) -> nn.Module:
    """Record which channel group each leading dimension of ``module.weight`` belongs to.

    ``groups`` are (out, in) for conv/linear and (channels,) for batch norm; a group is a stage
    index or None for a fixed dimension (image channels, classes). Bias and running statistics
    follow the first group.
    """
    module.channel_groups = tuple(groups)
    return module


def _tensor_groups(name: str, groups: tuple) -> tuple:
    if name == "weight":
        return groups
    if name == "num_batches_tracked":
        return ()
    return groups[:1]  # bias, running_mean, running_var


def _leading(shape: torch.Size, local: Sequence[int], groups: tuple, offset: int) -> Region:
    return LeadingSlice(shape, local)


def _rolling(shape: torch.Size, local: Sequence[int], groups: tuple, offset: int) -> Region:
    if all(g is None for g in groups):
        return LeadingSlice(shape, local)  # nothing scaled (e.g. a batch counter): whole tensor
    # One offset for every group, reduced modulo each group's full size, so channel j of a
    # layer's output window is channel j of the next layer's input window.
    starts = [offset % shape[d] if g is not None else 0 for d, g in enumerate(groups)]
    return RollingSlice(shape, starts, local)


REGION_KINDS: dict[str, Callable[..., Region]] = {"leading": _leading, "rolling": _rolling}

# Initialisers that fill a fresh tensor in place; skipped while building a local module.
_INITIALISERS = frozenset({
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_,
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.constant_, nn.init.ones_,
    nn.init.zeros_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_,
    nn.init.xavier_normal_, nn.init.orthogonal_,
})


def kaiming_init(module: nn.Module) -> None:
    """He-normal (fan-out) convolutions and unit-scale, zero-shift batch norms, as torchvision's
    ResNets initialise."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class uninitialized(TorchFunctionMode):
    """Build modules without running their initialisers (tensors hold arbitrary values).

    Extraction overwrites every tensor of the module it builds, so initialising it first would
    only cost time; on the meta device an initialiser is no cheaper than on the CPU (it runs
    PyTorch's Python reference implementation to find the output's shape).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Build modules on the meta device without their initialisers: shapes and dtypes only, no
    memory and next to no time (with its initialisers the 55.7M-parameter FEAST supernet takes
    seconds to build even on the meta device)."""
    with torch.device("meta"), uninitialized():
        yield


class WidthElasticModel(ElasticModel):
    """An elastic model whose spec is one width ratio per stage (:class:`WidthSpec`).

    ``channels`` are the full (global) channels per stage, of which every spec's ratios are
    taken; ``max_widths`` bounds the specs this instance holds (default: all ones). The layers
    are built at ``held_channels = stage_channels(WidthSpec(max_widths))``, so a model with
    smaller ``max_widths`` is a reduced copy whose specs keep their global meaning: its
    ``set_active(q)`` runs the same subnet as the global model's.

    Subclasses build their layers from ``self.kit`` (elastic or plain) at ``self.held_channels``,
    ``tag`` every layer with parameters, and implement :meth:`build_local` (the same
    architecture with other ``elastic`` / ``max_widths``). Regions and activation are generic.
    """

    spec_type = WidthSpec

    def __init__(self, channels: Sequence[int], elastic: bool, min_width: float,
                 max_widths: Optional[Sequence[float]] = None, **arch: Any):
        channels = tuple(int(c) for c in channels)
        bounds = WidthSpec(tuple(max_widths) if max_widths is not None else (1.0,) * len(channels))
        super().__init__(channels=channels, elastic=elastic, min_width=min_width, max_widths=bounds.widths, **arch)
        self.channels = channels
        self.elastic = elastic
        self.min_width = min_width
        self.kit = LAYER_KITS[elastic]
        self.bounds = bounds
        self.held_channels = self.stage_channels(bounds)

    # -- specs ------------------------------------------------------------------------------
    def max_spec(self) -> WidthSpec:
        return self.bounds

    def min_spec(self) -> WidthSpec:
        return WidthSpec(tuple(min(self.min_width, w) for w in self.bounds.widths))

    def stage_channels(self, spec: WidthSpec) -> tuple[int, ...]:
        """Channels per stage that ``spec`` activates (ratios of the full ``channels``)."""
        if not isinstance(spec, WidthSpec) or len(spec.widths) != len(self.channels):
            raise ValueError(f"{type(self).__name__} needs a WidthSpec with {len(self.channels)} "
                             f"widths, got {spec!r}")
        return tuple(scale_channels(c, w) for c, w in zip(self.channels, spec.widths))

    def _held_sizes(self, spec: WidthSpec) -> tuple[int, ...]:
        """``stage_channels(spec)``, refused when it needs more channels than this model holds."""
        sizes = self.stage_channels(spec)
        if any(s > h for s, h in zip(sizes, self.held_channels)):
            raise ValueError(f"{spec} exceeds this {type(self).__name__}'s largest spec {self.bounds}")
        return sizes

    def set_active(self, spec: WidthSpec) -> None:
        sizes = self._held_sizes(spec)
        if not self.elastic and sizes != self.held_channels:
            raise ValueError(f"a plain {type(self).__name__} only runs at its own size {self.bounds}, got {spec}")
        for module in self._tagged().values():
            if hasattr(module, "active_out"):
                out_group = module.channel_groups[0]
                module.active_out = None if out_group is None else sizes[out_group]
        self.active_spec = spec

    # -- routing ----------------------------------------------------------------------------
    def _tagged(self) -> dict[str, nn.Module]:
        return {name: m for name, m in self.named_modules() if hasattr(m, "channel_groups")}

    def regions(self, spec: WidthSpec, kind: str = "leading", offset: int = 0) -> RegionMap:
        if kind not in REGION_KINDS:
            raise ValueError(f"unknown region kind {kind!r}; known: {sorted(REGION_KINDS)}")
        make = REGION_KINDS[kind]
        sizes = self._held_sizes(spec)
        regions: RegionMap = {}
        for prefix, module in self._tagged().items():
            tensors = {**module._parameters, **module._buffers}
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                groups = _tensor_groups(name, module.channel_groups)
                local = [tensor.shape[d] if g is None else sizes[g] for d, g in enumerate(groups)]
                key = f"{prefix}.{name}"
                regions[key] = (key, make(tensor.shape, local, groups, offset))
        missing = set(self.state_dict()) - set(regions)
        if missing:
            raise RuntimeError(f"untagged tensors in {type(self).__name__}: {sorted(missing)}")
        return regions
