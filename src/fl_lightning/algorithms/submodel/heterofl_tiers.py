"""HeteroFL's width tiers served by MAC budget: assignment, per-tier evaluation, the report.

As FEAST compares HeteroFL (Supp. E.1): five width multipliers, each client trains and is
served the largest tier whose served MACs (fvcore on the extracted model, as ScaleFL's levels)
fit its budget, and a client that affords none gets the smallest tier (the minimum-tier
fallback, counted). Metric keys are ScaleFL's (``level{k}_acc``, ``mean_level_acc``,
``fallback_clients``, ``acc`` = population accuracy), so one table tool reads both.
"""

from __future__ import annotations

import json
from typing import Dict, List, Sequence

import torch

from fl_lightning.algorithms.levels import LevelAssignment

HETEROFL_TIERS = (0.0625, 0.125, 0.25, 0.5, 1.0)
"""HeteroFL's width multipliers 1/16 .. 1 (FEAST Supp. E.1), smallest first."""


class TierAssignment(LevelAssignment):
    """Width tiers (smallest first) as levels: their served cost, parameters and each client's tier."""

    def __init__(self, tiers: Sequence[float], params: Sequence[int], levels: LevelAssignment):
        super().__init__(levels.macs, levels.budgets, levels.assigned, levels.fallback)
        self.tiers = [float(t) for t in tiers]
        self.params = [int(p) for p in params]
        """Parameters of each tier's model (what a client of that tier receives and returns)."""

    @classmethod
    def from_costs(cls, tiers: Sequence[float], macs: Sequence[int], params: Sequence[int],
                   budgets: Sequence[float]) -> "TierAssignment":
        levels = LevelAssignment.by_budget(macs, budgets, lambda k: ("algorithm.tiers", f"tier {tiers[k]:g}"))
        return cls(tiers, params, levels)

    @classmethod
    def by_budget(cls, model, specs: Sequence, tiers: Sequence[float], budgets: Sequence[float],
                  input_shape: Sequence[int]) -> "TierAssignment":
        """Cost every tier's extracted model (memoized) and assign the clients."""
        from fl_lightning.elastic.macs import spec_macs, spec_params

        macs = [spec_macs(model, spec, input_shape) for spec in specs]
        params = [spec_params(model, spec, input_shape) for spec in specs]
        return cls.from_costs(tiers, macs, params, budgets)

    def widths(self) -> torch.Tensor:
        """Each client's tier width, float64 [N] (the sub-model machinery's caps)."""
        return torch.tensor([self.tiers[int(k)] for k in self.assigned], dtype=torch.float64)

    def population(self) -> List[dict]:
        """ScaleFL's row per client, plus the width."""
        return [{"client": r["client"], "budget": r["budget"], "level": r["level"], "width": self.tiers[r["level"] - 1],
                 "fallback": r["fallback"], "macs": r["macs"]} for r in super().population()]

    def describe(self) -> str:
        lines = [f"HeteroFL: {len(self.tiers)} width tiers, {int(self.fallback.sum())} of {len(self.assigned)} "
                 f"clients afford none and fall back to the smallest"]
        for k, n in enumerate(self.counts()):
            lines.append(f"  tier {k + 1} (width {self.tiers[k]:g}): {self.macs[k] / 1e6:.2f}M MACs served, "
                         f"{self.params[k] / 1e6:.3f}M params, {n} clients")
        return "\n".join(lines)

    def to_json(self) -> str:
        levels = [{"level": k + 1, "width": t, "served_macs": self.macs[k], "params": self.params[k]}
                  for k, t in enumerate(self.tiers)]
        return json.dumps({"levels": levels, "clients": self.population()}, indent=2)

    def load_state_dict(self, state: Dict[str, torch.Tensor], key: str = "algorithm.tiers") -> None:
        super().load_state_dict(state, key)


__all__ = ["HETEROFL_TIERS", "TierAssignment"]
