"""A supernet's fixed variant cache and the population served from it (FEAST Eq. 3, Supp. B,
E.1): the cache loaded or searched once, each client's affordable set, and the evaluation of
every cached variant, extracted, BN-recalibrated on the server's calibration split and scored,
with the population accuracy under largest-affordable serving. FEAST and the SuperFedNAS /
DeepFedNAS transfers are scored through it, so their numbers sit side by side."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fl_lightning.algorithms.level_report import variant_report
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CACHE_SEGMENTS, SEARCH_GENERATIONS, SEARCH_MUTATION, SEARCH_POPULATION
from fl_lightning.option_types import ClosedUnitInterval, FiniteFloat, NonNegativeInt, PositiveInt, number_type
from fl_lightning.runtime.calibration import ServerCalibration
from fl_lightning.runtime.evaluation import evaluate, evaluate_levels


@dataclass
class CacheSearch:
    """How the variant cache is built when no cache file is given (Supp. B.1, Table 1)."""

    segments: List[List[FiniteFloat]] = field(default_factory=lambda: [list(s) for s in CACHE_SEGMENTS])
    """[lowest MACs, highest MACs, number of targets, effectiveness ceiling rho_0] per segment."""
    population: number_type(int, ge=2) = SEARCH_POPULATION
    """Genetic-search population per target."""
    generations: PositiveInt = SEARCH_GENERATIONS
    """Genetic-search generations per target."""
    mutation: ClosedUnitInterval = SEARCH_MUTATION
    """Mutation probability."""
    seed: NonNegativeInt = 0
    """Search seed (the cache is built once, before federation)."""


def check_cache_options(cache: Optional[str], search: CacheSearch) -> None:
    """Refuse search segments the cache cannot be built from, or a cache path that is not a
    JSON variant cache (before any work)."""
    if not search.segments:
        raise ConfigError("algorithm.search.segments", "must list at least one segment [low MACs, high MACs, "
                                                       "count, rho_0]; the cache is searched per segment")
    for i, seg in enumerate(search.segments):
        if len(seg) != 4 or not all(math.isfinite(v) for v in seg) or not 0 < seg[0] <= seg[1] \
                or int(seg[2]) < 1 or not 0 < seg[3] <= 1:
            raise ConfigError(f"algorithm.search.segments[{i}]",
                              f"must be [low MACs, high MACs >= low, count >= 1, rho_0 in (0, 1]], got {seg}")
    if cache is not None:
        check_cache_file(cache)


def check_cache_file(path: str) -> None:
    """A variant cache must be a readable JSON file (checked before any work)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError("algorithm.cache", f"no cache file at {path}")
    try:
        content = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError("algorithm.cache", f"{path} is not a JSON variant cache ({type(error).__name__})") from None
    if not isinstance(content, dict):
        raise ConfigError("algorithm.cache", f"{path} is not a JSON variant cache (expected an object)")


