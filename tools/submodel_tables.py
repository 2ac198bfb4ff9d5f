"""Tables of the sub-model study from saved multi-seed runs (``<root>/<policy>_s<seed>``).

    python tools/submodel_tables.py runs/submodel/digits [--reference hasfl] [--table3] [--table4] \
        [--noise runs/submodel/digits_threads2] [--before runs/archive/digits]

Prints, per policy, best (peak test accuracy over the evaluations) and final test accuracy and
the average capacity (mean over rounds of the cohort's mean width; 1 for full-model methods)
as mean +- std over seeds (Tables 2, 5, 6), paired per-seed differences against the reference
policy with their 95% intervals; with ``--table3`` the coverage ablation (peak-to-final drop
and the round's widest sub-model after warm-up, median over rounds); with ``--table4`` the
capacity-confound correlations of the HAS-FL runs; with ``--noise`` the same seeds' runs under
other arithmetic, the noise floor of one run; with ``--before`` the same seeds under an earlier
protocol (the served-statistics change: ``docs/served_statistics.md``) beside today's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from fl_lightning.analysis.heterogeneity import load_run, table4_row
from fl_lightning.errors import ConfigError
from fl_lightning.tool_parser import ToolParser


BEYOND_PAPER = {"fedrolex"}
"""Policies the sub-model study runs beside the paper's comparison."""


def label(policy: str) -> str:
    return f"{policy} (beyond the paper)" if policy in BEYOND_PAPER else policy


def run_figures(run) -> dict:
    accs = [m["test_acc"] for m in run["metrics"] if m.get("test_acc") is not None]
    final = run["summary"]["final"]["test_acc"] if run["summary"] else (accs[-1] if accs else float("nan"))
    widths = [m["p_bar"] for m in run["metrics"] if "p_bar" in m]
    return {"best": max(accs) if accs else float("nan"), "final": final,
            "p": float(np.mean(widths)) if widths else 1.0, "largest": largest_allocation(run),
            "levelled": levelled(accs)}


def levelled(accs: list, window: int = 3, points: float = 1.0) -> bool:
    """Whether a run has levelled off: its last ``window`` evaluations lie within ``points``
    accuracy points of each other (a run still climbing or swinging has not)."""
    last = accs[-window:]
    return len(last) == window and 100.0 * (max(last) - min(last)) <= points


def largest_allocation(run) -> float:
    """Table 3's "largest allocation in the federation": the widest sub-model of each round
    after HAS-FL's warm-up, its median over those rounds (1 for full-model methods)."""
    warm = int(((run["config"].get("algorithm") or {}).get("init_args") or {}).get("t_warm", 10))
    widest: dict = {}
    for row in run["clients"]:
        if "p" in row and row.get("round", 0) >= warm:
            widest[row["round"]] = max(widest.get(row["round"], 0.0), float(row["p"]))
    return float(np.median(list(widest.values()))) if widest else 1.0


