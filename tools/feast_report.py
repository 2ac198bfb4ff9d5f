"""Tables and the accuracy-against-MACs plot of saved FEAST runs.

    python tools/feast_report.py runs/quickstart runs/quickstart_min_only ... \
        [--anchors 25e6 50e6 229e6 408e6 596e6] [--plot runs/feast_acc_vs_macs.png]

For each run it reads ``summary.json`` (test accuracies of the best-validation checkpoint),
``cache.json`` (the variants' MACs) and ``config.yaml`` (rule, gamma) and prints

- the training-rule table (Table 2): at each MAC anchor, the accuracy of the largest cached
  variant whose MACs are at most the anchor (the variant a client of that budget is served; the
  same rule as ``tools/supernet_tables.py``'s Tables 1 and 3), per run, with the run's rule,
  and its worst step (the largest fall from one cached variant to the next larger); the default
  anchors are the paper's, placed in a CPU-sized cache as every table places them
  (``feast_accounting.default_anchors``);
- every cached variant's accuracy per run, when the runs share one cache;
- the gamma table (Table 13): population accuracy and accuracy at the largest variant, per
  run, with the run's gamma;

- with ``--reference ROW``, for runs named ``<row>_s<seed>``: every row's population accuracy
  (then its largest and its smallest variant's) minus the reference row's, seed by seed, with
  the 95% Student-t interval of the mean and what it shows (a finding only when the interval
  excludes zero); with ``--noise RUN ...`` also the
  noise floor, the same rows and seeds run under other arithmetic (absolute changes);

then draws every run's accuracy against MACs (Fig. 3) on one log-x plot. With
``--extractions`` (the JSON that ``python -m fl_lightning extract --run RUN --budget B`` prints,
one file per budget, or JSON lines) it also prints

- the post-hoc extraction table (Supp. Table 6): each extracted subnet's test accuracy minus its
  run's cached-variant curve, linearly interpolated in MACs at the subnet's MACs, and the
  mean absolute gap over the low end (requested budgets up to ``--low_end``, 52M: the paper's 14
  of 29 targets) and over the full range. Subnets outside the cache's MAC span are listed but
  left out of the means (the curve is not defined there). An extraction belongs to the run its
  ``checkpoint`` lies in (the first run when it names none of them), a budget extracted twice
  counts once, and with several runs the mean gaps are summarized over runs (mean ± 95%
  Student-t interval);
- each extraction's distance from what FEAST trained: the genes (depths, expansions, widths,
  position by position) in which it differs from the nearest cached variant of its run, and
  over all runs the mean gap per distance.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from fl_lightning.algorithms.supernet.feast_accounting import default_anchors
from fl_lightning.analysis.serving_controls import anchor_accuracy
from fl_lightning.algorithms.supernet.extraction_search import nearest_distance
from fl_lightning.errors import ConfigError
from fl_lightning.federation.run_dir import check_writable
from fl_lightning.tool_parser import ToolParser, existing_run
from submodel_tables import noise_cells, paired_cells, paired_interval, verdict


def load_run(path: Path) -> dict:
    summary = json.loads((path / "summary.json").read_text())
    block = summary.get("best") or summary.get("final") or {}
    cache = json.loads((path / "cache.json").read_text())
    config = yaml.safe_load((path / "config.yaml").read_text())
    macs = [v["macs"] for v in cache["variants"]]
    accs = [block.get(f"test_variant{j:02d}_acc") for j in range(len(macs))]
    args = (config.get("algorithm") or {}).get("init_args") or {}
    archs = [{k: v[k] for k in "dew"} if set("dew") <= set(v) else None for v in cache["variants"]]
    return {"name": path.name, "macs": macs, "accs": accs, "archs": archs, "population": block.get("test_acc"),
            "rule": args.get("rule", "full"), "routing": args.get("routing", True),
            "gamma": (config.get("partition") or {}).get("gamma")}


def pct(value) -> str:
    return "   -  " if value is None else f"{100 * value:6.2f}"


def rule_table(runs, anchors) -> str:
    header = (f"{'run':<32} {'rule':<11}" + "".join(f"{a / 1e6:>9.2f}M" for a in anchors)
              + "  population  worst step")
    lines = ["Training rule (Table 2): test accuracy % of the largest cached variant within each MAC anchor; "
             "worst step: the largest fall from one cached variant to the next larger",
             header]
    for run in runs:
        accs = [float("nan") if a is None else a for a in run["accs"]]
        cells = "".join(f"{pct(anchor_accuracy(run['macs'], accs, a)):>10}" for a in anchors)
        lines.append(f"{run['name']:<32} {run['rule']:<11}{cells}  {pct(run['population']):>10}"
                     f"  {pct(worst_step(run)):>10}")
    return "\n".join(lines)


def variant_table(runs) -> str:
    """Every cached variant's accuracy, when the runs share one cache (the anchors can skip a
    variant of a small cache, or show one twice)."""
    macs = sorted(runs[0]["macs"])
    if any(sorted(run["macs"]) != macs for run in runs):
        return "Per cached variant: skipped, the runs have different caches"
    lines = ["Per cached variant: test accuracy %",
             f"{'run':<32} {'rule':<11}" + "".join(f"{m / 1e6:>9.2f}M" for m in macs)]
    for run in runs:
        lines.append(f"{run['name']:<32} {run['rule']:<11}" + "".join(f"{pct(acc):>10}" for acc in by_macs(run)))
    return "\n".join(lines)


def gamma_table(runs) -> str:
    lines = ["Allocation gamma (Table 13): test accuracy %",
             f"{'run':<32} {'gamma':>6} {'largest':>8} {'smallest':>9} {'population':>11}"]
    for run in sorted(runs, key=lambda r: (r["gamma"] is None, r["gamma"])):
        accs = by_macs(run)
        lines.append(f"{run['name']:<32} {run['gamma']!s:>6} {pct(accs[-1]):>8} {pct(accs[0]):>9} "
                     f"{pct(run['population']):>11}")
    return "\n".join(lines)


def by_macs(run) -> list:
    """The run's variant accuracies from the fewest MACs to the most (a cache need not be sorted)."""
    return [acc for _, acc in sorted(zip(run["macs"], run["accs"]), key=lambda pair: pair[0])]


