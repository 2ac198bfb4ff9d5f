"""HeteroFL's width tiers served by MAC budget: assignment, per-tier evaluation, the report.

As FEAST compares HeteroFL (Supp. E.1): five width multipliers, each client trains and is
served the largest tier whose served MACs (fvcore on the extracted model, as ScaleFL's levels)
fit its budget, and a client that affords none gets the smallest tier (the minimum-tier
fallback, counted). Metric keys are ScaleFL's (``level{k}_acc``, ``mean_level_acc``,
``fallback_clients``, ``acc`` = population accuracy), so one table tool reads both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from fl_lightning.algorithms.levels import assign_levels
from fl_lightning.errors import ConfigError

HETEROFL_TIERS = (0.0625, 0.125, 0.25, 0.5, 1.0)
"""HeteroFL's width multipliers 1/16 .. 1 (FEAST Supp. E.1), smallest first."""


@dataclass
class TierAssignment:
    """Tiers (smallest first), their served cost, and each client's tier."""

    tiers: List[float]
    macs: List[int]
    """Served MACs of each tier (fvcore, one example)."""
    params: List[int]
    """Parameters of each tier's model (what a client of that tier receives and returns)."""
    budgets: torch.Tensor
    assigned: torch.Tensor
    """0-based tier of every client, int64 [N]."""
    fallback: torch.Tensor
    """Clients whose budget is below the smallest tier's MACs (served tier 0 anyway), bool [N]."""

    @classmethod
    def from_costs(cls, tiers: Sequence[float], macs: Sequence[int], params: Sequence[int],
                   budgets: Sequence[float]) -> "TierAssignment":
        macs = [int(m) for m in macs]
        for k in range(1, len(macs)):
            if macs[k] <= macs[k - 1]:
                raise ConfigError("algorithm.tiers", f"tier {tiers[k]:g} costs {macs[k] / 1e6:.3f}M MACs, not more than "
                                                     f"tier {tiers[k - 1]:g} ({macs[k - 1] / 1e6:.3f}M): tiers must be "
                                                     f"distinct widths, smallest first")
        budgets = torch.as_tensor([float(b) for b in budgets], dtype=torch.float64)
        assigned, fallback = assign_levels(budgets.tolist(), macs)
        return cls([float(t) for t in tiers], macs, [int(p) for p in params], budgets, assigned, fallback)

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

    def counts(self) -> List[int]:
        return torch.bincount(self.assigned, minlength=len(self.tiers)).tolist()

    def population(self) -> List[dict]:
        """One row per client: budget, the tier (1-based level) it trains and is served, its
        width and MACs, the fallback flag (ScaleFL's row, plus the width)."""
        rows = []
        for c, k in enumerate(self.assigned.tolist()):
            rows.append({"client": c, "budget": float(self.budgets[c]), "level": k + 1, "width": self.tiers[k],
                         "fallback": bool(self.fallback[c]), "macs": self.macs[k]})
        return rows

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

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"assigned": self.assigned.clone(), "fallback": self.fallback.to(torch.uint8)}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        assigned = state["assigned"].to(torch.int64).cpu()
        if assigned.numel() != self.assigned.numel() or int(assigned.max()) >= len(self.tiers):
            raise ConfigError("algorithm.tiers", "the checkpoint's tier assignment does not fit these clients and tiers")
        self.assigned = assigned
        self.fallback = state["fallback"].bool().cpu()


__all__ = ["HETEROFL_TIERS", "TierAssignment"]
