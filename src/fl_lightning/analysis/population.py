"""Run seeds whose FEAST population has the paper's published statistics.

A run's seed draws the client budgets (Supp. A, Eq. 1-2, ``data/budgets.py``) and the
gamma-Dirichlet partition (Eq. 4-8, ``data/partition.py``). :func:`search_population_seeds`
draws both as a run does, for many seeds, and keeps those that reproduce the published
counts (``tools/population_seed_search.py``; the seed chosen is in docs/feast.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from fl_lightning.data.budgets import B_CAP, B_MAX, B_MIN, ZIPF_S, zipf_budgets
from fl_lightning.data.partition import alpha_data_for, make_partition


@dataclass(frozen=True)
class PopulationTarget:
    """Published statistics of a client population, the ones a seed is chosen to reproduce.

    The defaults are FEAST's CIFAR-100 population (100 clients, Zipf(1.2) budgets in
    [25M, 1500M], gamma = 1, alpha_eff = 0.45 over 45,000 client examples):

    - ``afford``: clients affording exactly 1, exactly 2 and 3 or more cached variants (Supp.
      E.4: "31 use one variant per mini-batch, six use two, and 63 use three");
    - ``below``: clients whose budget is below ``below_macs`` (Supp. E.1: 32 clients have
      budgets below ScaleFL's "approximately 35M-MAC minimum");
    - ``shard_min`` / ``shard_max``: the smallest and largest shard (Supp. F.5: 36 <= n_i <= 1906);
    - ``least_reachable``: clients routing the least-reachable position (Supp. F.5: R_min = 11);
      it depends on the cache's architectures too, so it only breaks ties.
    """

    afford: tuple[int, int, int] = (31, 6, 63)
    below: int = 32
    below_macs: float = 35e6
    shard_min: int = 36
    shard_max: int = 1906
    least_reachable: int = 11


PAPER_CIFAR100_POPULATION = PopulationTarget()


def afford_counts(budgets, cache_macs: Sequence[float]) -> tuple[int, int, int, int]:
    """Clients affording exactly 1, exactly 2, 3 or more, and no cached variant
    (``|A_i| = #{a : MAC(a) <= b_i}``, Supp. Eq. 11); ``cache_macs`` in any order."""
    macs = np.sort(np.asarray(cache_macs, dtype=np.float64))
    b = np.asarray(torch.as_tensor(budgets, dtype=torch.float64)).reshape(-1)
    sizes = np.searchsorted(macs, b, side="right")
    return (int((sizes == 1).sum()), int((sizes == 2).sum()), int((sizes >= 3).sum()), int((sizes == 0).sum()))


def budget_statistics(budgets, cache_macs: Sequence[float], below_macs: float = 35e6) -> dict:
    """The budget-only statistics of :class:`PopulationTarget` for one population."""
    one, two, more, none = afford_counts(budgets, cache_macs)
    b = np.asarray(torch.as_tensor(budgets, dtype=torch.float64)).reshape(-1)
    return {"afford": (one, two, more), "afford_none": none, "below": int((b < below_macs).sum())}


def population_shard_sizes(seed: int, budgets, class_sizes: Sequence[int], alpha_eff: float = 0.45,
                           gamma: float = 1.0, b_cap: float = B_CAP, min_size: int = 10) -> np.ndarray:
    """Shard sizes of the gamma-Dirichlet partition a run with ``seed`` draws (Supp. A, Eq. 4-8),
    computed from the client pool's class sizes alone.

    The partition shuffles each class before splitting it, so the sizes depend on the class
    sizes and the seed, not on which examples carry which label: for CIFAR-100 after the
    stratified 4,500 / 500 server split the pool has 450 examples of each class, and these sizes
    are the real run's (``data.federated.build_federated_data``).
    """
    class_sizes = [int(n) for n in class_sizes]
    labels = torch.from_numpy(np.repeat(np.arange(len(class_sizes)), class_sizes))
    n = len(labels)
    alpha = alpha_data_for(alpha_eff, n, len(class_sizes), len(budgets))
    shards = make_partition("gamma_dirichlet", labels, len(budgets), seed, alpha=alpha, gamma=gamma,
                            budgets=budgets, min_size=min_size, b_cap=b_cap)
    return np.array([len(s) for s in shards], dtype=np.int64)


class SeedMatch(NamedTuple):
    """A seed whose budgets give the target's budget statistics, with its shard range."""

    seed: int
    afford: tuple[int, int, int]
    below: int
    shard_min: int
    shard_max: int
    least_reachable: Optional[int] = None

    def distance(self, target: PopulationTarget) -> float:
        """Relative distance of the shard range from the target's (0: both ends equal)."""
        return (abs(self.shard_min - target.shard_min) / target.shard_min
                + abs(self.shard_max - target.shard_max) / target.shard_max)

    def rank(self, target: PopulationTarget) -> tuple:
        """Sort key: shard-range distance, then distance of ``least_reachable`` (when known),
        then the seed."""
        reach = abs(self.least_reachable - target.least_reachable) if self.least_reachable is not None else 0
        return (round(self.distance(target), 12), reach, self.seed)


def search_population_seeds(cache_macs: Sequence[float], seeds, target: PopulationTarget = PAPER_CIFAR100_POPULATION,
                            num_clients: int = 100, class_sizes: Sequence[int] = (450,) * 100,
                            s: float = ZIPF_S, b_min: float = B_MIN, b_max: float = B_MAX, b_cap: float = B_CAP,
                            alpha_eff: float = 0.45, gamma: float = 1.0, min_size: int = 10,
                            stop_after_exact: Optional[int] = None,
                            least_reachable=None) -> list[SeedMatch]:
    """Run seeds whose population reproduces ``target``.

    For each seed in ``seeds`` (in order) the budgets are drawn exactly as a run draws them
    (:func:`zipf_budgets`); seeds whose affordable-set counts and below-threshold count equal
    the target's get their partition drawn (:func:`population_shard_sizes`). Returns those
    seeds ordered by :meth:`SeedMatch.rank`: closest shard range first, then (if
    ``least_reachable``, a function of the budgets, is given) closest ``R_min``, then smaller
    seed. ``stop_after_exact`` ends the scan once that many seeds match the budget statistics
    and the shard range exactly.
    """
    found: list[SeedMatch] = []
    exact = 0
    for seed in seeds:
        budgets = zipf_budgets(num_clients, int(seed), s=s, b_min=b_min, b_max=b_max)
        stats = budget_statistics(budgets, cache_macs, target.below_macs)
        if stats["afford"] != tuple(target.afford) or stats["below"] != target.below or stats["afford_none"]:
            continue
        sizes = population_shard_sizes(int(seed), budgets, class_sizes, alpha_eff, gamma, b_cap, min_size)
        reach = None if least_reachable is None else int(least_reachable(budgets.tolist()))
        match = SeedMatch(int(seed), stats["afford"], stats["below"], int(sizes.min()), int(sizes.max()), reach)
        found.append(match)
        if match.distance(target) == 0:
            exact += 1
            if stop_after_exact is not None and exact >= stop_after_exact:
                break
    return sorted(found, key=lambda m: m.rank(target))
