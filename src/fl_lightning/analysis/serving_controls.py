"""The comparisons FEAST's tables make between runs in the common serving form
(``analysis/serving.py``): client wins, the serving-density control (Table 5), the
equal-total-compute horizon (Table 8), accuracy at budget anchors and the 25M-to-596M change
(Tables 3, 11, 12).

Every function takes plain arrays (or :class:`~fl_lightning.analysis.serving.ServingRun`\\ s
for the conveniences at the end), so each is checked on hand-made numbers.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from fl_lightning.algorithms.supernet.feast_accounting import scaled_anchors, spans_paper
from fl_lightning.analysis.serving import ServingRun, largest_affordable


# -- population accuracy and client wins ------------------------------------------------------

def population_accuracy(point_accs: Sequence[float], point_macs: Sequence[float], budgets: Sequence[float]) -> float:
    """Mean over clients of the accuracy of the point largest-affordable serving gives them."""
    served, _ = largest_affordable(point_macs, budgets)
    return float(np.asarray(point_accs, dtype=np.float64)[served].mean())


def client_wins(feast_accs: Sequence[float], baseline_accs: Sequence[float]) -> Dict[str, int]:
    """Client by client, FEAST's served accuracy against the baseline's: wins, ties, losses
    (exact comparison of the recorded accuracies)."""
    a, b = np.asarray(feast_accs, dtype=np.float64), np.asarray(baseline_accs, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"client counts differ: {a.size} and {b.size}")
    return {"wins": int((a > b).sum()), "ties": int((a == b).sum()), "losses": int((a < b).sum()), "clients": a.size}


def same_population(a: ServingRun, b: ServingRun) -> bool:
    """Two runs serve the same clients: equal budgets (to float rounding)."""
    return a.budgets.shape == b.budgets.shape and bool(np.allclose(a.budgets, b.budgets, rtol=1e-9, atol=0))


def compare_clients(feast: ServingRun, baseline: ServingRun) -> Dict[str, int]:
    """:func:`client_wins` of two runs of the same population."""
    if not same_population(feast, baseline):
        raise ValueError(f"{feast.name} and {baseline.name} serve different client budgets")
    return client_wins(feast.client_accs(), baseline.client_accs())


# -- serving density (Table 5) ----------------------------------------------------------------

def nearest_points(point_macs: Sequence[float], targets: Sequence[float]) -> List[int]:
    """For every target the point nearest in MACs (ties: the cheaper), deduplicated, sorted."""
    macs = np.asarray(point_macs, dtype=np.float64)
    picks = {min(range(len(macs)), key=lambda j: (abs(macs[j] - t), macs[j], j)) for t in targets}
    return sorted(picks, key=lambda j: (macs[j], j))


def density_control(point_macs: Sequence[float], point_accs: Sequence[float], tier_macs: Sequence[float],
                    baseline_acc: float, budgets: Sequence[float]) -> Dict[str, object]:
    """FEAST restricted to the cached variants nearest each native baseline tier, served to the
    same budgets by the same rule (Supp. E.1, Table 5).

    ``full``: the whole curve's population accuracy; ``matched``: the subset's; ``density``:
    full - matched (what the extra points add); ``full_margin``: full - baseline;
    ``residual``: matched - baseline; ``retained``: residual / full_margin (the share of the
    margin left without the density).
    """
    macs = np.asarray(point_macs, dtype=np.float64)
    accs = np.asarray(point_accs, dtype=np.float64)
    subset = nearest_points(macs, tier_macs)
    full = population_accuracy(accs, macs, budgets)
    served, fallback = largest_affordable(macs[subset], budgets)
    matched = float(accs[subset][served].mean())
    full_margin, residual = full - baseline_acc, matched - baseline_acc
    return {"subset": subset, "subset_macs": macs[subset].tolist(), "full": full, "matched": matched,
            "baseline": float(baseline_acc), "full_margin": full_margin, "density": full - matched,
            "residual": residual, "retained": residual / full_margin if full_margin else float("nan"),
            "subset_fallback": int(fallback.sum()), "subset_served": [subset[j] for j in served]}


def density_runs(feast: ServingRun, baseline: ServingRun) -> Dict[str, object]:
    """:func:`density_control` for two runs of one population, with client wins of the full
    curve and of the matched subset against the baseline."""
    if not same_population(feast, baseline):
        raise ValueError(f"{feast.name} and {baseline.name} serve different client budgets")
    out = density_control(feast.point_macs, feast.point_accs, baseline.point_macs, baseline.population_acc,
                          feast.budgets)
    base = baseline.client_accs()
    out["wins_full"] = client_wins(feast.client_accs(), base)
    out["wins_matched"] = client_wins(feast.point_accs[out["subset_served"]], base)
    return out


# -- equal total training compute (Table 8) ----------------------------------------------------

def matched_rounds(rounds: int, feast_proxy: float, baseline_proxy: float) -> int:
    """``R' = ceil(R x C_FEAST / C_baseline)``: the horizon at which the baseline's proxy (linear
    in rounds) reaches FEAST's total. A ratio within 1e-9 of an integer counts as that integer."""
    if baseline_proxy <= 0:
        raise ValueError("the baseline's proxy must be > 0")
    x = rounds * feast_proxy / baseline_proxy
    return int(math.ceil(x - 1e-9 * max(1.0, x)))


