"""Serving by levels: each client gets the largest operating point its MAC budget affords, the
smallest as the fallback. The part ScaleFL's levels and HeteroFL's width tiers share."""

from __future__ import annotations

from typing import Sequence

import torch


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
