"""The search of post-hoc extraction (FEAST Supp. E.3), set up from the variant cache it serves.

The paper extracts with "the training-free objective in Eq. (10)" and "the cache-construction
thresholds", so everything but the search size comes from the cache's own provenance
(``cache.search`` and each variant's ``target`` and ``rho_limit``, written by
:func:`~fl_lightning.elastic.search.cache.build_cache`):

- **ceiling** ``rho_0``: each segment of the cache's search applies from the cheapest variant it
  built (its stored ``target`` and ``rho_limit`` name the segment) up to where the next segment
  starts; below every segment the cheapest one's. On the paper's cache this is the published
  rule, 0.40 below 50M and 0.31 above (its main segment's first variant has 49.65M MACs); on a
  scaled-down cache it is that cache's ceilings (the quick start's 0.25 from its 0.49M variant
  on), not the paper's absolute 50M boundary. A cache without provenance gets the paper's rule;
- **objective and operators**: the cache's fitness terms, mutation rate, tournament, elitism and
  seed;
- **the cache's own answers**: at a budget between a cached variant's MACs and the target it
  was searched for (under the same ceiling) the cache has already run this search on a looser
  problem, and the variant is returned without searching again (:func:`cached_answer`);
- **start**: elsewhere the cached variants join the initial population where they fit the
  budget and the ceiling, so the result is never less fit than a trained variant it could have
  returned (and the search finds a feasible architecture wherever a cached variant is one);
- **space** (a documented deviation, ``space="trained"`` by default): each gene searched within
  the range the cached variants span. The fitness of a narrowed supernet favours a stem
  narrower than any variant FEAST trained (docs/results/feast.md); ``"full"`` searches
  the whole space, as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from fl_lightning.elastic.models.ofa_resnet import OFASpec
from fl_lightning.elastic.search.cost import cost_model
from fl_lightning.elastic.search.fitness import Fitness, FitnessConfig
from fl_lightning.elastic.search.genetic import SearchResult, search
from fl_lightning.feast_protocol import SEARCH_MUTATION, extraction_rho

SPACES = ("trained", "full")


@dataclass(frozen=True)
class ExtractionSearch:
    """The settings of one extraction search (what :func:`extraction_search` derived)."""

    rho_limit: float
    seed: int
    space: str
    fitness: FitnessConfig = FitnessConfig()
    mutation: float = SEARCH_MUTATION
    tournament: int = 3
    elitism: int = 1
    start: tuple = field(default=(), repr=False)
    """Cached variants offered to the initial population."""
    reuse_cache: bool = True
    """The cache answers at its own budgets and ``start`` seeds the search; false: the search as
    Supp. E.3 states it, from random architectures only."""


def segment_starts(cache) -> list[tuple[float, float]]:
    """``(first MACs, rho_0)`` of each segment of the cache's search, cheapest first: the MACs
    of the cheapest variant the segment built (its nominal lowest target when none of its
    variants is in the cache, e.g. all were found first by another segment)."""
    starts = []
    for low, high, _, rho in (cache.search or {}).get("segments", ()):
        built = [v.macs for v in cache.variants
                 if v.info.get("rho_limit") == rho and low - 0.5 <= v.info.get("target", -1) <= high + 0.5]
        starts.append((float(min(built)) if built else float(low), float(rho)))
    return sorted(starts, key=lambda s: s[0])


def cache_ceiling(cache, budget: float) -> float:
    """``rho_0`` of the segment that applies at ``budget`` (module docstring)."""
    starts = segment_starts(cache)
    if not starts:
        return extraction_rho(budget)
    below = [rho for start, rho in starts if start <= budget]
    return below[-1] if below else starts[0][1]


def extraction_search(cache, budget: float, rho: Optional[float] = None, seed: Optional[int] = None,
                      space: str = "trained", reuse_cache: bool = True) -> ExtractionSearch:
    """The extraction settings at ``budget`` from ``cache``; ``rho`` and ``seed`` override the
    derived ceiling and seed."""
    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}, got {space!r}")
    provenance = cache.search or {}
    fitness = provenance.get("fitness")
    return ExtractionSearch(
        rho_limit=float(cache_ceiling(cache, budget) if rho is None else rho),
        seed=int(provenance.get("seed", 0) if seed is None else seed),
        space=space,
        fitness=FitnessConfig(**fitness) if fitness else FitnessConfig(),
        mutation=float(provenance.get("mutation", SEARCH_MUTATION)),
        tournament=int(provenance.get("tournament", 3)),
        elitism=int(provenance.get("elitism", 1)),
        start=tuple(cache.specs) if reuse_cache else (),
        reuse_cache=reuse_cache,
    )


def trained_bounds(cost, specs: Sequence[OFASpec]) -> tuple[np.ndarray, np.ndarray]:
    """Gene-wise smallest and largest value over ``specs`` (the range FEAST trained)."""
    genes = cost.encode_many(specs)
    return genes.min(axis=0), genes.max(axis=0)


def cached_answer(cache, budget: float, rho_limit: float) -> Optional[int]:
    """The cached variant that already answers the search at ``budget``, if one does: the
    largest variant within the budget whose own search had a target of at least ``budget`` and
    the same ceiling. Every architecture feasible at ``budget`` was feasible at that target,
    where the cache's search chose this variant."""
    index = cache.largest_affordable(budget)
    if index is None:
        return None
    info = cache.variants[index].info
    if info.get("target", -1) >= budget and info.get("rho_limit") == rho_limit:
        return index
    return None


def extraction_architecture(model, cache, budget: float, settings: ExtractionSearch, population: int,
                            generations: int) -> tuple[SearchResult, Optional[int]]:
    """The architecture extracted at ``budget`` and the index of the cached variant it is when
    the cache answers the budget (:func:`cached_answer`; no search then). Raises
    ``InfeasibleError`` when the search finds nothing."""
    cost = cost_model(model, cache.input_shape)
    index = cached_answer(cache, budget, settings.rho_limit) if settings.reuse_cache else None
    if index is not None:
        spec = cache.specs[index]
        fitness = Fitness(cost, settings.fitness).spec_fitness(spec)
        return SearchResult(spec, cache.macs[index], fitness), index
    bounds = trained_bounds(cost, cache.specs) if settings.space == "trained" else None
    found = search(cost, budget, settings.rho_limit, population, generations, settings.mutation,
                   settings.tournament, settings.elitism, settings.seed, fitness=settings.fitness,
                   start=settings.start, bounds=bounds)
    return found, None


def arch_genes(arch) -> list:
    """``(d, e, w)`` of an ``OFASpec`` or of a mapping with those keys (a cache file's variant,
    the result ``extract`` prints), as one list of genes by position."""
    if isinstance(arch, OFASpec):
        return [*arch.d, *arch.e, *arch.w]
    return [*arch["d"], *arch["e"], *arch["w"]]


def gene_distance(arch, other) -> int:
    """Genes (depths, expansions, widths, position by position) in which two architectures
    differ."""
    a, b = arch_genes(arch), arch_genes(other)
    if len(a) != len(b):
        raise ValueError(f"architectures of different spaces: {a} and {b}")
    return sum(float(x) != float(y) for x, y in zip(a, b))


def nearest_distance(arch, cached: Sequence) -> int:
    """Genes from ``arch`` to the nearest of the ``cached`` architectures."""
    return min(gene_distance(arch, other) for other in cached)