def horizon_overrides(run: ServingRun, new_rounds: int) -> List[str]:
    """Command-line overrides that rerun ``run`` over ``new_rounds`` with its schedule stretched
    to the new horizon: the cosine learning rate, ScaleFL's distillation start (a fraction) and
    an unset MaxNet anneal already follow ``federation.rounds``; an exponential decay and an
    explicit MaxNet anneal length are rescaled here."""
    out = ["--federation.rounds", str(new_rounds)]
    scale = run.rounds / new_rounds
    if run.get("train.lr_schedule") == "exponential":
        out += ["--train.lr_decay", f"{float(run.get('train.lr_decay', 0.995)) ** scale:.10g}"]
    steps = run.get("algorithm.init_args.maxnet_steps")
    if steps:
        out += ["--algorithm.init_args.maxnet_steps", str(max(1, round(int(steps) / scale)))]
    return out


def horizon_command(run: ServingRun, new_rounds: int) -> str:
    """The full command that reruns ``run`` from its saved config over ``new_rounds``."""
    overrides = " ".join(horizon_overrides(run, new_rounds))
    return (f"python -m fl_lightning fit --config {run.path / 'config.yaml'} {overrides} "
            f"--out_dir {run.path.parent} --name {run.name}_r{new_rounds}")


# -- anchors (Tables 2, 3, 11, 12; ``feast_accounting.default_anchors`` places them) ---------

def anchor_accuracy(point_macs: Sequence[float], point_accs: Sequence[float], anchor: float) -> Optional[float]:
    """Accuracy of the largest measured point whose MACs are at most ``anchor`` (a relative
    1e-9 slack absorbs the rounding of scaled anchors); None when no point is."""
    macs = np.asarray(point_macs, dtype=np.float64)
    ok = [j for j in range(len(macs)) if macs[j] <= anchor * (1 + 1e-9)]
    if not ok:
        return None
    j = max(ok, key=lambda i: (macs[i], i))
    value = float(np.asarray(point_accs, dtype=np.float64)[j])
    return None if math.isnan(value) else value


def anchor_row(run: ServingRun, anchors: Sequence[float]) -> List[Optional[float]]:
    return [anchor_accuracy(run.point_macs, run.point_accs, a) for a in anchors]


def range_ends(point_macs: Sequence[float], point_accs: Sequence[float], low: float) -> Optional[tuple]:
    """Sec. 4.2's shared range: (accuracy of the smallest point of at least ``low`` MACs, that of
    the largest point); None when no point is that large (the same 1e-9 slack as the anchors)."""
    macs = np.asarray(point_macs, dtype=np.float64)
    accs = np.asarray(point_accs, dtype=np.float64)
    inside = [j for j in range(len(macs)) if macs[j] >= low * (1 - 1e-9)]
    if not inside:
        return None
    smallest = min(inside, key=lambda i: (macs[i], i))
    largest = max(inside, key=lambda i: (macs[i], i))
    return float(accs[smallest]), float(accs[largest])


def end_to_end_change(row: Sequence[Optional[float]]) -> Optional[float]:
    """Accuracy at the last anchor minus at the first (the 25M-to-596M change)."""
    if row[0] is None or row[-1] is None:
        return None
    return row[-1] - row[0]


__all__ = ["population_accuracy", "client_wins", "same_population", "compare_clients", "nearest_points",
           "density_control", "density_runs", "matched_rounds", "horizon_overrides", "horizon_command",
           "spans_paper", "scaled_anchors", "anchor_accuracy", "anchor_row", "range_ends", "end_to_end_change"]
