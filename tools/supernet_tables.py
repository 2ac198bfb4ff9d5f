"""Tables and figure of the supernet comparison (FEAST Tables 1, 3, 5, 7-8, 11, 12; Fig. 3).

    python tools/supernet_tables.py RUN [RUN ...] [--figure PATH] [--anchors A ...] [--noise RUN ...]

Every RUN is a run directory (or a folder of them) of FEAST, its SuperFedNAS / DeepFedNAS
transfers, ScaleFL, FIARSE or HeteroFL, read into one form by ``analysis/serving.py``. Runs are
grouped by population setting (dataset, clients, budget range, Zipf s, alpha_eff or alpha_data,
gamma: ``config.yaml``) and by method; seeds are averaged as mean ± std (sample std) and FEAST
is compared with a baseline seed by seed, client by client. A group's original horizon is its
FEAST runs' round count; baseline runs of other round counts are its equal-compute reruns.

Prints, where the runs exist (otherwise one line saying what is missing):

- Table 4 (Supp.): each method's native deployment structure, its number of operating points
  and their MAC range (smallest to largest point);
- Table 1: population accuracy under largest-affordable serving per method; Δbest is FEAST
  minus the strongest baseline (paired over seeds);
- the paired comparison: FEAST minus every other method seed by seed, with the 95% Student-t
  interval of the mean and what it shows (a finding only when the interval excludes zero);
- with ``--noise RUN ...``, the noise floor: the same methods and seeds run under other
  arithmetic (e.g. ``--fabric.threads_per_rank 2``), the population accuracy's absolute change;
- Sec. 4.2's ranges: per method, the accuracy change from its smallest to its largest point
  across the shared range (points of at least the first anchor, the paper's 25M);
- Table 3: the transfers and FEAST at the budget anchors, and FEAST minus each transfer on the
  same seed at every anchor (95% interval);
- Table 5: the serving-density control against each fixed-tier baseline;
- Tables 7-8: the training proxies, the matched horizon R' and, once the reruns exist, their
  accuracy, FEAST's margin (mean ± std and the paired 95% interval over seeds) and client wins
  (with the commands that produce the reruns);
- Tables 11-12: the Zipf-s and alpha sweeps at the anchors with the first-to-last change (FEAST
  against FIARSE in Table 12), and paired on the same seed (95% intervals): each anchor's gain
  over the first (below zero: an inverted curve), each value against the sweep's first, and
  FEAST minus FIARSE;

and with ``--figure`` draws accuracy against served MACs for every method (log x).
docs/supernet_comparison.md defines every number.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from fl_lightning.algorithms.supernet.feast_accounting import default_anchors, human
from fl_lightning.analysis.serving import RunFormatError, ServingRun, load_run
from fl_lightning.analysis.serving_controls import (anchor_row, compare_clients, density_runs, end_to_end_change,
                                                   horizon_command, matched_rounds, range_ends, same_population)
from fl_lightning.tool_parser import ToolParser, existing_run
from submodel_tables import noise_cells, paired_cells, paired_interval, verdict

BASELINES = ("HeteroFL", "ScaleFL", "FIARSE")
TIERED = ("HeteroFL", "ScaleFL")
TRANSFERS = ("SFN, unconstrained", "DFN, unconstrained", "SFN, constrained", "DFN, constrained")
SETTING = (("dataset", None), ("N", "partition.num_clients"), ("b_min", "partition.budgets.b_min"),
           ("b_max", "partition.budgets.b_max"), ("s", "partition.budgets.zipf_s"), ("alpha", None),
           ("gamma", "partition.gamma"))
"""What makes a population: runs that agree on all of these serve the same kind of clients."""


# -- grouping ---------------------------------------------------------------------------------

def alpha_of(run: ServingRun) -> str:
    """alpha_eff when the run matched it, else its alpha_data."""
    eff = run.get("partition.alpha_eff")
    return f"alpha_eff={eff:g}" if eff is not None else f"alpha_data={float(run.get('partition.alpha', 0)):g}"


def setting_of(run: ServingRun, drop=()) -> tuple:
    out = []
    for name, key in SETTING:
        if name in drop:
            continue
        value = {"alpha": alpha_of, "dataset": lambda r: r.dataset}.get(name, lambda r: r.get(key))(run)
        out.append((name, value))
    return tuple(out)


def label(setting: tuple) -> str:
    d = dict(setting)
    parts = [str(d.get("dataset"))]
    if "N" in d:
        parts.append(f"N={d['N']}")
    if "b_min" in d:
        parts.append(f"budgets {human(d['b_min'])}-{human(d['b_max'])}")
    parts += [f"s={d['s']:g}"] if "s" in d else []
    parts += [d["alpha"]] if "alpha" in d else []
    parts += [f"gamma={d['gamma']:g}"] if "gamma" in d else []
    return ", ".join(parts)


class Group:
    """The runs of one setting: by method, by seed; originals and the baselines' reruns at other
    horizons (Table 8's matched ones) apart."""

    def __init__(self, runs: List[ServingRun]):
        feast_rounds = [r.rounds for r in runs if r.method == "FEAST"]
        self.horizon = min(feast_rounds) if feast_rounds else min(r.rounds for r in runs)
        self.original: Dict[str, Dict[int, ServingRun]] = defaultdict(dict)
        self.reruns: Dict[str, Dict[int, List[ServingRun]]] = defaultdict(lambda: defaultdict(list))
        self.notes: List[str] = []
        for run in sorted(runs, key=lambda r: str(r.path)):
            if run.rounds == self.horizon:
                if run.seed in self.original[run.method]:
                    self.notes.append(f"{run.name}: a second {run.method} run of seed {run.seed}, ignored")
                    continue
                self.original[run.method][run.seed] = run
            elif run.method != "FEAST":
                self.reruns[run.method][run.seed].append(run)
            else:
                self.notes.append(f"{run.name}: {run.rounds} rounds against the group's {self.horizon}, ignored")

    def methods(self, names) -> List[str]:
        return [m for m in names if self.original.get(m)]

    def all_runs(self) -> List[ServingRun]:
        return [r for seeds in self.original.values() for r in seeds.values()]


def group_runs(runs: List[ServingRun], drop=()) -> Dict[tuple, List[ServingRun]]:
    out: Dict[tuple, List[ServingRun]] = defaultdict(list)
    for run in runs:
        out[setting_of(run, drop)].append(run)
    return dict(out)


# -- formatting -------------------------------------------------------------------------------

def pm(values, scale=100.0, digits=2) -> str:
    """mean ± sample std; a dash for no values; no ± for one."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64) * scale
    if v.size == 0 or np.isnan(v).all():
        return "–"
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def pm_macs(values) -> str:
    """mean ± sample std of MAC totals at a readable scale."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return "–"
    return human(v.mean()) + (f" ± {human(v.std(ddof=1))}" if v.size > 1 else "")


def table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def wins_text(counts: List[Dict[str, int]]) -> str:
    """Wins summed over seeds, out of the clients compared (ties shown when there are any)."""
    if not counts:
        return "–"
    wins, ties, total = (sum(c[k] for c in counts) for k in ("wins", "ties", "clients"))
    return f"{wins}/{total}" + (f" ({ties} ties)" if ties else "")


def anchors_for(runs: List[ServingRun], given: Optional[List[float]]) -> List[float]:
    """The paper's anchors, scaled to the span of the FEAST caches among ``runs`` (any run's
    points when none has a cache) unless ``--anchors`` gave them."""
    if given:
        return list(given)
    cached = [r for r in runs if r.kind in ("feast", "transfer")] or runs
    return default_anchors([float(m) for r in cached for m in r.point_macs])


def anchor_header(anchors) -> List[str]:
    return [f"{human(a)}" for a in anchors]


# -- tables -----------------------------------------------------------------------------------

STRUCTURE = {"feast": "cached variants", "transfer": "cached variants", "heterofl": "width tiers",
             "scalefl": "depth-width levels", "fiarse": "mask grid points"}
"""What a method's operating points are, by adapter (Supp. Table 4's deployment structure)."""


def deployment_ranges(runs: List[ServingRun]) -> List[dict]:
    """Supp. Table 4: per method, in order of first appearance, the structure, the number of
    native operating points (a range when runs differ) and the smallest and largest point's
    MACs over all its runs."""
    out: Dict[str, dict] = {}
    for run in runs:
        macs = [float(p.macs) for p in run.points]
        if not macs:
            continue
        row = out.setdefault(run.method, {"method": run.method, "structure": STRUCTURE.get(run.kind, run.kind),
                                          "counts": set(), "low": min(macs), "high": max(macs)})
        row["counts"].add(len(macs))
        row["low"], row["high"] = min(row["low"], min(macs)), max(row["high"], max(macs))
    return list(out.values())


def table4(runs: List[ServingRun]) -> str:
    rows = []
    for r in deployment_ranges(runs):
        lo, hi = min(r["counts"]), max(r["counts"])
        count = str(lo) if lo == hi else f"{lo}-{hi}"
        rows.append([r["method"], f"{count} {r['structure']}", f"{human(r['low'])}-{human(r['high'])}"])
    if not rows:
        return "Table 4 skipped: no run has measured operating points."
    return "\n".join(["Table 4 (Supp.): native deployment structures and MAC ranges (served MACs per example)", "",
                      table(["method", "deployment structure", "MAC range"], rows)])


def table1(groups: Dict[tuple, Group]) -> str:
    rows, notes = [], []
    for setting, g in groups.items():
        if not g.original.get("FEAST") or not g.methods(BASELINES):
            continue
        feast = g.original["FEAST"]
        row = [label(setting)]
        means = {}
        for method in BASELINES + ("FEAST",):
            seeds = g.original.get(method, {})
            row.append(pm([r.population_acc for r in seeds.values()]) if seeds else "–")
            if seeds and method != "FEAST":
                means[method] = np.mean([r.population_acc for r in seeds.values()])
        best = max(means, key=means.get)
        common = sorted(set(feast) & set(g.original[best]))
        row.append(pm([feast[s].population_acc - g.original[best][s].population_acc for s in common]) + f" ({best})")
        rows.append(row)
        for method in g.methods(BASELINES):
            fb = [int(r.fallback.sum()) for r in g.original[method].values()]
            if any(fb):
                clients = next(iter(g.original[method].values())).num_clients
                notes.append(f"{label(setting)}: {method} serves {pm(fb, 1, 1)} of {clients} clients its smallest "
                             f"point as the minimum-tier fallback")
    if not rows:
        return "Table 1 skipped: no setting has FEAST and a HeteroFL, ScaleFL or FIARSE run."
    out = ["Table 1: population accuracy (%) under largest-affordable serving; Δbest = FEAST - strongest baseline "
           "(paired over seeds)", "",
           table(["setting", *BASELINES, "FEAST", "Δbest"], rows)]
    return "\n".join(out + [""] + notes if notes else out)


def population(seeds: Dict[int, ServingRun]) -> Dict[int, float]:
    return {s: run.population_acc for s, run in seeds.items()}


def paired_table(groups: Dict[tuple, Group]) -> str:
    """FEAST minus each other method of its setting, population accuracy seed by seed (points),
    the mean with its 95% interval, and the finding."""
    rows = []
    for setting, g in groups.items():
        feast = g.original.get("FEAST")
        for method, seeds in g.original.items() if feast else ():
            paired = paired_cells(population(feast), population(seeds)) if method != "FEAST" else None
            if paired:
                cells, mean, half = paired
                rows.append([label(setting), method, *cells, f"FEAST {verdict(mean, half, method)}"])
    if not rows:
        return "Paired comparison skipped: no setting has FEAST and another method on a common seed."
    return "\n".join(["Paired comparison: FEAST - method, population accuracy per seed (points), 95% Student-t "
                      "interval of the mean", "",
                      table(["setting", "method", "seeds", "per seed", "mean ± 95% CI", "finding"], rows)])


def noise_table(groups: Dict[tuple, Group], other: Dict[tuple, Group]) -> str:
    """The same setting, method and seed under other arithmetic: the population accuracy's
    absolute change (points), the spread one run carries."""
    rows = []
    for setting, g in groups.items():
        for method, seeds in g.original.items():
            again = other[setting].original.get(method, {}) if setting in other else {}
            cells = noise_cells(population(seeds), population(again))
            if cells:
                rows.append([label(setting), method, *cells])
    if not rows:
        return "Noise floor skipped: no run of --noise repeats a setting, method and seed of the runs."
    return "\n".join(["Noise floor: |population accuracy| change of the same setting, method and seed under other "
                      "arithmetic (points)", "", table(["setting", "method", "seeds", "per seed", "mean", "max"], rows)])


def ranges_table(groups: Dict[tuple, Group], given_anchors) -> str:
    """Sec. 4.2: each method's smallest-to-largest accuracy change (points) over the shared range,
    from the first anchor up, with the accuracies at both ends; mean ± std over seeds."""
    parts = []
    for setting, g in groups.items():
        runs = g.all_runs()
        if not runs:
            continue
        low = anchors_for(runs, given_anchors)[0]
        rows = []
        for method, seeds in g.original.items():
            ends = [e for e in (range_ends(r.point_macs, r.point_accs, low) for r in seeds.values()) if e is not None]
            rows.append([method, str(len(seeds)), pm([e[0] for e in ends]), pm([e[1] for e in ends]),
                         pm([e[1] - e[0] for e in ends])])
        parts.append(f"{label(setting)} (shared range from {human(low)})\n\n"
                     + table(["method", "seeds", "smallest point", "largest point", "change"], rows))
    return "Sec. 4.2: smallest-to-largest accuracy (%) across the shared range and its change (points)\n\n" \
        + "\n\n".join(parts)


def table3(runs: List[ServingRun], given_anchors) -> str:
    families = group_runs(runs, drop=("gamma",))
    parts = []
    for setting, members in families.items():
        present = [m for m in TRANSFERS if any(r.method == m for r in members)]
        if not present:
            continue
        anchors = anchors_for(members, given_anchors)
        rows = []
        for method in present + ["FEAST"]:
            by_gamma = defaultdict(list)
            for r in members:
                if r.method == method:
                    by_gamma[r.get("partition.gamma")].append(r)
            for gamma, rs in sorted(by_gamma.items()):
                cells = [anchor_row(r, anchors) for r in rs]
                rows.append([f"{method} (gamma={gamma:g}, {len(rs)} seed{'s' * (len(rs) > 1)})"]
                            + [pm([c[i] for c in cells]) for i in range(len(anchors))])
        parts.append(f"{label(setting)}\n\n" + table(["method", *anchor_header(anchors)], rows))
        feast = rows_by_seed([r for r in members if r.method == "FEAST" and r.get("partition.gamma") == 1.0], anchors)
        paired = []
        for method in present if feast else ():
            for gamma in sorted({r.get("partition.gamma") for r in members if r.method == method}):
                rs = [r for r in members if r.method == method and r.get("partition.gamma") == gamma]
                cells = paired_anchor_cells(feast, rows_by_seed(rs, anchors))
                if cells:
                    paired.append([f"FEAST - {method} (gamma={gamma:g})", str(cells[0]), *cells[1],
                                   findings_text(cells[2])])
        if paired:
            parts.append(paired_anchor_table("Paired: FEAST (gamma=1) minus each transfer on the same seed, points, "
                                             "mean ± 95% Student-t interval", paired, anchors))
    if not parts:
        return "Table 3 skipped: no SuperFedNAS / DeepFedNAS transfer runs."
    return "Table 3: transfers at the budget anchors, test accuracy (%) of the largest point within each anchor\n\n" \
        + "\n\n".join(parts)


def table5(groups: Dict[tuple, Group]) -> str:
    parts = []
    header = ["aligned with", "FEAST subset (M MACs)", "FEAST full", "FEAST matched", "baseline native", "full margin",
              "density", "residual margin", "retained %", "wins (matched)", "wins (full)"]
    for setting, g in groups.items():
        feast = g.original.get("FEAST")
        if not feast:
            continue
        rows = []
        for method in g.methods(TIERED):
            base = g.original[method]
            results = [density_runs(feast[s], base[s]) for s in sorted(set(feast) & set(base))
                       if same_population(feast[s], base[s])]
            if not results:
                continue
            subset = "/".join(f"{m / 1e6:.2f}" for m in results[0]["subset_macs"])
            cells = [pm([r[key] for r in results]) for key in ("full", "matched", "baseline", "full_margin", "density",
                                                                "residual")]
            rows.append([method, subset, *cells, pm([r["retained"] for r in results], 100, 1),
                         wins_text([r["wins_matched"] for r in results]), wins_text([r["wins_full"] for r in results])])
        if rows:
            parts.append(f"{label(setting)}\n\n" + table(header, rows))
    if not parts:
        return "Table 5 skipped: no setting has FEAST and a HeteroFL or ScaleFL run of the same population."
    return "Table 5: serving-density control; accuracies (%) and margins (points); density = full - matched\n\n" \
        + "\n\n".join(parts)


def horizon_row(g: Group, method: str, feast: Dict[int, ServingRun], common: List[int]):
    """One Table 8 row (matched horizon, reruns' accuracy, margin, wins) and the commands of the
    reruns still missing."""
    base = g.original[method]
    horizons, matched, margins, wins, missing = set(), {}, [], [], []
    for s in common:
        r_new = matched_rounds(g.horizon, feast[s].proxy, base[s].proxy)
        horizons.add(r_new)
        if r_new == g.horizon:  # the original run already spends FEAST's compute
            rerun = base[s]
        else:
            rerun = next((r for r in g.reruns.get(method, {}).get(s, []) if r.rounds == r_new), None)
        if rerun is None:
            missing.append(horizon_command(base[s], r_new))
            continue
        matched[s] = rerun.population_acc
        margins.append(feast[s].population_acc - rerun.population_acc)
        if same_population(feast[s], rerun):
            wins.append(compare_clients(feast[s], rerun))
    paired = paired_cells({s: feast[s].population_acc for s in matched}, matched)
    interval = "–" if paired is None else f"{paired[0][2]} ({verdict(paired[1], paired[2], method)})"
    row = [method, str(g.horizon), "/".join(map(str, sorted(horizons))), pm([base[s].population_acc for s in common]),
           pm(list(matched.values())), pm(margins), interval, wins_text(wins)]
    return row, missing


def table8(groups: Dict[tuple, Group]) -> str:
    parts, commands = [], []
    for setting, g in groups.items():
        feast = g.original.get("FEAST")
        if not feast or any(r.proxy is None for r in feast.values()):
            continue
        feast_proxy = pm_macs([r.proxy for r in feast.values()])
        proxies, rows = [["FEAST", feast_proxy, feast_proxy, "1.00"]], []
        for method in g.methods(BASELINES):
            base = g.original[method]
            common = [s for s in sorted(set(feast) & set(base)) if base[s].proxy]
            if not common:
                continue
            executed = [base[s].proxy for s in common]
            logical = [base[s].proxy_logical for s in common if base[s].proxy_logical is not None] or executed
            proxies.append([method, pm_macs(logical), pm_macs(executed),
                            pm([feast[s].proxy / base[s].proxy for s in common], 1, 2)])
            row, missing = horizon_row(g, method, feast, common)
            rows.append(row)
            commands += missing
        if rows:
            feast_acc = pm([r.population_acc for r in feast.values()])
            parts.append(f"{label(setting)}\n\nTable 7: expected training proxies (MACs: kappa x forward MACs x "
                         f"shard sizes x epochs x expected participations)\n\n"
                         + table(["method", "logical", "executed", "FEAST / executed"], proxies)
                         + f"\n\nTable 8: equal-total-training-compute horizon (FEAST {feast_acc}%)\n\n"
                         + table(["method", "orig. rounds", "matched rounds", "orig. acc", "matched acc", "margin",
                                  "FEAST - matched, 95% CI", "wins"], rows))
    if not parts:
        return "Tables 7-8 skipped: no setting has a FEAST run with accounting.json and a baseline run."
    out = "\n\n".join(parts)
    if commands:
        out += "\n\nMatched-horizon reruns still to run (then pass their folders too):\n" + "\n".join(
            f"  {c}" for c in commands)
    return out


def mean_cells(rows: List[List[Optional[float]]]) -> List[Optional[float]]:
    """Seed mean per anchor (None where no seed has a point within the anchor)."""
    out = []
    for column in zip(*rows):
        values = [v for v in column if v is not None]
        out.append(float(np.mean(values)) if values else None)
    return out


def anchor_comparison(value, method: str, feast: List[Optional[float]], other: List[Optional[float]]) -> str:
    """How many anchors FEAST's seed mean leads at, and its margin at the last anchor."""
    pairs = [(f, b) for f, b in zip(feast, other) if f is not None and b is not None]
    text = f"{value}: FEAST ahead of {method} at {sum(f > b for f, b in pairs)}/{len(pairs)} anchors"
    if feast[-1] is not None and other[-1] is not None:
        text += f", by {100 * (feast[-1] - other[-1]):.2f} points at the last"
    return text


def one_per_seed(runs: List[ServingRun]) -> List[ServingRun]:
    """The first run of each seed (one overlay can reproduce another's population: zipf_s1p2 is
    alpha_0p1, and a seed counted twice would shrink the spread)."""
    seen, kept = set(), []
    for r in runs:
        if r.seed not in seen:
            seen.add(r.seed)
            kept.append(r)
    return kept


def rows_by_seed(runs: List[ServingRun], anchors) -> Dict[int, List[Optional[float]]]:
    """Each seed's accuracies at the anchors and, last, its first-to-last change."""
    out = {}
    for r in one_per_seed(runs):
        row = anchor_row(r, anchors)
        out[r.seed] = row + [end_to_end_change(row)]
    return out


def paired_anchor_cells(these: Dict[int, list], reference: Dict[int, list]) -> Optional[tuple]:
    """``these - reference`` seed by seed at every column (the anchors, then the change), on the
    seeds where both have a value: ``(seeds, cells, findings)`` with each cell ``mean ± 95% CI``
    in points and each finding ``+`` (interval above zero), ``-`` (below), ``0`` (spans zero, or
    fewer than two seeds) or None (no value); None without a common seed."""
    common = sorted(set(these) & set(reference))
    if not common:
        return None
    cells, findings = [], []
    for j in range(len(these[common[0]])):
        d = [100 * (these[s][j] - reference[s][j]) for s in common
             if these[s][j] is not None and reference[s][j] is not None]
        if not d:
            cells.append("–")
            findings.append(None)
            continue
        mean, half = paired_interval(d)
        cells.append(f"{mean:+.1f} ± {half:.1f}" if np.isfinite(half) else f"{mean:+.1f}")
        findings.append("0" if not np.isfinite(half) else "+" if mean - half > 0 else "-" if mean + half < 0 else "0")
    return len(common), cells, findings


def findings_text(findings: List[str]) -> str:
    """How many anchors' intervals lie above zero, below it, or span it (the change column aside)."""
    anchors = [f for f in findings[:-1] if f is not None]
    return f"{anchors.count('+')} above, {anchors.count('-')} below, {anchors.count('0')} not detectable"


def anchor_gains(by_seed: Dict[int, list]) -> Dict[int, list]:
    """Each seed's accuracy at every anchor above the first minus at the first (None at the
    first) and its change: paired against zero, an anchor whose interval lies below zero inverts
    the curve (Table 11: "every higher-budget anchor exceeds the 25M result")."""
    out = {}
    for seed, row in by_seed.items():
        first = row[0]
        gains = [None] + [a - first if a is not None and first is not None else None for a in row[1:-1]]
        out[seed] = gains + [row[-1]]
    return out


def zeros_like(by_seed: Dict[int, list]) -> Dict[int, list]:
    return {seed: [0.0] * len(row) for seed, row in by_seed.items()}


def paired_anchor_table(title: str, rows: List[List[str]], anchors) -> str:
    return "\n".join([title, "", table(["comparison", "seeds", *anchor_header(anchors), "change", "anchors"], rows)])


def sweep_table(runs: List[ServingRun], key: str, methods, title: str, given_anchors) -> str:
    """Anchors and first-to-last change per value of ``key`` ('s' or 'alpha') and method, for
    every family of settings that differ only in ``key``; next to FEAST, the anchors at which it
    leads each other method and its margin at the last anchor."""
    parts = []
    for setting, members in group_runs(runs, drop=(key,)).items():
        members = [r for r in members if r.method in methods]
        values = sorted({dict(setting_of(r))[key] for r in members})
        if len(values) < 2:
            continue
        horizon = min(r.rounds for r in members)
        anchors = anchors_for(members, given_anchors)
        rows, comparisons, paired = [], [], []
        seeds = {}  # (method, value) -> {seed: anchor accuracies + change}
        for value in values:
            means = {}
            for method in methods:
                rs = one_per_seed([r for r in members if r.method == method and dict(setting_of(r))[key] == value
                                   and r.rounds == horizon])
                if not rs:
                    continue
                seeds[method, value] = by_seed = rows_by_seed(rs, anchors)
                cells = [row[:-1] for row in by_seed.values()]
                means[method] = mean_cells(cells)
                rows.append([str(value), method, str(len(by_seed)), *(pm(column) for column in zip(*cells)),
                             pm([row[-1] for row in by_seed.values()])])
            comparisons += [anchor_comparison(value, m, means["FEAST"], means[m]) for m in means
                            if m != "FEAST" and "FEAST" in means]
        name = (lambda v: f"s={v:g}") if key == "s" else str
        for (method, value), by_seed in seeds.items():  # inversions: an anchor below the first
            cells = paired_anchor_cells(anchor_gains(by_seed), zeros_like(by_seed))
            paired.append([f"{method} {name(value)}: gain over the first anchor", str(cells[0]), *cells[1],
                           findings_text(cells[2])])
        for (method, value), by_seed in seeds.items():  # the sweep's effect: against its first value
            first = seeds.get((method, values[0]))
            cells = paired_anchor_cells(by_seed, first) if value != values[0] and first else None
            if cells:
                paired.append([f"{method} {name(value)} - {name(values[0])}", str(cells[0]), *cells[1],
                               findings_text(cells[2])])
        for (method, value), by_seed in seeds.items():  # FEAST against the other methods
            feast = seeds.get(("FEAST", value))
            cells = paired_anchor_cells(feast, by_seed) if method != "FEAST" and feast else None
            if cells:
                paired.append([f"FEAST - {method} at {name(value)}", str(cells[0]), *cells[1],
                               findings_text(cells[2])])
        parts.append(f"{label(setting)}\n\n" + table([key, "method", "seeds", *anchor_header(anchors), "change"], rows)
                     + ("\n\n" + "\n".join(comparisons) if comparisons else "")
                     + "\n\n" + paired_anchor_table("Paired on the same seed, points, mean ± 95% Student-t interval; "
                                                    "anchors: intervals above zero, below, spanning it", paired,
                                                    anchors))
    if not parts:
        return f"{title.split(':')[0]} skipped: no family of runs with two or more values of {key}."
    return f"{title}\n\n" + "\n\n".join(parts)


# -- figure -----------------------------------------------------------------------------------

def figure(groups: Dict[tuple, Group], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from fl_lightning.analysis.plots import mac_log_axis

    shown = [(s, g) for s, g in groups.items() if g.original]
    cols = min(3, len(shown))
    rows = -(-len(shown) // cols)
    fig = Figure(figsize=(5 * cols, 3.8 * rows))
    FigureCanvasAgg(fig)
    for i, (setting, g) in enumerate(shown, start=1):
        ax = fig.add_subplot(rows, cols, i)
        for method, seeds in sorted(g.original.items()):
            rs = list(seeds.values())
            n = min(len(r.points) for r in rs)
            macs = np.mean([r.point_macs[:n] for r in rs], axis=0)
            accs = np.nanmean([r.point_accs[:n] for r in rs], axis=0)
            order = np.argsort(macs)
            ax.plot(macs[order] / 1e6, 100 * accs[order], marker="o", markersize=3, label=f"{method} ({len(rs)})")
        ax.set_title(label(setting), fontsize=8)
        mac_log_axis(ax, "served MACs (millions, each method's convention)", "test accuracy (%)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


# -- entry ------------------------------------------------------------------------------------

def expand(paths: List[Path]) -> List[Path]:
    """Run folders, with a folder of runs standing for the runs inside it."""
    out = []
    for path in paths:
        if (path / "config.yaml").is_file() or not path.is_dir():
            out.append(path)
        else:
            out += sorted(p for p in path.iterdir() if (p / "config.yaml").is_file())
    return out


def load_all(paths: List[Path]) -> List[ServingRun]:
    runs = []
    for path in expand(paths):
        try:
            runs.append(load_run(path))
        except (RunFormatError, OSError, KeyError, ValueError) as error:
            print(f"skipped {path}: {error}")
    return runs


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=existing_run, help="run directories (or folders of them)")
    parser.add_argument("--figure", type=Path, default=None, help="write accuracy against MACs here (PNG)")
    parser.add_argument("--anchors", type=float, nargs="+", default=None,
                        help="budget anchors in MACs (default: 25, 50, 229, 408, 596M, scaled to a CPU-sized cache)")
    parser.add_argument("--noise", type=existing_run, nargs="+", default=None,
                        help="the same methods and seeds under other arithmetic (noise floor)")
    args = parser.parse_args(argv)
    runs = load_all(args.runs)
    if not runs:
        parser.error("runs: no readable run among the paths given")
    groups = {s: Group(rs) for s, rs in group_runs(runs).items()}
    for r in runs:
        for note in r.notes:
            print(f"note {r.name}: {note}")
    for g in groups.values():
        for note in g.notes:
            print(f"note {note}")
    sections = [table4(runs), table1(groups), paired_table(groups)]
    if args.noise:
        sections.append(noise_table(groups, {s: Group(rs) for s, rs in group_runs(load_all(args.noise)).items()}))
    sections += [ranges_table(groups, args.anchors), table3(runs, args.anchors), table5(groups), table8(groups),
                 sweep_table(runs, "s", ("FEAST",), "Table 11: FEAST across the Zipf exponent s, test accuracy (%) at "
                                                    "the anchors and the first-to-last change (points)", args.anchors),
                 sweep_table(runs, "alpha", ("FEAST", "FIARSE"), "Table 12: FEAST and FIARSE across the label skew, "
                             "test accuracy (%) at the anchors and the first-to-last change (points)", args.anchors)]
    print("\n\n".join(sections))
    if args.figure is not None:
        figure(groups, args.figure)
        print(f"\nsaved {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
