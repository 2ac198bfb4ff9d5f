"""Counts (MACs, parameters) written for people: the largest of K, M, G, T, P that keeps the
figure at 1 or more, so a budget of 23,400 MACs reads "23.4K" rather than "0.0M" and one of 596
million "596M". Sentences use significant digits (``count``), tables a fixed number of decimals
(``fixed``)."""

from __future__ import annotations

import math

PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _scaled(value: float) -> tuple[float, str]:
    for scale, prefix in PREFIXES:
        if abs(value) >= scale:
            return value / scale, prefix
    return value, ""


def count(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits with a K/M/G/T/P prefix: 1000 -> '1K',
    23400 -> '23.4K', 200000 -> '200K', 4462000 -> '4.46M', 999999 -> '1M', 512 -> '512'."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    figure, prefix = _scaled(float(f"{value:.{digits}g}"))  # rounded first: 999,999 is 1M, not 1e+03K
    return f"{figure:.{digits}g}{prefix}"


def macs(value: float, digits: int = 3) -> str:
    """A MAC count as a sentence writes it: ``macs(23400)`` -> '23.4K MACs'."""
    return f"{count(value, digits)} MACs"


def fixed(value: float, decimals: int = 2) -> str:
    """``value`` with a K/M/G/T/P prefix and ``decimals`` decimals, as table columns align them:
    31.01e15 -> '31.01P', 1234 -> '1.23K', 512 -> '512' (below 1K, a whole number)."""
    figure, prefix = _scaled(value)
    return f"{figure:.{decimals}f}{prefix}" if prefix else f"{value:.0f}"


__all__ = ["count", "fixed", "macs"]
