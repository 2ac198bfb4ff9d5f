"""FEAST's population, communication, computation and footprint accounting (Supp. C-E).

Everything here is a function of the client budgets, shard sizes, the variant cache and the
supernet; nothing trains. The same numbers are printed before a run and saved with it.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

import numpy as np

from fl_lightning.elastic.envelope import routed_param_count

KAPPA_FB = 3  # forward + backward convolution MACs ~ 3x forward (Eq. 26)
PAPER_ANCHORS = (25e6, 50e6, 229e6, 408e6, 596e6)  # Tables 9 and 10


def affordable_sets(cache, budgets: Sequence[float]) -> List[List[int]]:
    """A_i = {a in A : MAC(a) <= b_i} for every client (Eq. 3 / Supp. Eq. 11)."""
    return [cache.affordable(float(b)) for b in budgets]


def pass_macs_per_example(cache, affordable: Sequence[int], rule: str = "full") -> float:
    """Expected forward MACs one example costs a client per local step under a training rule
    (Eq. 25-26 with the random pass averaged uniformly over A_int)."""
    lo, hi = cache.global_min(), affordable[-1]
    m = cache.macs
    if rule == "min_only":
        return float(m[lo])
    if rule == "max_only":
        return float(m[hi])
    if hi == lo:
        return float(m[lo])
    total = float(m[lo] + m[hi])
    inter = [j for j in affordable if m[lo] < m[j] < m[hi]]
    if rule == "full" and inter:
        total += float(np.mean([m[j] for j in inter]))
    return total


def population_summary(cache, budgets: Sequence[float], sizes: Sequence[int], routed_params: Sequence[int],
                       bins: int = 8) -> Dict[str, object]:
    """Budget histogram, affordable-set sizes and routed parameters per client."""
    sets = affordable_sets(cache, budgets)
    counts = [len(s) for s in sets]
    edges = np.geomspace(max(min(budgets), 1.0), max(budgets), bins + 1)
    hist, _ = np.histogram(budgets, bins=edges)
    return {
        "clients": len(budgets),
        "budget_histogram": [{"from": float(a), "to": float(b), "clients": int(c)}
                             for a, b, c in zip(edges[:-1], edges[1:], hist)],
        "afford_1": sum(c == 1 for c in counts),
        "afford_2": sum(c == 2 for c in counts),
        "afford_3_or_more": sum(c >= 3 for c in counts),
        "afford_none": sum(c == 0 for c in counts),
        "routed_params": {"mean": float(np.mean(routed_params)), "median": float(np.median(routed_params)),
                          "min": int(min(routed_params)), "max": int(max(routed_params))},
        "shard_sizes": {"min": int(min(sizes)), "median": float(np.median(sizes)), "max": int(max(sizes))},
    }


def communication(full_params: int, routed_params: Sequence[int]) -> Dict[str, float]:
    """Supp. C, Eq. 16 and Table 2 over the whole population (uniform participation).

    Aggregate reduction is a ratio of sums, N P / sum_i P_i (the expectation of m P / sum_{i in S}
    P_i's numerator and denominator under uniform sampling); client reductions are P / P_i.
    """
    ratios = [full_params / p for p in routed_params]
    return {
        "full_params": full_params,
        "mean_routed_params": float(np.mean(routed_params)),
        "traffic_reduction": len(routed_params) * full_params / float(sum(routed_params)),
        "client_reduction_mean": float(np.mean(ratios)),
        "client_reduction_median": float(statistics.median(ratios)),
        "client_reduction_max": float(max(ratios)),
    }


def training_computation(cache, sets: Sequence[Sequence[int]], sizes: Sequence[int], rounds: int,
                         clients_per_round: int, epochs: int = 1, rule: str = "full") -> Dict[str, float]:
    """Expected federation totals of Eq. 26 (kappa = 3) for one local epoch (or ``epochs``) per
    participation, against the single-variant reference that trains only a_max_i (Table 7)."""
    participation = rounds * clients_per_round / len(sizes)
    feast = sum(n * pass_macs_per_example(cache, s, rule) for n, s in zip(sizes, sets))
    single = sum(n * cache.macs[s[-1]] for n, s in zip(sizes, sets))
    scale = KAPPA_FB * epochs * participation
    return {"feast_train_macs": feast * scale, "single_variant_train_macs": single * scale,
            "ratio": feast / single if single else float("nan")}


def parameter_footprints(model, cache, anchors: Sequence[float] = PAPER_ANCHORS) -> List[Dict[str, float]]:
    """Tables 9-10: at each anchor budget, the routed envelope's parameters against the
    deployed (largest affordable) variant's."""
    rows = []
    for budget in anchors:
        sets = cache.affordable(budget)
        if not sets:
            continue
        routed = routed_param_count(model, [cache.specs[j] for j in sets])
        params = cache.params[sets[-1]]
        rows.append({"budget": budget, "deployed_macs": cache.macs[sets[-1]], "deployed_params": params,
                     "routed_params": routed, "routed_over_deployed": routed / params})
    return rows


def client_routed_params(model, cache, sets: Sequence[Sequence[int]]) -> List[int]:
    """P_i for every client; clients with identical affordable sets share one count."""
    memo: Dict[tuple, int] = {}
    out = []
    for s in sets:
        key = tuple(s)
        if key not in memo:
            memo[key] = routed_param_count(model, [cache.specs[j] for j in s])
        out.append(memo[key])
    return out


def default_anchors(cache_macs: Sequence[int]) -> List[float]:
    """The paper's anchors when the cache spans them, else five points across the cache."""
    lo, hi = min(cache_macs), max(cache_macs)
    if lo <= PAPER_ANCHORS[0] * 1.05 and hi >= PAPER_ANCHORS[-1] * 0.95:
        return list(PAPER_ANCHORS)
    return [float(v) for v in np.quantile(np.asarray(cache_macs, dtype=float), [0, 0.25, 0.5, 0.75, 1])]


def human(value: float) -> str:
    """1.23M, 4.56G, 7.89P: MACs and parameter counts at a readable scale."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def format_accounting(summary: Dict[str, object], comm: Dict[str, float], compute: Dict[str, float],
                      footprints: Sequence[Dict[str, float]]) -> str:
    lines = ["Population:"]
    for row in summary["budget_histogram"]:
        lines.append(f"  budget {row['from'] / 1e6:8.1f}M - {row['to'] / 1e6:8.1f}M : {row['clients']:4d} clients")
    lines.append(f"  affordable variants: 1 -> {summary['afford_1']} clients, 2 -> {summary['afford_2']}, "
                 f">=3 -> {summary['afford_3_or_more']}")
    rp = summary["routed_params"]
    lines.append(f"  routed parameters per client: mean {rp['mean'] / 1e6:.2f}M, median {rp['median'] / 1e6:.2f}M, "
                 f"min {rp['min'] / 1e6:.2f}M, max {rp['max'] / 1e6:.2f}M")
    ss = summary["shard_sizes"]
    lines.append(f"  shard sizes: min {ss['min']}, median {ss['median']:.0f}, max {ss['max']}")
    lines.append(f"Communication (full supernet {comm['full_params'] / 1e6:.2f}M params): "
                 f"mean routed {comm['mean_routed_params'] / 1e6:.2f}M, traffic reduction "
                 f"{comm['traffic_reduction']:.1f}x, client reduction mean {comm['client_reduction_mean']:.1f}x / "
                 f"median {comm['client_reduction_median']:.1f}x / max {comm['client_reduction_max']:.1f}x")
    lines.append(f"Training computation (Eq. 26, kappa=3, expected over the run): FEAST "
                 f"{human(compute['feast_train_macs'])}MAC vs single-variant "
                 f"{human(compute['single_variant_train_macs'])}MAC (x{compute['ratio']:.2f})")
    if footprints:
        lines.append("Parameter footprints (routed envelope vs deployed variant):")
        for row in footprints:
            lines.append(f"  budget {row['budget'] / 1e6:7.1f}M: deployed {row['deployed_params'] / 1e6:7.2f}M params "
                         f"({row['deployed_macs'] / 1e6:.1f}M MACs), routed {row['routed_params'] / 1e6:7.2f}M "
                         f"(x{row['routed_over_deployed']:.2f})")
    return "\n".join(lines)