class CachedVariants:
    """The cache one run trains and serves, each client's affordable set of cached variants
    (indices, cheapest first) and the variant each client is served (its largest affordable)."""

    def __init__(self, ctx, cache: Optional[str], retarget: bool, search: CacheSearch, calib_batch_size: int,
                 calib_transform: str, method: str, required_by: str):
        """``method`` names the algorithm in the report; ``required_by`` says, when the run holds
        no calibration split, what needs one."""
        from fl_lightning.algorithms.supernet.feast_accounting import affordable_sets

        self.ctx, self.method = ctx, method
        self.calibration = ServerCalibration(ctx, calib_batch_size, calib_transform,
                                             required_by=required_by)
        self.input_shape = tuple(ctx.data.bundle.input_shape)
        self.cache = self._load_or_build(cache, retarget, search)
        budgets = [float(b) for b in ctx.budgets.tolist()]
        self.sets = affordable_sets(self.cache, budgets)
        for client, s in enumerate(self.sets):
            if not s:  # the population accuracy serves every client a cached variant
                raise ConfigError("partition.budgets.b_min",
                                  f"client {client}'s budget {budgets[client] / 1e6:.1f}M MACs affords no "
                                  f"cached variant (smallest: {self.cache.macs[0] / 1e6:.1f}M)")
        self.served = sorted({s[-1] for s in self.sets})

    def _load_or_build(self, path: Optional[str], retarget: bool, search: CacheSearch):
        from fl_lightning.elastic.search.cache import VariantCache, build_cache
        from fl_lightning.elastic.search.genetic import InfeasibleError

        ctx = self.ctx
        saved = Path(ctx.run_dir) / "cache.json"
        if ctx.resuming and saved.is_file():  # a resumed or re-scored run keeps the cache it started with
            return VariantCache.load(saved, ctx.model)
        if path is not None:
            if retarget:
                return VariantCache.load(path).retarget(ctx.model, self.input_shape)
            return VariantCache.load(path, ctx.model)
        try:
            return build_cache(ctx.model, self.input_shape, segments=[tuple(seg) for seg in search.segments],
                               population=search.population, generations=search.generations,
                               mutation=search.mutation, seed=search.seed)
        except InfeasibleError as error:
            raise ConfigError("algorithm.search.segments", str(error)) from None

    def artifact(self) -> Dict[str, str]:
        """``cache.json``: the cache the run trains, so a resumed or re-scored run uses the same one."""
        return {"cache.json": json.dumps(self.cache.to_dict(), indent=2)}

    def specs_of(self, client: int) -> list:
        """The architectures of the client's affordable cached variants, cheapest first."""
        return [self.cache.specs[j] for j in self.sets[client]]

    def calibrated_subnet(self, spec) -> torch.nn.Module:
        """The plain subnet of ``spec`` with its BN statistics re-estimated on the calibration
        split (fixed order, no mixing)."""
        return self.calibration.subnet(spec)

    def evaluate_variant(self, index: int, split: str, batch_size: int) -> Dict[str, float]:
        """Extract one cached variant, recalibrate its BN, and score it."""
        data = self.ctx.data
        subnet = self.calibrated_subnet(self.cache.specs[index])
        dataset, indices = data.split(split)
        return evaluate(self.ctx.fabric, subnet, dataset, indices, data.bundle.num_classes, batch_size)

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Validation scores the served variants (enough for the population figure that selects
        checkpoints); the test set scores every cached variant."""
        variants = self.served if split == "val" else range(len(self.cache.specs))
        return evaluate_levels(lambda j: self.evaluate_variant(j, split, batch_size), variants,
                               [s[-1] for s in self.sets], lambda j: f"variant{j:02d}", "mean_variant_acc")

    def report(self, summary: dict) -> str:
        """Accuracy against MACs of every cached variant and the population accuracy (Fig. 3, Table 1)."""
        return variant_report(summary, self.cache.specs, self.cache.macs, self.cache.params, self.method)


class ServesCachedVariants:
    """What a method whose ``setup`` builds ``self.variants`` (a :class:`CachedVariants`) and
    ``self.accounting`` gets: evaluation, the end-of-run report, the run-folder files and the
    recalibrated subnets of post-hoc extraction, all FEAST's. List it before ``FedAvg``."""

    variants: CachedVariants
    accounting: dict

    def calibrated_subnet(self, spec) -> torch.nn.Module:
        """The plain subnet of ``spec``, BN recalibrated (post-hoc extraction scores it)."""
        return self.variants.calibrated_subnet(spec)

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        return self.variants.evaluate(split, batch_size)

    def report(self, summary: dict) -> str:
        return self.variants.report(summary)

    def artifacts(self) -> Dict[str, str]:
        """The cache the run trains (so a resumed or re-scored run uses the same one) and the
        population's accounting."""
        return {**self.variants.artifact(), "accounting.json": json.dumps(self.accounting, indent=2)}
