"""FEAST's population, communication, computation and footprint accounting (Supp. C-E).

Everything here is a function of the client budgets, shard sizes, the variant cache and the
supernet; nothing trains. The same numbers are printed before a run and saved with it.

Routed and deployed parameter counts come from the model (:func:`client_routed_params`,
:func:`parameter_footprints`) or, for a space known only analytically (the DeepFedNAS
construction before its module exists), from its cost model (:func:`analytic_routed_counter`,
:func:`analytic_footprints`). :func:`seed_accounting` repeats the communication accounting
over many population seeds (mean +- std); :data:`PAPER` holds the published figures.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from fl_lightning.elastic.envelope import routed_param_count

from fl_lightning.feast_protocol import KAPPA_FB
from fl_lightning.units import count, fixed, macs as macs_text

PAPER_ANCHORS = (25e6, 50e6, 229e6, 408e6, 596e6)  # Tables 9 and 10

PAPER = {
    "full_params": 55.68e6,
    "mean_routed_params": 8.17e6,  # Table 2
    "traffic_reduction": 6.8,
    "client_reduction_mean": 43.8,
    "client_reduction_median": 22.9,
    "client_reduction_max": 111.0,
    "deployed_params": dict(zip(PAPER_ANCHORS, (0.33e6, 0.72e6, 4.02e6, 7.99e6, 11.78e6))),  # Table 10
    "routed_params": dict(zip(PAPER_ANCHORS, (0.50e6, 2.41e6, 10.02e6, 20.61e6, 35.60e6))),  # Table 9
    "afford": (31, 6, 63),  # Supp. E.4
    "least_reachable_clients": 11,  # Supp. F.5, R_min
    "cache_span": (24.96e6, 595.67e6),  # Table 1
}
"""FEAST's published CIFAR-100 accounting (units: parameters, MACs, ratios)."""


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
                         clients_per_round: int, epochs: int = 1, rule: str = "full",
                         kappa: float = KAPPA_FB) -> Dict[str, float]:
    """Expected federation totals of Eq. 26 (forward MACs times ``kappa``) for one local epoch
    (or ``epochs``) per participation, against the single-variant reference that trains only
    a_max_i (Table 7)."""
    participation = rounds * clients_per_round / len(sizes)
    feast = sum(n * pass_macs_per_example(cache, s, rule) for n, s in zip(sizes, sets))
    single = sum(n * cache.macs[s[-1]] for n, s in zip(sizes, sets))
    scale = kappa * epochs * participation
    return {"feast_train_macs": feast * scale, "single_variant_train_macs": single * scale,
            "ratio": feast / single if single else float("nan"), "kappa": kappa}


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


def analytic_routed_counter(cost, cache) -> Callable[[Sequence[int]], int]:
    """``P(A)`` for sets of cache indices from a cost model (no module): the parameters of the
    routed envelope (Supp. Eq. 12: coordinate-wise maximum depth and width, the largest
    expansion in every stage; as ``envelope.routed_param_count`` builds it). Memoized."""
    genes = cost.encode_many(cache.specs)
    memo: Dict[tuple, int] = {}

    def count(indices: Sequence[int]) -> int:
        key = tuple(indices)
        if key not in memo:
            memo[key] = int(cost.params(cost.envelope(genes[list(key)]))[0])
        return memo[key]

    return count


def model_routed_counter(model, cache) -> Callable[[Sequence[int]], int]:
    """``P(A)`` for sets of cache indices from the supernet itself (memoized)."""
    memo: Dict[tuple, int] = {}

    def count(indices: Sequence[int]) -> int:
        key = tuple(indices)
        if key not in memo:
            memo[key] = routed_param_count(model, [cache.specs[j] for j in key])
        return memo[key]

    return count


def analytic_footprints(cost, cache, anchors: Sequence[float] = PAPER_ANCHORS) -> List[Dict[str, float]]:
    """:func:`parameter_footprints` from a cost model (deployed variant and routed envelope)."""
    routed = analytic_routed_counter(cost, cache)
    rows = []
    for budget in anchors:
        sets = cache.affordable(budget)
        if not sets:
            continue
        params = cache.params[sets[-1]]
        rows.append({"budget": budget, "deployed_macs": cache.macs[sets[-1]], "deployed_params": params,
                     "routed_params": routed(sets), "routed_over_deployed": routed(sets) / params})
    return rows