MEASURES = {"population": lambda run: run["population"],
            "largest variant": lambda run: by_macs(run)[-1] if run.get("accs") else None,
            "smallest variant": lambda run: by_macs(run)[0] if run.get("accs") else None}
"""What a paired comparison reads of a run: Table 2 and the quick start read the population,
Table 13 the largest variant (its claim) and the smallest."""


def by_row(runs, measure: str = "population") -> dict:
    """``measure`` of runs named ``<row>_s<seed>``: ``{row: {seed: accuracy}}``."""
    out = defaultdict(dict)
    for run in runs:
        match = re.fullmatch(r"(.+)_s(\d+)", run["name"])
        value = MEASURES[measure](run)
        if match and value is not None:
            out[match.group(1)][int(match.group(2))] = value
    return dict(out)


def paired_table(runs, reference: str, measure: str = "population") -> str:
    rows = by_row(runs, measure)
    ref = rows.get(reference)
    if not ref:
        return f"Paired comparison skipped: no run named {reference}_s<seed>"
    lines = [f"Paired comparison: row - {reference}, {measure} accuracy per seed (points), 95% Student-t interval "
             "of the mean", "", "| row | seeds | per seed | mean ± 95% CI | finding |", "| --- | --- | --- | --- | --- |"]
    for row, seeds in sorted(rows.items()):
        paired = paired_cells(seeds, ref) if row != reference else None
        if paired:
            cells, mean, half = paired
            lines.append(f"| {row} | {' | '.join(cells)} | {verdict(mean, half, reference)} |")
    return "\n".join(lines)


def worst_step(run) -> float:
    """The largest fall in accuracy from one cached variant to the next larger one (0 when the
    curve never falls): the quick start's ordering check allows at most 1 point."""
    known = [a for a in by_macs(run) if a is not None]
    return max([0.0] + [a - b for a, b in zip(known, known[1:])])


def noise_table(runs, others) -> str:
    rows, again = by_row(runs), by_row(others)
    lines = ["Noise floor: |population accuracy| change of the same row and seed under other arithmetic (points)", "",
             "| row | seeds | per seed | mean | max |", "| --- | --- | --- | --- | --- |"]
    for row, seeds in sorted(rows.items()):
        cells = noise_cells(seeds, again.get(row, {}))
        if cells:
            lines.append(f"| {row} | {' | '.join(cells)} |")
    return "\n".join(lines) if len(lines) > 4 else "Noise floor skipped: no --noise run repeats a row and seed"


