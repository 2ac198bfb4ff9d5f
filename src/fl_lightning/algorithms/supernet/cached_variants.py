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

import numpy as np
import torch

from fl_lightning.algorithms.level_report import variant_report
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CACHE_SEGMENTS, SEARCH_GENERATIONS, SEARCH_MUTATION, SEARCH_POPULATION
from fl_lightning.option_types import ClosedUnitInterval, FiniteFloat, NonNegativeInt, PositiveInt, number_type
from fl_lightning.runtime.calibration import ServerCalibration
from fl_lightning.runtime.evaluation import evaluate, evaluate_levels
from fl_lightning.units import count, macs as macs_text


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


def check_population_reaches(cache: Optional[str], retarget: bool, search: CacheSearch, population) -> None:
    """Before any rank starts: with a cache file (its MACs as stored, not retargeted), refuse a
    client whose budget affords none of its variants; without one, a search the supernet or the
    poorest client cannot answer (:func:`check_search_reaches`)."""
    from fl_lightning.elastic.search.cache import VariantCache
    from fl_lightning.elastic.search.cost import cost_model

    if population is None or population.budgets is None or retarget:
        return
    budgets = population.budgets.tolist()
    if cache is None:
        check_search_reaches(search, cost_model(population.model, population.input_shape), min(budgets))
        return
    smallest = min(VariantCache.load(cache).macs)
    poorest = min(range(len(budgets)), key=budgets.__getitem__)
    if budgets[poorest] < smallest:  # the population accuracy serves every client a cached variant
        raise ConfigError("partition.budgets.b_min", f"client {poorest}'s budget {macs_text(budgets[poorest])} "
                                                     f"affords no cached variant (smallest: {macs_text(smallest)})")


def check_search_reaches(search: CacheSearch, cost, poorest_budget: float) -> None:
    """Refuse, before the search, segments the supernet cannot answer and a cache that would not
    reach the poorest client: a segment wholly below the smallest subnet's MACs or wholly above
    the largest's, a smallest client budget below the smallest subnet, and a lowest target above
    the smallest budget (a target's variant costs at most the target and, searched for fitness,
    about as much, so every client affords the cheapest variant when the lowest target is within
    the smallest budget; FEAST's low-compute segment reaches down to ``b_min`` for this reason).
    ``cost`` is the supernet's cost model (min and max MACs in the cache's convention)."""
    from fl_lightning.elastic.search.cache import segment_targets

    # the genome of zeros is the smallest subnet (base blocks, narrowest choices), the gene maxima the largest
    smallest = float(cost.macs(np.zeros((1, cost.num_genes), dtype=np.int64))[0])
    largest = float(cost.macs(np.asarray(cost.upper, dtype=np.int64)[None])[0])
    span = f"the supernet's subnets cost {count(smallest)} to {macs_text(largest)}"
    targets = [segment_targets(low, high, int(number)) for low, high, number, _ in search.segments]
    for i, searched in enumerate(targets):
        if max(searched) < smallest or min(searched) > largest:
            what = f"target {macs_text(searched[0])} lies" if len(set(searched)) == 1 else \
                f"targets {count(min(searched))} to {macs_text(max(searched))} lie"
            raise ConfigError(f"algorithm.search.segments[{i}]", f"its {what} beyond the supernet: {span}")
    if poorest_budget < smallest:
        raise ConfigError("partition.budgets.b_min",
                          f"the smallest client budget, {macs_text(poorest_budget)}, affords no subnet: {span}")
    lowest = min(min(searched) for searched in targets)
    if lowest > poorest_budget:
        raise ConfigError("algorithm.search.segments",
                          f"the lowest target, {macs_text(lowest)}, is above the smallest client budget "
                          f"{macs_text(poorest_budget)} (partition.budgets.b_min), so the cheapest cached "
                          f"variant would not fit that client; add a segment reaching down to it")


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
    (indices, cheapest first) and the variant each client is served (its largest affordable):
    the part a method that serves a supernet's variant cache as FEAST does composes (FEAST, the
    SuperFedNAS / DeepFedNAS transfers). It scores the variants (``evaluate``), writes the
    end-of-run report, names the served variants by their MACs for the logs and writes the run
    folder's files (the cache and the population's ``accounting``, which the method gives it)."""

    def __init__(self, ctx, cache: Optional[str], retarget: bool, search: CacheSearch, calib_batch_size: int,
                 calib_transform: str, method: str, required_by: str):
        """``method`` names the algorithm in the report; ``required_by`` says, when the run holds
        no calibration split, what needs one."""
        from fl_lightning.algorithms.supernet.feast_accounting import affordable_sets

        self.ctx, self.method = ctx, method
        self.calibration = ServerCalibration(ctx, calib_batch_size, calib_transform,
                                             required_by=required_by)
        self.input_shape = tuple(ctx.data.bundle.input_shape)
        budgets = [float(b) for b in ctx.budgets.tolist()]
        self.cache = self._load_or_build(cache, retarget, search, budgets)
        self.sets = affordable_sets(self.cache, budgets)
        for client, s in enumerate(self.sets):
            if not s:  # the population accuracy serves every client a cached variant
                raise ConfigError("partition.budgets.b_min",
                                  f"client {client}'s budget {macs_text(budgets[client])} affords no "
                                  f"cached variant (smallest: {macs_text(self.cache.macs[0])})")
        self.served = sorted({s[-1] for s in self.sets})
        self.accounting: Dict[str, object] = {}
        """The population's accounting (``feast_accounting``), written with the cache."""

    def _load_or_build(self, path: Optional[str], retarget: bool, search: CacheSearch, budgets: List[float]):
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

    def artifacts(self) -> Dict[str, str]:
        """``cache.json`` (the cache the run trains, so a resumed or re-scored run uses the same
        one) and ``accounting.json`` (the population's accounting)."""
        return {"cache.json": json.dumps(self.cache.to_dict(), indent=2),
                "accounting.json": json.dumps(self.accounting, indent=2)}

    def served_names(self) -> Dict[str, str]:
        """Each cached variant's figure named by its MACs, for the logs."""
        return {f"variant{j:02d}_acc": f"variant{j:02d} {macs_text(m)}" for j, m in enumerate(self.cache.macs)}

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