def least_reachable_clients(cache, budgets: Sequence[float], genes: np.ndarray, num_stages: int) -> int:
    """``R_min`` (Supp. F.5): how many clients route the least-reachable position. A position
    at depth or width value ``v`` of a coordinate is routed to the clients whose envelope
    reaches ``v``; the scarcest are at each coordinate's largest cached value, reached by the
    clients affording the cheapest variant that has it. ``genes``: the cache's genomes in cache
    order (``d`` in the first ``num_stages`` columns, ``w`` in the last ``num_stages + 1``)."""
    genes = np.atleast_2d(genes)
    coords = np.concatenate([genes[:, :num_stages], genes[:, -(num_stages + 1):]], axis=1)
    macs = np.asarray(cache.macs, dtype=np.float64)
    b = np.asarray(budgets, dtype=np.float64)
    reach = []
    for c in range(coords.shape[1]):
        first = int(np.flatnonzero(coords[:, c] == coords[:, c].max())[0])
        reach.append(int((b >= macs[first]).sum()))
    return min(reach)


def seed_accounting(cache, routed: Callable[[Sequence[int]], int], full_params: int, seeds: Iterable[int],
                    num_clients: int = 100, zipf_s: float = 1.2, b_min: float = 25e6,
                    b_max: float = 1500e6) -> Dict[str, object]:
    """Communication accounting over many population seeds (budgets drawn as a run draws
    them; the cache and supernet fixed): per seed the mean routed parameters and the aggregate
    traffic reduction ``N P / sum_i P_i``; returns both lists and their mean and std."""
    from fl_lightning.data.budgets import zipf_budgets

    means, reductions, seeds_used = [], [], []
    for seed in seeds:
        budgets = zipf_budgets(num_clients, int(seed), s=zipf_s, b_min=b_min, b_max=b_max).tolist()
        p = [routed(cache.affordable(b)) for b in budgets]
        means.append(float(np.mean(p)))
        reductions.append(communication(full_params, p)["traffic_reduction"])
        seeds_used.append(int(seed))
    stats = lambda v: {"mean": float(np.mean(v)), "std": float(np.std(v)), "min": float(np.min(v)),  # noqa: E731
                       "max": float(np.max(v))}
    return {"seeds": seeds_used, "mean_routed_params": means, "traffic_reduction": reductions,
            "mean_routed_params_stats": stats(means), "traffic_reduction_stats": stats(reductions)}


def format_paper_comparison(comm: Dict[str, float], footprints: Sequence[Dict[str, float]],
                            over_seeds: Optional[Dict[str, object]] = None,
                            afford: Optional[Sequence[int]] = None,
                            least_reachable: Optional[int] = None) -> str:
    """The accounting next to the paper's figures (:data:`PAPER`)."""
    lines = [f"{'':40} {'here':>14} {'paper':>9}"]
    row = lambda name, here, paper: lines.append(f"{name:40} {here:>14} {paper:>9}")  # noqa: E731
    if afford is not None:
        row("clients affording 1 / 2 / >=3", "/".join(map(str, afford)), "/".join(map(str, PAPER["afford"])))
    if least_reachable is not None:
        row("least-reachable position: clients", str(least_reachable), str(PAPER["least_reachable_clients"]))
    row("full supernet parameters", f"{comm['full_params'] / 1e6:.2f}M", f"{PAPER['full_params'] / 1e6:.2f}M")
    row("mean routed parameters", f"{comm['mean_routed_params'] / 1e6:.2f}M",
        f"{PAPER['mean_routed_params'] / 1e6:.2f}M")
    row("traffic reduction", f"{comm['traffic_reduction']:.1f}x", f"{PAPER['traffic_reduction']:.1f}x")
    for key, name in (("client_reduction_mean", "client reduction mean"),
                      ("client_reduction_median", "client reduction median"),
                      ("client_reduction_max", "client reduction max")):
        row(name, f"{comm[key]:.1f}x", f"{PAPER[key]:.1f}x")
    if over_seeds is not None:
        m, t = over_seeds["mean_routed_params_stats"], over_seeds["traffic_reduction_stats"]
        n = len(over_seeds["seeds"])
        row(f"mean routed parameters, {n} seeds", f"{m['mean'] / 1e6:.2f}+-{m['std'] / 1e6:.2f}M",
            f"{PAPER['mean_routed_params'] / 1e6:.2f}M")
        row(f"traffic reduction, {n} seeds", f"{t['mean']:.2f}+-{t['std']:.2f}x", f"{PAPER['traffic_reduction']:.1f}x")
    for r in footprints:
        budget = r["budget"]
        deployed, routed = PAPER["deployed_params"].get(budget), PAPER["routed_params"].get(budget)
        paper = f"{deployed / 1e6:.2f}/{routed / 1e6:.2f}M" if deployed is not None else "-"
        row(f"deployed/routed params at {budget / 1e6:g}M MACs",
            f"{r['deployed_params'] / 1e6:.2f}/{r['routed_params'] / 1e6:.2f}M", paper)
    return "\n".join(lines)


