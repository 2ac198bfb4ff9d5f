"""Client inference budgets and the gamma-allocation weights of FEAST.

Equation numbers refer to Supplementary Sec. A of the FEAST paper
(``papers/feast-federated-shared-space-training.txt``): Eq. 1-2 draw a Zipf rank per client
and map it to a jittered MAC budget, Eq. 3 turns capped budgets into expected data shares.
The end of the module finds run seeds whose population has the paper's published statistics
(:func:`search_population_seeds`, ``tools/population_seed_search.py``).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from fl_lightning.errors import ConfigError

B_MIN = 25e6
B_MAX = 1500e6
B_CAP = 600e6
ZIPF_S = 1.2


def seeded_rng(seed: int, purpose: str) -> np.random.Generator:
    """A numpy Generator that depends only on ``(seed, purpose)``.

    Mixing a purpose tag into the seed keeps the budget draw, the partition and the server
    splits statistically independent even when one run seed feeds all of them.
    """
    tag = zlib.crc32(purpose.encode("utf-8"))
    return np.random.default_rng(np.random.SeedSequence([int(seed) % 2**63, tag]))


class ZipfDraw(NamedTuple):
    """One population draw: the budgets and what produced them (for tests and reports)."""

    budgets: torch.Tensor  # float64 [N], MACs, after clipping
    ranks: torch.Tensor  # int64 [N], in 1..R
    jitter: torch.Tensor  # float64 [N], in [-dB/2, dB/2)
    delta_b: float  # level spacing dB


def zipf_rank_probabilities(num_levels: int, s: float = ZIPF_S) -> np.ndarray:
    """P(rank = r) = r^-s / sum_l l^-s for r = 1..R (Supp. A, Eq. 1)."""
    r = np.arange(1, num_levels + 1, dtype=np.float64)
    w = r ** (-float(s))
    return w / w.sum()


def _check_budget_params(num_clients, s, num_levels, b_min, b_max) -> int:
    if int(num_clients) < 1:
        raise ConfigError("partition.num_clients", f"must be >= 1, got {num_clients}")
    if not (math.isfinite(s) and s >= 0):
        raise ConfigError("budgets.s", f"Zipf exponent must be finite and >= 0, got {s}")
    levels = int(num_clients) if num_levels is None else int(num_levels)
    if levels < 1:
        raise ConfigError("budgets.num_levels", f"must be >= 1, got {num_levels}")
    if not (math.isfinite(b_min) and b_min > 0):
        raise ConfigError("budgets.b_min", f"must be finite and > 0, got {b_min}")
    if not (math.isfinite(b_max) and b_max >= b_min):
        raise ConfigError("budgets.b_max", f"must be finite and >= b_min={b_min}, got {b_max}")
    return levels


def zipf_draw(
    num_clients: int,
    seed: int,
    s: float = ZIPF_S,
    num_levels: Optional[int] = None,
    b_min: float = B_MIN,
    b_max: float = B_MAX,
) -> ZipfDraw:
    """Budgets with their ranks and jitter, exactly as Supp. A Eq. 1-2.

    Each client draws a rank r_i ~ P(r) ∝ r^-s over 1..R (R = N unless ``num_levels`` says
    otherwise; ranks are levels, several clients may share one), then
    b_i = clip(b_min + (r_i - 1) ΔB + ε_i; b_min, b_max) with ε_i ~ U(-ΔB/2, ΔB/2) and
    ΔB = (b_max - b_min) / (R - 1). With R = 1 there is one level, ΔB = 0, every budget is b_min.
    All ranks are drawn first, then all jitters, from one generator seeded by ``seed``.
    """
    levels = _check_budget_params(num_clients, s, num_levels, b_min, b_max)
    n = int(num_clients)
    delta_b = (b_max - b_min) / (levels - 1) if levels > 1 else 0.0
    rng = seeded_rng(seed, "budgets")
    ranks = rng.choice(levels, size=n, p=zipf_rank_probabilities(levels, s)) + 1
    jitter = rng.uniform(-delta_b / 2, delta_b / 2, size=n) if delta_b > 0 else np.zeros(n)
    budgets = np.clip(b_min + (ranks - 1) * delta_b + jitter, b_min, b_max)
    return ZipfDraw(
        budgets=torch.from_numpy(budgets.astype(np.float64)),
        ranks=torch.from_numpy(ranks.astype(np.int64)),
        jitter=torch.from_numpy(jitter.astype(np.float64)),
        delta_b=float(delta_b),
    )


def zipf_budgets(
    num_clients: int,
    seed: int,
    s: float = ZIPF_S,
    num_levels: Optional[int] = None,
    b_min: float = B_MIN,
    b_max: float = B_MAX,
) -> torch.Tensor:
    """Per-client inference budgets in MACs, a float64 tensor [N] (Supp. A, Eq. 1-2).

    Deterministic in ``seed``; see :func:`zipf_draw` for the procedure and the ranks.
    """
    return zipf_draw(num_clients, seed, s=s, num_levels=num_levels, b_min=b_min, b_max=b_max).budgets


def allocation_weights(
    budgets: Union[torch.Tensor, Sequence[float], np.ndarray], gamma: float, b_cap: float = B_CAP
) -> torch.Tensor:
    """Expected data shares q_i(γ) = min(b_i, B_cap)^γ / Σ_j min(b_j, B_cap)^γ (Eq. 3).

    γ = 0 gives exactly 1/N, γ = 1 shares proportional to capped budgets. Computed as a
    softmax of γ·log(b_alloc) so that large γ does not overflow. Returns float64 [N], sum 1.
    """
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ConfigError("partition.gamma", f"must be finite and >= 0, got {gamma}")
    if not (math.isfinite(b_cap) and b_cap > 0):
        raise ConfigError("partition.b_cap", f"must be finite and > 0, got {b_cap}")
    b = torch.as_tensor(budgets, dtype=torch.float64).reshape(-1)
    if b.numel() == 0:
        raise ConfigError("partition.budgets", "no budgets given")
    if not bool(torch.isfinite(b).all()) or bool((b <= 0).any()):
        raise ConfigError("partition.budgets", "every budget must be finite and > 0")
    log_alloc = torch.log(torch.clamp(b, max=b_cap))
    return torch.softmax(gamma * log_alloc, dim=0)


# ----------------------------------------------------------------------------- population seeds


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
    from fl_lightning.data.partition import alpha_data_for, make_partition  # partition imports this module

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


__all__ = [
    "B_CAP",
    "B_MAX",
    "B_MIN",
    "PAPER_CIFAR100_POPULATION",
    "PopulationTarget",
    "SeedMatch",
    "ZIPF_S",
    "ZipfDraw",
    "afford_counts",
    "allocation_weights",
    "budget_statistics",
    "population_shard_sizes",
    "search_population_seeds",
    "seeded_rng",
    "zipf_budgets",
    "zipf_draw",
    "zipf_rank_probabilities",
]