def load_extractions(paths) -> list:
    """Extraction results: each file one JSON object (``extract``'s output) or JSON lines.
    A file that is missing or holds anything else raises ConfigError naming it."""
    out = []
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError("--extractions", f"no file at {path}")
        text = Path(path).read_text().strip()
        try:
            items = [json.loads(text)]
        except json.JSONDecodeError:
            try:
                items = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError:
                raise ConfigError("--extractions", f"{path} is neither extract's JSON nor JSON lines") from None
        for item in items:
            if not isinstance(item, dict) or not {"budget", "macs", "test_acc"} <= set(item):
                raise ConfigError("--extractions", f"{path}: every result needs budget, macs and test_acc "
                                                   "(the JSON `extract` prints)")
        out.extend(items)
    return out


def extraction_arch(extraction):
    """The extracted architecture as ``{"d", "e", "w"}``: ``extract``'s own ``d``, ``e`` and
    ``w``, else read from its ``spec`` text (``d=0011 e=(0.1,0.1,0.1,0.1) w=01122``: one digit
    per depth and width gene, as every space here has); None when neither is there."""
    if set("dew") <= set(extraction):
        return {k: extraction[k] for k in "dew"}
    match = re.fullmatch(r"d=(\d+) e=\(([^)]*)\) w=(\d+)", str(extraction.get("spec", "")).strip())
    if not match:
        return None
    return {"d": [int(c) for c in match.group(1)], "e": [float(v) for v in match.group(2).split(",")],
            "w": [int(c) for c in match.group(3)]}


def genes_from_cache(run, extraction):
    """Genes between the extraction and the nearest cached variant of ``run`` (None when either
    side's architecture is unknown)."""
    arch, cached = extraction_arch(extraction), [a for a in run.get("archs") or () if a is not None]
    return nearest_distance(arch, cached) if arch is not None and cached else None


def extraction_gaps(run, extractions) -> list:
    """Per extraction (sorted by MACs): budget, MACs, accuracy, the cached curve at its MACs
    (linear between the two cached variants around it; None outside the cache's span), the
    gap (accuracy minus curve) and the genes from the nearest cached variant."""
    curve = sorted((m, a) for m, a in zip(run["macs"], run["accs"]) if a is not None)
    rows = []
    for e in sorted(extractions, key=lambda e: e["macs"]):
        macs, acc = float(e["macs"]), float(e["test_acc"])
        reference = None
        for (m0, a0), (m1, a1) in zip(curve, curve[1:]):
            if m0 <= macs <= m1:
                reference = a0 if m1 == m0 else a0 + (a1 - a0) * (macs - m0) / (m1 - m0)
                break
        if reference is None and len(curve) == 1 and macs == curve[0][0]:
            reference = curve[0][1]
        rows.append({"budget": float(e.get("budget", macs)), "macs": macs, "acc": acc, "reference": reference,
                     "gap": None if reference is None else acc - reference, "genes": genes_from_cache(run, e)})
    return rows


def mean_abs_gap(rows, low_end=None):
    """Mean |gap| over the rows inside the cache's span (and with budget <= ``low_end``)."""
    gaps = [abs(r["gap"]) for r in rows if r["gap"] is not None and (low_end is None or r["budget"] <= low_end)]
    return (sum(gaps) / len(gaps), len(gaps)) if gaps else (None, 0)


def extractions_by_run(paths, extractions) -> list:
    """The extractions of each run (in ``paths``' order): an extraction belongs to the run folder
    its checkpoint lies in (or, for runs moved since, the run of that folder's name), else to the
    first run; the last result of a repeated budget counts."""
    folders = [Path(p).resolve() for p in paths]
    names = [f.name for f in folders]
    per_run = [{} for _ in paths]
    for e in extractions:
        checkpoint = e.get("checkpoint")
        home = Path(checkpoint).resolve().parent.parent if checkpoint else None
        if home in folders:
            index = folders.index(home)
        else:
            index = names.index(home.name) if home is not None and names.count(home.name) == 1 else 0
        per_run[index][e["budget"]] = e
    return [list(found.values()) for found in per_run]


def extraction_summary(runs, per_run, low_end: float) -> str:
    """Mean |gap| of each run with extractions, and over those runs the mean ± 95% interval."""
    lines = ["Post-hoc extraction over runs: mean |gap| (pp) per run", "",
             "| run | subnets | low end | full range |", "| --- | --- | --- | --- |"]
    low, full = [], []
    for run, extractions in zip(runs, per_run):
        rows = extraction_gaps(run, extractions)
        (lo, _), (all_, n_all) = mean_abs_gap(rows, low_end), mean_abs_gap(rows)
        if all_ is None:
            continue
        lines.append(f"| {run['name']} | {n_all} | {'-' if lo is None else f'{100 * lo:.2f}'} | {100 * all_:.2f} |")
        full.append(100 * all_)
        if lo is not None:
            low.append(100 * lo)
    for title, values in ((f"low end (budget <= {low_end / 1e6:g}M)", low), ("full range", full)):
        if len(values) > 1:
            mean, half = paired_interval(values)
            lines.append(f"mean |gap| {title} over {len(values)} runs: {mean:.2f} ± {half:.2f} pp")
    return "\n".join(lines)