SPAN_TOLERANCE = 0.05
"""A cache spans the paper's anchors when its cheapest point is within 5% above 25M and its
largest within 5% below 596M."""


def spans_paper(lo: float, hi: float, anchors: Sequence[float] = PAPER_ANCHORS) -> bool:
    return lo <= anchors[0] * (1 + SPAN_TOLERANCE) and hi >= anchors[-1] * (1 - SPAN_TOLERANCE)


def scaled_anchors(lo: float, hi: float, anchors: Sequence[float] = PAPER_ANCHORS) -> List[float]:
    """The paper's anchors (25, 50, 229, 408, 596M) where the FEAST cache spans them; for a
    CPU-sized cache spanning ``[lo, hi]`` instead, each anchor keeps its relative position in
    log MACs between the first and last: ``a' = lo (hi / lo)^t`` with ``t = log(a / 25M) /
    log(596M / 25M)``, so 25M maps to ``lo`` and 596M to ``hi``."""
    if spans_paper(lo, hi, anchors):
        return list(anchors)
    first, last = anchors[0], anchors[-1]
    return [lo * (hi / lo) ** (math.log(a / first) / math.log(last / first)) for a in anchors]


human = fixed
"""1.23M, 4.56G, 7.89P: MACs and parameter counts in tables (two decimals)."""


def default_anchors(cache_macs: Sequence[float]) -> List[float]:
    """The anchors every table and footprint uses unless given: the paper's, scaled to the
    span of ``cache_macs`` when it does not reach them (``scaled_anchors``)."""
    return scaled_anchors(float(min(cache_macs)), float(max(cache_macs)))


def format_accounting(summary: Dict[str, object], comm: Dict[str, float], compute: Dict[str, float],
                      footprints: Sequence[Dict[str, float]]) -> str:
    lines = ["Population:"]
    for row in summary["budget_histogram"]:
        lines.append(f"  budget {count(row['from']):>6} - {count(row['to']):>6} : {row['clients']:4d} clients")
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
    lines.append(f"Training computation (Eq. 26, kappa={compute.get('kappa', KAPPA_FB):g}, expected over the run): FEAST "
                 f"{fixed(compute['feast_train_macs'])}MAC vs single-variant "
                 f"{fixed(compute['single_variant_train_macs'])}MAC (x{compute['ratio']:.2f})")
    if footprints:
        lines.append("Parameter footprints (routed envelope vs deployed variant):")
        for row in footprints:
            lines.append(f"  budget {count(row['budget']):>6}: deployed {row['deployed_params'] / 1e6:7.2f}M params "
                         f"({macs_text(row['deployed_macs'])}), routed {row['routed_params'] / 1e6:7.2f}M "
                         f"(x{row['routed_over_deployed']:.2f})")
    return "\n".join(lines)
