"""Random-budget: random widths whose cohort mean matches a target budget (the capacity control)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Union

import numpy as np

from fl_lightning.algorithms.submodel.base import SubmodelAlgorithm, allocation_rng
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import UnitFraction


class RandomBudget(SubmodelAlgorithm):
    """Random time-varying widths whose cohort average matches a target budget.

    Each round every cohort client draws ``u ~ U(0, 1)``; widths are
    ``min(p_max, clip(p_lo + s u, p_lo, 1))`` with the scale ``s`` found by bisection so that
    the cohort mean equals the round's target (clipped to what the caps allow). The target is
    ``budget`` (a number), or the per-round ``p_bar`` of a saved run (``budget_from``: a run
    folder or its ``metrics.jsonl``; rounds past its end repeat its mean).
    """

    def __init__(self, budget: UnitFraction = 0.5, budget_from: Optional[str] = None, p_lo: UnitFraction = 0.0625,
                 **kwargs):
        """
        Args:
            budget: target average width of each round's cohort.
            budget_from: a saved run (folder or metrics.jsonl) whose per-round ``p_bar`` is the target trace.
            p_lo: smallest width drawn.
        """
        super().__init__(**kwargs)
        self.budget = float(budget)
        self.budget_from = budget_from
        self.p_lo = float(p_lo)
        self.trace: Optional[List[float]] = None

    def check(self, train, population=None):
        super().check(train, population)
        if self.budget_from is not None:
            self.trace = load_budget_trace(self.budget_from)

    def target(self, round_idx: int) -> float:
        if self.trace is None and self.budget_from is not None:
            self.trace = load_budget_trace(self.budget_from)
        if self.trace:
            return self.trace[round_idx] if round_idx < len(self.trace) else float(np.mean(self.trace))
        return self.budget

    def widths_for(self, round_idx, cohort):
        rng = allocation_rng(self.ctx.seed, round_idx)
        u = rng.random(len(cohort))
        caps = np.array([float(self.caps[c]) for c in cohort])
        widths = matched_widths(u, caps, self.target(round_idx), self.p_lo)
        return {c: float(w) for c, w in zip(cohort, widths)}


def matched_widths(u: np.ndarray, caps: np.ndarray, target: float, p_lo: float) -> np.ndarray:
    """``min(caps, clip(p_lo + s u, p_lo, 1))`` with ``s >= 0`` chosen so the mean is ``target``
    (or as near as the caps allow)."""
    lo_caps = np.minimum(caps, p_lo)

    def widths(s):
        return np.minimum(caps, np.clip(p_lo + s * u, p_lo, 1.0))

    if target <= widths(0.0).mean():
        return widths(0.0) if target >= lo_caps.mean() else lo_caps
    hi = 1.0
    while widths(hi).mean() < target and hi < 1e6:
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if widths(mid).mean() < target:
            lo = mid
        else:
            hi = mid
    return widths(hi)


def load_budget_trace(path: Union[str, Path]) -> List[float]:
    """Per-round ``p_bar`` of a saved run (its folder or its ``metrics.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError("algorithm.budget_from", f"no metrics file at {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trace = [float(r["p_bar"]) for r in sorted(rows, key=lambda r: r["round"]) if r.get("p_bar") is not None]
    if not trace:
        raise ConfigError("algorithm.budget_from", f"{path} has no p_bar column (not a sub-model run)")
    return trace
