"""FEAST's fixed variant cache ``A`` (Sec. 3.2, Supp. B): architectures ordered by MACs, the
budget queries of the federation (Eqs. 11, 17, 18) and of serving, and its construction by one
genetic search per target budget (Supp. B.1, Table 1).

File format (JSON)::

    {"input_shape": [3, 32, 32], "num_classes": 100,
     "model": {<the supernet's construction options>},
     "variants": [{"d": [...], "e": [...], "w": [...], "macs": int, "params": int, ...}, ...],
     "search": {<how it was built>}}          # optional provenance

Variants may carry extra keys (target budget, rho, fitness); loading ignores them.

A cache belongs to a *space*: an :class:`OFAResNet` (MACs in fvcore's convention; ``model``
holds ``model.arch``) or a :class:`~.cost.DeepFedNASArch` (MACs in DeepFedNAS's convention, the
paper's; ``model`` holds ``arch.to_dict()``, marked ``"construction": "deepfednas"``). Every
function below that takes a ``model`` takes either (or a cost model of either).
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from fl_lightning.elastic.models.ofa_resnet import OFAResNet, OFASpec
from fl_lightning.elastic.search.cost import CostModel, DeepFedNASArch, cost_model
from fl_lightning.elastic.search.fitness import Fitness, FitnessConfig
from fl_lightning.elastic.search.genetic import search
from fl_lightning.elastic.specs import spec_from_dict, spec_to_dict
from fl_lightning.errors import ConfigError

Segment = tuple[float, float, int, float]
"""``(lowest target MACs, highest target MACs, number of targets, rho_0)``."""



OPTION_DEFAULTS = {"block": "bottleneck", "round_middle": True}
"""Model options newer than some cache files, with the values those files were built for."""


@dataclass(frozen=True)
class Variant:
    """One cached architecture with its cost (``info``: provenance such as the target)."""

    spec: OFASpec
    macs: int
    params: int
    info: dict = field(default_factory=dict, compare=False)


class VariantCache:
    """Architectures ordered by MACs (ties: the order given), with the budget queries.

    Args:
        variants: the architectures; they are sorted by MACs here.
        input_shape: the input the MACs were counted for.
        num_classes: classifier outputs of the model.
        model_options: the construction options (``model.arch`` or ``DeepFedNASArch.to_dict()``).
        search: optional provenance, saved with the cache.
    """

    def __init__(self, variants: Sequence[Variant], input_shape: Sequence[int], num_classes: int,
                 model_options: dict, search: Optional[dict] = None):
        if not variants:
            raise ValueError("a variant cache needs at least one variant")
        self.variants: tuple[Variant, ...] = tuple(sorted(variants, key=lambda v: v.macs))
        self._macs = [v.macs for v in self.variants]  # sorted: budget queries bisect it
        self.input_shape = tuple(int(v) for v in input_shape)
        self.num_classes = int(num_classes)
        self.model_options = dict(model_options)
        self.search = dict(search or {})

    @classmethod
    def from_specs(cls, model: "Space", specs: Sequence[OFASpec],
                   input_shape: Optional[Sequence[int]] = None) -> "VariantCache":
        """A cache of ``specs`` with analytic MACs and parameters (the space's convention)."""
        cost = cost_model(model, input_shape)
        variants = [Variant(_checked(model, cost, s), cost.spec_macs(s), cost.spec_params(s)) for s in specs]
        return cls(variants, cost.input_shape, cost.num_classes, cost.model_options)

    def retarget(self, model: "Space", input_shape: Optional[Sequence[int]] = None) -> "VariantCache":
        """The same architectures with MACs recomputed for another model configuration or
        input (e.g. TinyImageNet's, Supp. B.1), re-sorted."""
        cache = self.from_specs(model, self.specs, input_shape)
        cache.search = dict(self.search, retargeted_from=list(self.input_shape))
        return cache

    # -- access -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.variants)

    def __getitem__(self, index: int) -> OFASpec:
        return self.variants[index].spec

    def __iter__(self) -> Iterator[OFASpec]:
        return (v.spec for v in self.variants)

    @property
    def specs(self) -> list[OFASpec]:
        return [v.spec for v in self.variants]

    @property
    def macs(self) -> list[int]:
        return list(self._macs)

    @property
    def params(self) -> list[int]:
        return [v.params for v in self.variants]

    # -- budget queries ---------------------------------------------------------------------
    def affordable(self, budget: float) -> list[int]:
        """``A_i = {a : MAC(a) <= b_i}`` (Eq. 11) as indices; nested in the budget."""
        return list(range(bisect.bisect_right(self._macs, budget)))

    def global_min(self) -> int:
        """``a^min``: the cheapest cached variant (Eq. 17)."""
        return 0

    def largest_affordable(self, budget: float) -> Optional[int]:
        """The most expensive variant within ``budget`` (serving), None if none is."""
        count = bisect.bisect_right(self._macs, budget)
        return count - 1 if count else None

    def local_max(self, budget: float) -> int:
        """``a_i^max``: the most expensive affordable variant (Eq. 17); a client must afford
        the global minimum, so an empty affordable set is an error."""
        index = self.largest_affordable(budget)
        if index is None:
            raise ValueError(f"budget {budget:.4g} MACs affords no cached variant "
                             f"(the cheapest needs {self._macs[0]})")
        return index

    def intermediates(self, budget: float) -> list[int]:
        """``A_i^int``: affordable variants with MACs strictly between ``a^min`` and
        ``a_i^max`` (Eq. 18)."""
        top = self.local_max(budget)
        low, high = self._macs[self.global_min()], self._macs[top]
        return [i for i in range(top) if low < self._macs[i] < high]

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "model": _plain(self.model_options),
            "variants": [{**spec_to_dict(v.spec), "macs": int(v.macs), "params": int(v.params), **_plain(v.info)}
                         for v in self.variants],
            **({"search": _plain(self.search)} if self.search else {}),
        }

    def save(self, path: Union[str, Path]) -> None:
        """Write the JSON file atomically (a crash leaves no half-written cache)."""
        from fl_lightning.runtime.output_files import write_file

        write_file(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path], model: Optional["Space"] = None,
             key: str = "algorithm.cache") -> "VariantCache":
        """Read a cache; with ``model``, check that it was built for this model (construction
        options, classes, input) and that every variant is one of its architectures with the
        stored MACs and parameters. Raises ConfigError (under ``key``, naming the file) for
        what disagrees."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(key, f"{path}: cannot read a variant cache: {' '.join(str(err).split())}") from None
        try:
            variants = [Variant(spec_from_dict(OFASpec, {k: v[k] for k in ("d", "e", "w")}), int(v["macs"]),
                                int(v["params"]), {k: x for k, x in v.items() if k not in _VARIANT_KEYS})
                        for v in data["variants"]]
            cache = cls(variants, data["input_shape"], data["num_classes"], data["model"], data.get("search"))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(key, f"{path}: not a variant cache file ({type(err).__name__}: {err})") from None
        if model is not None:
            cache.check(model, key)
        return cache

    def check(self, model: "Space", key: str = "cache") -> None:
        """ConfigError unless this cache belongs to ``model`` (see :meth:`load`)."""
        cost = cost_model(model, self.input_shape)
        # options added to the model after a cache was written take the values it was built with
        stored = {**OPTION_DEFAULTS, **_plain(self.model_options)} if "construction" not in self.model_options \
            else _plain(self.model_options)
        actual = _plain(cost.model_options)
        differ = [k for k in sorted(set(stored) | set(actual)) if stored.get(k) != actual.get(k)]
        if differ:
            detail = "; ".join(f"{k}: cache {stored.get(k)!r}, model {actual.get(k)!r}" for k in differ)
            raise ConfigError(key, f"built for a different model ({detail}); rebuild it with "
                                   f"tools/build_cache.py or use VariantCache.retarget")
        if self.num_classes != cost.num_classes:
            raise ConfigError(key, f"built for {self.num_classes} classes, model has {cost.num_classes}")
        for i, v in enumerate(self.variants):
            try:
                _checked(model, cost, v.spec)
            except ValueError as err:
                raise ConfigError(key, f"variant {i} ({v.spec}) is not an architecture of the model: {err}") from None
            macs, params = cost.spec_macs(v.spec), cost.spec_params(v.spec)
            if (macs, params) != (v.macs, v.params):
                raise ConfigError(key, f"variant {i} ({v.spec}) stores {v.macs} MACs / {v.params} params, "
                                       f"the model gives {macs} / {params} at input {list(self.input_shape)}")

    def table(self) -> str:
        """A fixed-width text table: index, MACs, params, spec."""
        lines = [f"{'#':>3}  {'MACs':>9}  {'params':>8}  spec"]
        for i, v in enumerate(self.variants):
            lines.append(f"{i:>3}  {v.macs / 1e6:>8.2f}M  {v.params / 1e6:>7.3f}M  {v.spec}")
        return "\n".join(lines)


_VARIANT_KEYS = {"d", "e", "w", "macs", "params"}

Space = Union[OFAResNet, DeepFedNASArch, CostModel]
"""What a cache is built for: see the module docstring."""


def _checked(model: Space, cost: CostModel, spec: OFASpec) -> OFASpec:
    """``spec`` with its expansions snapped to the space's choices; ValueError if it is not
    one of its architectures."""
    if isinstance(model, OFAResNet):
        return model.check_spec(spec)
    return cost.decode(cost.encode(spec))


def _plain(value: Any) -> Any:
    """JSON-ready copy: tuples as lists, numpy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# ------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------

