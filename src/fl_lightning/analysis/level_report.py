"""The report lines every tiered method prints after its per-level table."""

from __future__ import annotations

from typing import List


def population_lines(block: dict, rows: List[dict], num_levels: int) -> List[str]:
    """The report's tail shared by every tiered method: the population accuracy with the
    fallback count, then every client once under the level it is served (``rows`` as
    ``population()`` gives them)."""
    fallback = sum(1 for r in rows if r["fallback"])
    lines = []
    if "test_acc" in block:
        lines.append(f"population accuracy under largest-affordable serving with the minimum-tier fallback: "
                     f"{100 * block['test_acc']:.2f}% ({len(rows)} clients, {fallback} served level 1 "
                     f"as the fallback)")
    lines.append("clients by served level (* = fallback: budget below level 1):")
    for k in range(num_levels):
        ids = [f"{r['client']}{'*' if r['fallback'] else ''}" for r in rows if r["level"] == k + 1]
        lines.append(f"  level {k + 1}: {', '.join(ids) if ids else '-'}")
    return lines
