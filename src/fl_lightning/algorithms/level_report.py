"""The text reports printed at the end of a run by the methods that serve several models:
HeteroFL's width tiers, ScaleFL's levels and FEAST's cached variants."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def report_block(summary: dict) -> Tuple[Optional[dict], str]:
    """The figures a report shows (the best-validation checkpoint's, else the final model's)
    and which they are."""
    block = summary.get("best") or summary.get("final")
    return block, ("best-validation checkpoint" if "best" in summary else "final model")


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


def level_table(summary: dict, title: str, header: str, cells: Sequence[str], population: List[dict]) -> str:
    """One row per level, its description ``cells[k]`` then its test accuracy, and the
    population lines; ``title`` may name ``{which}`` figures these are."""
    block, which = report_block(summary)
    if not block:
        return ""
    lines = [title.format(which=which), header]
    for k, cell in enumerate(cells):
        acc = block.get(f"test_level{k + 1}_acc")
        lines.append(f"{cell}  {'' if acc is None else f'{100 * acc:6.2f}'}")
    lines += population_lines(block, population, len(cells))
    return "\n".join(lines)


def tier_report(summary: dict, tiers: Sequence[float], macs: Sequence[int], params: Sequence[int],
                counts: Sequence[int], population: List[dict], bn: str) -> str:
    """HeteroFL's tiers: width, served MACs, parameters, clients and test accuracy of each."""
    cells = [f"{k + 1:5d}  {width:6.4g}  {macs[k] / 1e6:8.2f}M  {params[k] / 1e6:7.3f}M  {counts[k]:7d}"
             for k, width in enumerate(tiers)]
    header = f"{'level':>5}  {'width':>6}  {'MACs':>9}  {'params':>8}  {'clients':>7}  {'acc %':>6}"
    return level_table(summary, f"HeteroFL test accuracy ({{which}}, BN: {bn}):", header, cells, population)


def scalefl_report(summary: dict, specs: Sequence, macs: Sequence[float], params: Sequence[int],
                   counts: Sequence[int], population: List[dict]) -> str:
    """ScaleFL's levels: blocks, width, served MACs, parameters, clients and test accuracy of each."""
    cells = [f"{k + 1:5d}  {spec.depth:6d}  {spec.width:5.2f}  {macs[k] / 1e6:8.2f}M  {params[k] / 1e6:7.3f}M  "
             f"{counts[k]:7d}" for k, spec in enumerate(specs)]
    header = f"{'level':>5}  {'blocks':>6}  {'width':>5}  {'MACs':>9}  {'params':>8}  {'clients':>7}  {'acc %':>6}"
    return level_table(summary, "ScaleFL test accuracy ({which}):", header, cells, population)


def variant_report(summary: dict, specs: Sequence, macs: Sequence[int], params: Sequence[int],
                   method: str = "FEAST") -> str:
    """A supernet's cached variants: accuracy against MACs (FEAST Fig. 3) and the population
    accuracy (Table 1); ``method`` names the algorithm that trained it."""
    block, which = report_block(summary)
    if not block:
        return ""
    lines = [f"{method} test accuracy ({which}):", f"{'variant':>7}  {'MACs':>9}  {'params':>8}  {'acc %':>6}  spec"]
    for j, spec in enumerate(specs):
        acc = block.get(f"test_variant{j:02d}_acc")
        if acc is not None:
            lines.append(f"{j:7d}  {macs[j] / 1e6:8.2f}M  {params[j] / 1e6:7.2f}M  {100 * acc:6.2f}  {spec}")
    lines.append(f"population accuracy under largest-affordable serving: {100 * block['test_acc']:.2f}%")
    return "\n".join(lines)