def print_table3(figures: dict, reference: str = "hasfl") -> None:
    """Table 3: the coverage ablation with its peak-to-final drop (mean of the per-seed drops),
    and Uniform beside it (Table 2's rise and decline). The best of many noisy evaluations always
    sits above the last, so a drop is read against the reference's on the same seeds: the last
    column is ``drop - reference drop`` with its paired 95% interval (negative: falls further)."""
    rows = [p for p in ("hasfl", "hasfl_nocov", "heterofl", "uniform") if p in figures]
    if not rows:
        return
    print("\nTable 3: coverage ablation (mean ± std over seeds; drop = final - best per seed; largest p = "
          "median over the rounds after warm-up of the round's widest sub-model, range over seeds; "
          f"last column: drop - {reference}'s drop, paired over seeds, points)\n")
    print("| configuration | seeds | best acc (%) | final acc (%) | peak→final Δ (points) | avg p | largest p "
          "| Δ drop, 95% CI |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    drops = {name: {s: x["final"] - x["best"] for s, x in figures[name].items()} for name in rows}
    for name in rows:
        v = list(figures[name].values())
        largest = [x["largest"] for x in v]
        paired = paired_cells(drops[name], drops[reference]) if name != reference and reference in drops else None
        against = f"{paired[0][2]} ({verdict(paired[1], paired[2], reference)})" if paired else "-"
        print(f"| {name} | {len(v)} | {pm([x['best'] for x in v])} | {pm([x['final'] for x in v])} | "
              f"{pm([x['final'] - x['best'] for x in v])} | {pm([x['p'] for x in v], 1.0, 2)} | "
              f"{min(largest):.2f}-{max(largest):.2f} | {against} |")


def print_table4(policy: str, rows: dict) -> None:
    """Table 4 per seed, their mean, and the 95% Student-t interval of the mean over seeds."""
    keys = ["r(H,TV)", "r(H,pmax)", "pr(H,TV|pmax)", "pr(p,TV|pmax)"]
    print(f"\nTable 4 ({policy}): correlations over the clients of each seed\n")
    print("| seed | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for s, row in rows.items():
        print(f"| {s} | " + " | ".join(f"{row[k]:+.2f}" for k in keys) + " |")
    print("| mean | " + " | ".join(f"{np.nanmean([r[k] for r in rows.values()]):+.2f}" for k in keys) + " |")
    intervals = [paired_interval([r[k] for r in rows.values() if np.isfinite(r[k])]) for k in keys]
    print("| 95% CI | " + " | ".join(f"{m:+.2f} ± {h:.2f}" for m, h in intervals) + " |")


def finished_runs(root: Path):
    """``(method, seed, folder)`` of every finished run (``<method>_s<seed>`` with a summary) under ``root``."""
    for folder in sorted(root.iterdir()):
        match = re.fullmatch(r"(.+)_s(\d+)", folder.name)
        if match and (folder / "summary.json").exists():
            yield match.group(1), int(match.group(2)), folder


def collect(root: Path) -> dict:
    runs = defaultdict(dict)
    for method, seed, folder in finished_runs(root):
        runs[method][seed] = load_run(folder)
    return runs


def pm(values, scale=100.0, digits=1) -> str:
    v = np.asarray(values, dtype=np.float64) * scale
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.{digits}f}"


def paired_interval(differences) -> tuple[float, float]:
    """Mean of paired differences and the half-width of its two-sided 95% Student-t interval
    (nan with fewer than two pairs)."""
    from scipy import stats

    d = np.asarray(differences, dtype=np.float64)
    if len(d) < 2:
        return float(d.mean()) if len(d) else float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return float(d.mean()), float(half)


def verdict(mean: float, half: float, reference: str) -> str:
    """A difference is a finding only when its 95% interval excludes zero."""
    if not np.isfinite(half):
        return "too few seeds"
    if mean - half > 0:
        return f"above {reference}"
    if mean + half < 0:
        return f"below {reference}"
    return "no difference detectable"


def paired_p_value(differences) -> float:
    """Two-sided p-value of the paired Student-t test that the mean difference is zero (nan
    with fewer than two pairs, 0 when every pair differs by the same nonzero amount)."""
    from scipy import stats

    d = np.asarray(differences, dtype=np.float64)
    if len(d) < 2:
        return float("nan")
    if d.std(ddof=1) == 0:
        return 1.0 if d.mean() == 0 else 0.0
    return float(stats.ttest_1samp(d, 0.0).pvalue)


def holm_survivors(p_values: dict, alpha: float = 0.05) -> dict:
    """Holm's step-down correction over a table's comparisons: name -> whether its difference
    stays a finding at family-wise level ``alpha`` (the smallest p against alpha / m, the next
    against alpha / (m - 1), ..., stopping at the first that fails)."""
    ranked = sorted((p, name) for name, p in p_values.items() if np.isfinite(p))
    out = {name: False for name in p_values}
    for i, (p, name) in enumerate(ranked):
        if p > alpha / (len(ranked) - i):
            break
        out[name] = True
    return out


def paired_cells(values: dict, reference: dict):
    """``values - reference`` seed by seed on their common seeds (fractions in, points out):
    ``([seeds, per seed, mean ± 95% CI], mean, half)``, or None without a common seed."""
    common = sorted(set(values) & set(reference))
    if not common:
        return None
    d = [100 * (values[s] - reference[s]) for s in common]
    mean, half = paired_interval(d)
    return [str(len(d)), ", ".join(f"{x:+.1f}" for x in d), f"{mean:+.1f} ± {half:.1f}"], mean, half


def noise_cells(values: dict, again: dict):
    """The same seeds under other arithmetic: ``[seeds, per seed, mean, max]`` of the absolute
    changes in points, or None without a common seed."""
    common = sorted(set(values) & set(again))
    if not common:
        return None
    d = [abs(100 * (values[s] - again[s])) for s in common]
    return [str(len(d)), ", ".join(f"{x:.1f}" for x in d), f"{np.mean(d):.1f}", f"{max(d):.1f}"]


def finals(seeds: dict) -> dict:
    return {s: run["final"] for s, run in seeds.items()}


def print_paired(figures: dict, reference: str, label: str) -> None:
    """Per-seed final-accuracy differences of every entry against ``reference``, in points, with
    the mean's 95% interval and what it shows."""
    ref = figures.get(reference)
    if not ref:
        return
    rows, p_values = {}, {}
    for name, seeds in figures.items():
        paired = paired_cells(finals(seeds), finals(ref)) if name != reference else None
        if paired:
            rows[name] = paired
            common = sorted(set(finals(seeds)) & set(finals(ref)))
            p_values[name] = paired_p_value([finals(seeds)[s] - finals(ref)[s] for s in common])
    survives = holm_survivors(p_values)
    print(f"\nPaired per-seed differences against {reference} ({label} - {reference}, final acc, points; "
          f"95% Student-t interval of the mean; Holm: the finding survives Holm's correction over the "
          f"table's {len(rows)} comparisons at family-wise 0.05):\n")
    print(f"| {label} | seeds | per seed | mean ± 95% CI | finding | p | Holm |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (cells, mean, half) in rows.items():
        finding = verdict(mean, half, reference)
        holm = "–" if finding == "no difference detectable" else ("survives" if survives[name] else "does not survive")
        print(f"| {name} | {' | '.join(cells)} | {finding} | {p_values[name]:.3f} | {holm} |")


def print_before_after(figures: dict, before: dict, label: str, what: str) -> None:
    """The same entries and seeds under an earlier protocol (``what``): both final accuracies
    and the paired change, so a reader sees what the protocol moves."""
    print(f"\nThe same rows and seeds before ({what}) and now: final test accuracy (%), and now - before "
          f"paired over seeds (points, 95% Student-t interval):\n")
    print(f"| {label} | seeds | before | now | now - before | finding |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, seeds in figures.items():
        earlier = finals(before.get(name, {}))
        paired = paired_cells(finals(seeds), earlier)
        if paired:
            cells, mean, half = paired
            common = sorted(set(earlier) & set(seeds))
            print(f"| {name} | {cells[0]} | {pm([earlier[s] for s in common])} | "
                  f"{pm([seeds[s]['final'] for s in common])} | {cells[2]} | {verdict(mean, half, 'before')} |")


def print_noise_floor(figures: dict, other: dict, label: str) -> None:
    """The same method and seed under other arithmetic (another root, e.g. 2 threads per rank):
    the absolute final-accuracy differences, the spread a single run carries."""
    print(f"\nNoise floor: |final acc| difference of the same {label} and seed under other arithmetic (points):\n")
    print(f"| {label} | seeds | per seed | mean | max |")
    print("| --- | --- | --- | --- | --- |")
    for name, seeds in figures.items():
        cells = noise_cells(finals(seeds), finals(other.get(name, {})))
        if cells:
            print(f"| {name} | {' | '.join(cells)} |")


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--reference", default=None, help="the policy the others are paired with (default: hasfl)")
    parser.add_argument("--table3", action="store_true")
    parser.add_argument("--table4", action="store_true")
    parser.add_argument("--noise", type=Path, help="the same seeds run under other arithmetic")
    parser.add_argument("--before", type=Path, help="the same policies and seeds under an earlier protocol")
    parser.add_argument("--before-label", default="aggregated BN statistics", help="what --before ran under")
    args = parser.parse_args(argv)
    for option, folder in (("root", args.root), ("--noise", args.noise), ("--before", args.before)):
        if folder is not None and not folder.is_dir():
            parser.error(f"{option}: no folder at {folder}")
    runs = collect(args.root)
    if args.reference is not None and args.reference not in runs:
        parser.error(f"--reference: no runs named {args.reference}_s<seed> under {args.root} "
                     f"(policies there: {', '.join(sorted(runs)) or 'none'})")
    reference = args.reference or "hasfl"
    figures = {policy: {s: run_figures(r) for s, r in seeds.items()} for policy, seeds in runs.items()}
    print(f"### {args.root}\n")
    print("| policy | seeds | best acc (%) | final acc (%) | avg p |")
    print("| --- | --- | --- | --- | --- |")
    for policy, seeds in figures.items():
        vals = list(seeds.values())
        print(f"| {label(policy)} | {len(vals)} | {pm([v['best'] for v in vals])} | {pm([v['final'] for v in vals])} | "
              f"{pm([v['p'] for v in vals], 1.0, 2)} |")
    print_paired(figures, reference, "policy")
    if args.noise:
        other = {p: {s: run_figures(r) for s, r in seeds.items()} for p, seeds in collect(args.noise).items()}
        print_noise_floor(figures, other, "policy")
    if args.before:
        before = {p: {s: run_figures(r) for s, r in seeds.items()} for p, seeds in collect(args.before).items()}
        print_before_after(figures, before, "policy", args.before_label)
    if args.table3:
        print_table3(figures, reference)
    if args.table4:
        for policy in [p for p in runs if p.startswith("hasfl")]:
            try:  # the label-skew column reads each run's data again, where its config points
                rows = {s: table4_row(r) for s, r in sorted(runs[policy].items())}
            except ConfigError as error:
                parser.error(f"--table4: {error} (run the tool from the folder the runs were made in)")
            print_table4(policy, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
