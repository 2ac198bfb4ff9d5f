"""Client inference budgets and the gamma-allocation weights of FEAST.

Equation numbers refer to Supplementary Sec. A of the FEAST paper
(``papers/feast-federated-shared-space-training.txt``): Eq. 1-2 draw a Zipf rank per client
and map it to a jittered MAC budget, Eq. 3 turns capped budgets into expected data shares.
Run seeds whose population has the paper's published statistics are found by
``analysis/population.py`` (``tools/population_seed_search.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from fl_lightning.errors import ConfigError
from fl_lightning.seeds import seeded_rng

B_MIN = 25e6
B_MAX = 1500e6
B_CAP = 600e6
ZIPF_S = 1.2


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


__all__ = [
    "B_CAP",
    "B_MAX",
    "B_MIN",
    "ZIPF_S",
    "ZipfDraw",
    "allocation_weights",
    "zipf_budgets",
    "zipf_draw",
    "zipf_rank_probabilities",
]