def extraction_table(run, extractions, low_end: float = 52e6) -> str:
    rows = extraction_gaps(run, extractions)
    lines = [f"Post-hoc extraction (Supp. Table 6), {run['name']}: test accuracy % against the interpolated "
             "cached-variant curve",
             f"{'budget':>9} {'MACs':>9} {'acc %':>7} {'curve %':>8} {'gap pp':>7} {'genes':>5}"]
    for r in rows:
        curve = "   -   " if r["reference"] is None else f"{100 * r['reference']:8.2f}"
        gap = "(out of span)" if r["gap"] is None else f"{100 * r['gap']:+7.2f}"
        genes = "-" if r["genes"] is None else r["genes"]
        lines.append(f"{r['budget'] / 1e6:8.2f}M {r['macs'] / 1e6:8.2f}M {100 * r['acc']:7.2f} {curve:>8} "
                     f"{gap:>7} {genes:>5}")
    lines.append("genes: how many genes (depths, expansions, widths) differ from the nearest cached variant")
    for title, bound in ((f"low end (budget <= {low_end / 1e6:g}M)", low_end), ("full range", None)):
        mean, n = mean_abs_gap(rows, bound)
        spread = [r["macs"] for r in rows if r["gap"] is not None and (bound is None or r["budget"] <= bound)]
        span = f"{min(spread) / 1e6:.2f}M-{max(spread) / 1e6:.2f}M" if spread else "-"
        value = "-" if mean is None else f"{100 * mean:.2f}"
        lines.append(f"mean |gap| {title}: {value} pp over {n} subnets ({span})")
    return "\n".join(lines)


def distance_table(runs, per_run) -> str:
    """Over every run's extractions inside its cache's span: the mean gap per number of genes
    from the nearest cached variant (what the supernet trained)."""
    by_genes = defaultdict(list)
    for run, extractions in zip(runs, per_run):
        for r in extraction_gaps(run, extractions):
            if r["gap"] is not None and r["genes"] is not None:
                by_genes[r["genes"]].append(100 * r["gap"])
    if not by_genes:
        return "Gap by distance from the cache: skipped, no extraction with a known architecture in the span"
    lines = ["Post-hoc extraction gap by distance from the cache (genes from the nearest cached variant)", "",
             "| genes | subnets | mean gap (pp) | min | max |", "| --- | --- | --- | --- | --- |"]
    for genes, gaps in sorted(by_genes.items()):
        lines.append(f"| {genes} | {len(gaps)} | {sum(gaps) / len(gaps):+.2f} | {min(gaps):+.2f} | {max(gaps):+.2f} |")
    return "\n".join(lines)


def curves(runs) -> list:
    """``(label, MACs, accuracies)`` to draw: one curve per run, except that the seeds of a row
    (runs named ``<row>_s<seed>`` with the same cache) are drawn as their mean."""
    groups = defaultdict(list)
    for run in runs:
        match = re.fullmatch(r"(.+)_s(\d+)", run["name"])
        groups[(match.group(1) if match else run["name"], tuple(run["macs"]))].append(run)
    out = []
    for (row, macs), members in groups.items():
        first = members[0]
        if len(members) == 1:
            out.append((f"{first['name']} ({first['rule']}, gamma={first['gamma']})", list(macs), first["accs"]))
            continue
        columns = zip(*(member["accs"] for member in members))
        means = [None if None in column else sum(column) / len(column) for column in columns]
        out.append((f"{row} ({first['rule']}, gamma={first['gamma']}; mean of {len(members)} seeds)", list(macs), means))
    return out


