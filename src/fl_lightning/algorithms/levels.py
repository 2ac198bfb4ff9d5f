"""Serving by levels: each client gets the largest operating point its MAC budget affords, the
smallest as the fallback. The part ScaleFL's levels and HeteroFL's width tiers share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from fl_lightning.errors import ConfigError
from fl_lightning.units import macs


def assign_levels(budgets: Sequence[float], level_macs: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest-affordable assignment with the minimum-tier fallback.

    Returns (0-based level per client, int64 [N]; fallback flag per client, bool [N]): the
    highest level whose MACs are at most the client's budget, or level 0 with the flag set when
    even level 0 costs more than the budget.
    """
    macs = torch.as_tensor([float(m) for m in level_macs], dtype=torch.float64)
    b = torch.as_tensor([float(x) for x in budgets], dtype=torch.float64)
    affordable = macs.unsqueeze(0) <= b.unsqueeze(1)  # [N, L]
    count = affordable.sum(dim=1)
    # Levels cost more level by level, so the affordable ones are a prefix: the last is count - 1.
    levels = (count - 1).clamp_min(0).to(torch.int64)
    return levels, count == 0


@dataclass
class LevelAssignment:
    """The levels' served MACs (smallest first) and each client's level by its budget."""

    macs: List[int]
    """Served MACs of each level (fvcore, one example)."""
    budgets: torch.Tensor
    """Each client's MAC budget, float64 [N]."""
    assigned: torch.Tensor
    """0-based level of every client, int64 [N]."""
    fallback: torch.Tensor
    """Clients whose budget is below the smallest level's MACs (served level 0 anyway), bool [N]."""

    @classmethod
    def by_budget(cls, macs: Sequence[float], budgets: Sequence[float],
                  name: Callable[[int], Tuple[str, str]]) -> "LevelAssignment":
        """Assign the clients; ``name(k)`` is ``(config key, words)`` of level ``k`` for the error
        when a level does not cost more than the one before it."""
        macs = [int(m) for m in macs]
        for k in range(1, len(macs)):
            if macs[k] <= macs[k - 1]:
                key, words = name(k)
                raise ConfigError(key, f"{words} costs {macs[k] / 1e6:.3f}M MACs, not more than {name(k - 1)[1]} "
                                       f"({macs[k - 1] / 1e6:.3f}M): levels must cost more, smallest first")
        budgets = torch.as_tensor([float(b) for b in budgets], dtype=torch.float64)
        assigned, fallback = assign_levels(budgets.tolist(), macs)
        return cls(macs, budgets, assigned, fallback)

    def served_names(self) -> Dict[str, str]:
        """Each level's evaluation figure (``level<k>_acc``) named by its served MACs, for the logs."""
        return {f"level{k + 1}_acc": f"level{k + 1} {macs(m)}" for k, m in enumerate(self.macs)}

    def counts(self) -> List[int]:
        """Clients per level."""
        return torch.bincount(self.assigned, minlength=len(self.macs)).tolist()

    def population(self) -> List[dict]:
        """One row per client: its budget, the (1-based) level it trains and is served, the
        fallback flag and the level's MACs."""
        return [{"client": c, "budget": float(self.budgets[c]), "level": k + 1, "fallback": bool(self.fallback[c]),
                 "macs": self.macs[k]} for c, k in enumerate(self.assigned.tolist())]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The assignment (a pure function of the budgets and levels, kept so that a resumed or
        re-scored run serves the clients it trained)."""
        return {"assigned": self.assigned.clone(), "fallback": self.fallback.to(torch.uint8)}

    def load_state_dict(self, state: Dict[str, torch.Tensor], key: str = "algorithm.levels") -> None:
        assigned = state["assigned"].to(torch.int64).cpu()
        if assigned.numel() != self.assigned.numel() or int(assigned.max()) >= len(self.macs):
            raise ConfigError(key, "the checkpoint's level assignment does not fit these clients and levels")
        self.assigned = assigned
        self.fallback = state["fallback"].bool().cpu()
