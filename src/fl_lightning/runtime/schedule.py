"""Learning rate over rounds: a client's lr is fixed within a round."""

from __future__ import annotations

import math


def round_lr(base_lr: float, schedule: str, round_idx: int, total_rounds: int, decay: float = 0.995) -> float:
    """Learning rate of round ``round_idx`` (0-based)."""
    if schedule == "constant":
        return base_lr
    if schedule == "exponential":
        return base_lr * decay ** round_idx
    if schedule == "cosine":
        return 0.5 * base_lr * (1.0 + math.cos(math.pi * round_idx / total_rounds))
    raise ValueError(f"unknown schedule {schedule!r}")