def plot(runs, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from fl_lightning.analysis.plots import mac_log_axis

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, macs, accs in curves(runs):
        points = [(m, a) for m, a in zip(macs, accs) if a is not None]
        if points:
            ax.plot([m / 1e6 for m, _ in points], [100 * a for _, a in points], marker="o", markersize=3, label=label)
    mac_log_axis(ax, "inference MACs (millions)", "top-1 test accuracy (%)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def trained_fractions(path: Path) -> list:
    """``(round, trained / routed data mass)`` of every round that logged it (none without a log)."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return []
    rows = (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    return [(row["round"], row["mass/trained_frac"]) for row in rows if "mass/trained_frac" in row]


def mass_table(runs, fractions) -> str:
    """Per run: the share of routed data mass that trained the positions it reached, averaged over
    the rounds, and its first and last round's values (``fractions``: one trained_fractions per run)."""
    lines = ["Trained share of the routed data mass (mass/trained_frac)",
             f"{'run':32s} {'mean':>6s} {'first':>6s} {'last':>6s}"]
    for run, points in zip(runs, fractions):
        shares = [f for _, f in points]
        if shares:
            lines.append(f"{run['name']:32s} {sum(shares) / len(shares):6.3f} {shares[0]:6.3f} {shares[-1]:6.3f}")
    return "\n".join(lines)


def plot_mass(runs, fractions, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {}
    for run, points in zip(runs, fractions):
        first = run["rule"] not in colors  # one legend entry per rule, its seeds in one colour
        color = colors.setdefault(run["rule"], f"C{len(colors)}")
        ax.plot([r for r, _ in points], [f for _, f in points], color=color, linewidth=0.8,
                label=run["rule"] if first else None)
    ax.set_xlabel("round")
    ax.set_ylabel("trained / routed data mass")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--anchors", nargs="*", type=float, default=None,
                        help="MAC anchors (default: the paper's 25, 50, 229, 408, 596M, scaled to the span "
                             "of the runs' caches when it does not reach them)")
    parser.add_argument("--plot", type=Path, default=Path("runs/feast_accuracy_vs_macs.png"))
    parser.add_argument("--extractions", nargs="*", type=Path, default=None,
                        help="extract results (JSON or JSON lines), each of the run its checkpoint lies in: Supp. Table 6")
    parser.add_argument("--low_end", type=float, default=52e6,
                        help="largest requested budget of Supp. Table 6's low end (MACs)")
    parser.add_argument("--reference", default=None,
                        help="row (runs named <row>_s<seed>) the others are compared with, seed by seed")
    parser.add_argument("--noise", nargs="*", type=existing_run, default=None,
                        help="the same rows and seeds under other arithmetic (noise floor)")
    parser.add_argument("--mass", type=Path, default=None,
                        help="plot each run's trained share of the routed data mass per round here")
    args = parser.parse_args(argv)
    if not args.low_end > 0:
        parser.error(f"--low_end: must be a MAC count > 0, got {args.low_end:g}")
    try:
        extractions = load_extractions(args.extractions) if args.extractions else []
    except ConfigError as error:
        parser.error(str(error))
    for option, out in (("plot", args.plot), ("mass", args.mass)):
        try:
            if out is not None:
                check_writable(out, option, folder=False)
        except ConfigError as error:
            parser.error(str(error))
    finished = [path for path in args.runs if (path / "summary.json").is_file() and (path / "cache.json").is_file()]
    for path in sorted(set(args.runs) - set(finished)):
        print(f"skipped {path}: not a finished FEAST run (no summary.json and cache.json)", file=sys.stderr)
    if not finished:
        parser.error("runs: no finished FEAST run among the given paths")
    runs = [load_run(path) for path in finished]
    anchors = args.anchors or default_anchors([m for run in runs for m in run["macs"]])
    print(rule_table(runs, anchors))
    print()
    print(variant_table(runs))
    print()
    print(gamma_table(runs))
    if args.reference:
        for measure in MEASURES:
            print()
            print(paired_table(runs, args.reference, measure))
    if args.noise:
        print()
        print(noise_table(runs, [load_run(path) for path in args.noise if (path / "summary.json").is_file()]))
    if args.extractions:
        per_run = extractions_by_run(finished, extractions)
        for run, extractions in zip(runs, per_run):
            if extractions:
                print()
                print(extraction_table(run, extractions, args.low_end))
        if sum(bool(e) for e in per_run) > 1:
            print()
            print(extraction_summary(runs, per_run, args.low_end))
        print()
        print(distance_table(runs, per_run))
    if args.mass:
        print()
        fractions = [trained_fractions(path) for path in finished]
        print(mass_table(runs, fractions))
        plot_mass(runs, fractions, args.mass)
        print(f"\nsaved {args.mass}")
    plot(runs, args.plot)
    print(f"\nsaved {args.plot}")


if __name__ == "__main__":
    main()