def segment_targets(low: float, high: float, count: int, spacing: str = "linear") -> list[float]:
    """``count`` target budgets from ``low`` to ``high`` inclusive (one target: ``high``).

    ``linear`` is DeepFedNAS's equidistant grid (its cache generator's ``np.linspace``), which
    FEAST's footprints favour; ``geometric`` spaces them by a constant ratio, resolving cheap
    variants as finely, relative to their cost, as expensive ones.
    """
    if count < 1 or not 0 < low <= high:
        raise ValueError(f"need count >= 1 and 0 < low <= high, got ({low}, {high}, {count})")
    if count == 1:
        return [float(high)]
    if spacing == "geometric":
        return [float(v) for v in np.geomspace(low, high, count)]
    if spacing == "linear":
        return [float(v) for v in np.linspace(low, high, count)]
    raise ValueError(f"spacing must be 'geometric' or 'linear', got {spacing!r}")


def build_cache(model: Space, input_shape: Optional[Sequence[int]] = None,
                segments: Sequence[Segment] = (), population: int = 256,
                generations: int = 512, mutation: float = 0.3, seed: int = 0,
                spacing: str = "linear", tournament: int = 3, elitism: int = 1,
                fitness: FitnessConfig = FitnessConfig(),
                progress: Optional[Callable[[int, int, Variant], None]] = None) -> VariantCache:
    """One genetic search per target budget of every segment (Supp. B.1), merged, with
    identical architectures kept once, and MAC-sorted.

    Target ``k`` (counting over all segments) is searched with seed ``seed + k``, so the cache
    is deterministic and one target's search does not depend on the others'. ``progress`` is
    called as ``progress(k, total, variant)`` after each target. ``segments`` is required: the
    paper's are ``fl_lightning.feast_protocol.CACHE_SEGMENTS``.
    """
    if not segments:
        raise ValueError("build_cache needs at least one segment (low, high, count, rho0)")
    for s in segments:
        if len(s) != 4 or not s[3] > 0:
            raise ValueError(f"a segment is (low, high, count, rho0 > 0), got {s!r}")
    cost = cost_model(model, input_shape)
    objective = Fitness(cost, fitness)
    jobs = [(target, float(rho0)) for low, high, count, rho0 in segments
            for target in segment_targets(low, high, int(count), spacing)]
    start = time.perf_counter()
    found: dict[OFASpec, Variant] = {}
    for k, (target, rho0) in enumerate(jobs):
        spec, macs, fit = search(model, target, rho0, population, generations, mutation, tournament,
                                 elitism, seed + k, cost.input_shape, fitness)
        variant = Variant(spec, macs, cost.spec_params(spec),
                          {"target": round(target), "rho_limit": rho0, "rho": round(objective.spec_rho(spec), 6),
                           "fitness": round(fit, 4)})
        found.setdefault(spec, variant)
        if progress is not None:
            progress(k, len(jobs), variant)
    provenance = {"segments": [list(s) for s in segments], "spacing": spacing, "population": population,
                  "generations": generations, "mutation": mutation, "tournament": tournament,
                  "elitism": elitism, "seed": seed, "targets": len(jobs), "duplicates": len(jobs) - len(found),
                  "fitness": fitness.to_dict(),
                  "seconds": round(time.perf_counter() - start, 2)}
    return VariantCache(list(found.values()), cost.input_shape, cost.num_classes, cost.model_options, provenance)
