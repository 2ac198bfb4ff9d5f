"""tools/feast_report.py's post-hoc extraction table (Supp. Table 6) on a hand-made run and
hand-made extraction results, the gaps worked out by hand."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import feast_report as tool  # noqa: E402

# cached curve (MACs, accuracy), given out of order and with one variant not scored:
# 10M 50%, 20M 60%, 40M 80%
RUN = {"name": "toy", "macs": [40e6, 10e6, 30e6, 20e6], "accs": [0.8, 0.5, None, 0.6]}
EXTRACTIONS = [
    {"budget": 60e6, "macs": 40e6, "test_acc": 0.80},  # on the last cached point: gap 0
    {"budget": 16e6, "macs": 15e6, "test_acc": 0.57},  # curve 55% (halfway 10M-20M): +2 pp
    {"budget": 30e6, "macs": 30e6, "test_acc": 0.66},  # curve 70% (halfway 20M-40M): -4 pp
    {"budget": 90e6, "macs": 50e6, "test_acc": 0.90},  # beyond the cache: no curve
]


def test_gaps_against_the_interpolated_cached_curve():
    rows = tool.extraction_gaps(RUN, EXTRACTIONS)
    assert [r["macs"] for r in rows] == [15e6, 30e6, 40e6, 50e6]
    assert [r["reference"] for r in rows[:3]] == pytest.approx([0.55, 0.70, 0.80], abs=1e-12)
    assert [r["gap"] for r in rows[:3]] == pytest.approx([0.02, -0.04, 0.0], abs=1e-12)
    assert rows[3]["reference"] is None and rows[3]["gap"] is None
    # low end: budgets up to 35M (the 16M and 30M subnets); full range: the three inside the span
    assert tool.mean_abs_gap(rows, 35e6) == pytest.approx((0.03, 2), abs=1e-12)
    assert tool.mean_abs_gap(rows) == pytest.approx((0.02, 3), abs=1e-12)
    assert tool.mean_abs_gap(rows, 1e6) == (None, 0)


def test_rule_table_serves_the_largest_variant_within_each_anchor():
    """Table 2's anchors follow Tables 1 and 3: a client of budget B gets the largest cached
    variant of at most B MACs (18M: the 10M variant, not the nearer 20M one; 5M: none)."""
    table = tool.rule_table([{**RUN, "rule": "full", "population": 0.7}], [5e6, 10e6, 18e6, 45e6])
    row = table.splitlines()[-1].split()
    assert row[:2] == ["toy", "full"]
    assert row[2:] == ["-", "50.00", "50.00", "80.00", "70.00", "0.00"]  # 50, 60, (30M unscored), 80: no fall


def test_default_anchors_are_the_papers_placed_in_the_runs_cache_span(tmp_path, capsys):
    """Without --anchors, Table 2 takes the anchors Tables 1, 3, 11 and 12 take: the paper's 25,
    50, 229, 408, 596M at their relative log-MAC positions in the caches' span (here 10M-40M,
    by hand: 10M x 4^t, t = log(a / 25M) / log(596M / 25M)); the per-variant table lists every
    cached variant in MAC order."""
    import math

    run = write_toy_run(tmp_path / "toy")
    tool.main([str(run), "--plot", str(tmp_path / "plot.png")])
    out = capsys.readouterr().out.splitlines()
    expected = [10e6 * 4 ** (math.log(a / 25) / math.log(596 / 25)) for a in (25, 50, 229, 408, 596)]
    header = next(line for line in out if line.startswith("run ") and "population" in line).split()
    assert [float(h.rstrip("M")) for h in header[2:7]] == pytest.approx([a / 1e6 for a in expected], abs=0.006)
    row = out[out.index(next(line for line in out if line.startswith("Training rule"))) + 2].split()
    # 13.5M serves the 10M variant, 26.3M the 20M one, 33.8M the unscored 30M one
    assert row[2:7] == ["50.00", "50.00", "60.00", "-", "80.00"]
    variants = out[out.index("Per cached variant: test accuracy %") + 1:][:2]
    assert variants[0].split()[2:] == ["10.00M", "20.00M", "30.00M", "40.00M"]
    assert variants[1].split()[2:] == ["50.00", "60.00", "-", "80.00"]


def write_toy_run(run: Path, config: dict = None) -> Path:
    """A finished run folder holding RUN's cached curve (population 60%)."""
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"final": {
        "test_acc": 0.6, **{f"test_variant{j:02d}_acc": a for j, a in enumerate(RUN["accs"]) if a is not None}}}))
    (run / "cache.json").write_text(json.dumps({"variants": [{"macs": m} for m in RUN["macs"]]}))
    (run / "config.yaml").write_text(yaml.safe_dump(config or {"partition": {"gamma": 1.0}}))
    return run


def test_report_prints_table_6_from_saved_files(tmp_path, capsys):
    run = write_toy_run(tmp_path / "toy", {"partition": {"gamma": 1.0}, "algorithm": {"init_args": {"rule": "full"}}})
    single = tmp_path / "e0.json"
    single.write_text(json.dumps(EXTRACTIONS[0], indent=2))  # extract's own output
    lines = tmp_path / "rest.jsonl"
    lines.write_text("\n".join(json.dumps(e) for e in EXTRACTIONS[1:]))
    tool.main([str(run), "--plot", str(tmp_path / "plot.png"), "--extractions", str(single), str(lines),
               "--low_end", "35e6"])
    out = capsys.readouterr().out
    assert "mean |gap| low end (budget <= 35M): 3.00 pp over 2 subnets (15.00M-30.00M)" in out
    assert "mean |gap| full range: 2.00 pp over 3 subnets (15.00M-40.00M)" in out
    assert "(out of span)" in out and (tmp_path / "plot.png").is_file()


def test_paired_rows_and_noise_floor_by_run_name():
    """Runs named <row>_s<seed>: each row minus the reference on their common seeds, the 95%
    interval of scipy's paired t-test and the finding; the noise floor's absolute changes."""
    from scipy import stats

    def run(name, population):
        return {"name": name, "population": population}

    full, max_only = [0.95, 0.96, 0.94], [0.70, 0.66, 0.75]
    runs = ([run(f"full_s{s}", a) for s, a in enumerate(full)] + [run(f"max_only_s{s}", a) for s, a in enumerate(max_only)]
            + [run("max_only_s7", 0.9), run("unnamed", 0.5)])  # seed 7 has no reference run; no seed in the name
    table = tool.paired_table(runs, "full")
    row = next(line for line in table.splitlines() if line.startswith("| max_only |"))
    cells = [c.strip() for c in row.split("|")[2:6]]
    assert cells[0] == "3" and cells[1] == ", ".join(f"{100 * (b - a):+.1f}" for a, b in zip(full, max_only))
    low, high = stats.ttest_rel(100 * np.array(max_only), 100 * np.array(full)).confidence_interval(0.95)
    mean, half = (float(x) for x in cells[2].split(" ± "))
    assert mean == pytest.approx((low + high) / 2, abs=0.051) and half == pytest.approx((high - low) / 2, abs=0.051)
    assert cells[3] == "below full"
    assert tool.paired_table(runs, "nothing").startswith("Paired comparison skipped")
    floor = tool.noise_table(runs, [run("full_s0", 0.93), run("full_s2", 0.945)])
    assert "| full | 2 | 2.0, 0.5 | 1.2 | 2.0 |" in floor
    assert tool.noise_table(runs, []).startswith("Noise floor skipped")


def test_mass_table_averages_the_trained_share_over_the_rounds_that_logged_it(tmp_path):
    run = tmp_path / "full_s0"
    run.mkdir()
    rows = [{"round": 0, "mass/trained_frac": 0.5}, {"round": 1, "test_acc": 0.3},
            {"round": 2, "mass/trained_frac": 0.25}, {"round": 3, "mass/trained_frac": 0.75}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert tool.trained_fractions(run) == [(0, 0.5), (2, 0.25), (3, 0.75)]
    line = tool.mass_table([{"name": run.name}], [tool.trained_fractions(run)]).splitlines()[-1].split()
    assert line == ["full_s0", "0.500", "0.500", "0.750"]  # mean (0.5 + 0.25 + 0.75) / 3, first, last


def test_an_unwritable_figure_path_stops_before_any_table(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as stop:
        tool.main([str(tmp_path), "--mass", str(blocker / "mass.png")])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == "" and "mass: " in err and "is a file, not a folder" in err


def test_paired_measures_and_worst_step_read_the_variants():
    """The largest and smallest variant's accuracy are paired as the population is; the worst
    step is the largest fall between neighbouring cached variants (by hand)."""
    runs = [{"name": f"{row}_s{s}", "population": p, "accs": accs, "macs": [1e6, 2e6, 3e6]}
            for row, s, p, accs in (("full", 0, 0.90, [0.80, 0.85, 0.92]), ("full", 1, 0.88, [0.70, 0.90, 0.86]),
                                    ("gamma_0", 0, 0.80, [0.82, 0.80, 0.70]), ("gamma_0", 1, 0.84, [0.75, 0.72, 0.74]))]
    largest = tool.by_row(runs, "largest variant")
    assert largest == {"full": {0: 0.92, 1: 0.86}, "gamma_0": {0: 0.70, 1: 0.74}}
    row = next(line for line in tool.paired_table(runs, "full", "smallest variant").splitlines()
               if line.startswith("| gamma_0 |"))
    assert row.split("|")[3].strip() == "+2.0, +5.0"
    assert [tool.worst_step(r) for r in runs] == pytest.approx([0.0, 0.04, 0.10, 0.03], abs=1e-12)
    unsorted = {"macs": [3e6, 1e6, 2e6], "accs": [0.45, 0.5, None]}  # by MACs: 0.5, (unscored), 0.45
    assert tool.worst_step(unsorted) == pytest.approx(0.05, abs=1e-12)
    assert tool.MEASURES["largest variant"](unsorted) == 0.45


def test_a_rows_seeds_are_drawn_as_their_mean():
    runs = [{"name": f"full_s{s}", "rule": "full", "gamma": 1.0, "macs": [1e6, 2e6], "accs": accs}
            for s, accs in enumerate(([0.6, 0.8], [0.7, 0.9]))]
    runs.append({"name": "single", "rule": "max_only", "gamma": 1.0, "macs": [1e6, 2e6], "accs": [0.1, None]})
    drawn = tool.curves(runs)
    assert [label for label, _, _ in drawn] == ["full (full, gamma=1.0; mean of 2 seeds)", "single (max_only, gamma=1.0)"]
    assert drawn[0][2] == pytest.approx([0.65, 0.85], abs=1e-12) and drawn[1][2] == [0.1, None]


def test_extractions_go_to_the_run_of_their_checkpoint_and_are_summarized_over_runs(tmp_path, capsys):
    """Two runs with the toy curve; each extraction names its run's checkpoint (a repeated budget
    counts once). Per run mean |gap|, then over runs the mean ± scipy's 95% t interval."""
    from scipy import stats

    paths = [write_toy_run(tmp_path / name) for name in ("toy_s0", "toy_s1")]
    ckpt = [str(p / "checkpoints" / "best.ckpt") for p in paths]
    # s0: gaps +2 (16M) and -4 (30M), the 30M budget given twice with the same result; s1: -6 at 30M
    found = [{**EXTRACTIONS[1], "checkpoint": ckpt[0]}, {**EXTRACTIONS[2], "checkpoint": ckpt[0]},
             {**EXTRACTIONS[2], "checkpoint": ckpt[0]}, {**EXTRACTIONS[2], "test_acc": 0.64, "checkpoint": ckpt[1]}]
    lines = tmp_path / "all.jsonl"
    lines.write_text("\n".join(json.dumps(e) for e in found))
    tool.main([str(p) for p in paths] + ["--plot", str(tmp_path / "plot.png"), "--extractions", str(lines),
                                          "--low_end", "20e6"])
    out = capsys.readouterr().out
    assert "| toy_s0 | 2 | 2.00 | 3.00 |" in out and "| toy_s1 | 1 | - | 6.00 |" in out
    interval = stats.t.interval(0.95, 1, loc=4.5, scale=stats.sem([3.0, 6.0]))
    assert f"mean |gap| full range over 2 runs: 4.50 ± {(interval[1] - interval[0]) / 2:.2f} pp" in out
    assert "low end (budget <= 20M) over" not in out  # one run has a low-end subnet: no interval


def test_an_extraction_of_a_moved_run_is_found_by_its_folder_name(tmp_path):
    """Archived runs live elsewhere than where ``extract`` ran: the checkpoint's run folder name
    decides; no match (or an unnamed checkpoint) falls back to the first run."""
    paths = [tmp_path / "a_s0", tmp_path / "a_s1"]
    found = [{"budget": 1, "checkpoint": "/elsewhere/a_s1/checkpoints/best.ckpt"},
             {"budget": 2, "checkpoint": str(paths[0] / "checkpoints" / "best.ckpt")},
             {"budget": 3, "checkpoint": "/elsewhere/b_s9/checkpoints/best.ckpt"}, {"budget": 4}]
    per_run = tool.extractions_by_run(paths, found)
    assert [[e["budget"] for e in run] for run in per_run] == [[2, 3, 4], [1]]


@pytest.mark.parametrize("extra, expected", [
    (["--extractions", "{tmp}/nowhere.jsonl"], "--extractions: no file at"),
    (["--extractions", "{tmp}/partial.json"], "every result needs budget, macs and test_acc"),
    (["--extractions", "{tmp}/text.json"], "is neither extract's JSON nor JSON lines"),
    (["--low_end", "-5"], "--low_end: must be a MAC count > 0, got -5"),
])
def test_bad_extraction_inputs_stop_before_anything_is_printed(tmp_path, capsys, extra, expected):
    run = write_toy_run(tmp_path / "toy")
    (tmp_path / "partial.json").write_text(json.dumps({"budget": 1e6}))
    (tmp_path / "text.json").write_text("not json\n")
    plot = tmp_path / "plot.png"
    with pytest.raises(SystemExit) as refused:
        tool.main([str(run), "--plot", str(plot)] + [a.format(tmp=tmp_path) for a in extra])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == "" and not plot.exists()
    assert expected in err.strip().splitlines()[-1]


def test_each_extraction_prints_its_genes_from_the_nearest_cached_variant(tmp_path, capsys):
    """By hand: cached A = d0001 e(.1,.1,.1,.1) w10221 at 10M (50%) and B = d1111 e(.1,.1,.1,.1)
    w16648 at 40M (80%). The 20M extraction d0011 ... w10221 (from `extract`'s d/e/w) differs from
    A in one depth and from B in two depths and four widths: 1 gene; the 30M one (its spec text
    only) d1111 e(.14,.1,.1,.1) w06648 differs from B in one expansion and the stem: 2 genes."""
    run = tmp_path / "toy"
    run.mkdir()
    cached = [{"d": [0, 0, 0, 1], "e": [0.1] * 4, "w": [1, 0, 2, 2, 1], "macs": 10e6},
              {"d": [1, 1, 1, 1], "e": [0.1] * 4, "w": [1, 6, 6, 4, 8], "macs": 40e6}]
    (run / "cache.json").write_text(json.dumps({"variants": cached}))
    (run / "summary.json").write_text(json.dumps({"final": {"test_acc": 0.6, "test_variant00_acc": 0.5,
                                                            "test_variant01_acc": 0.8}}))
    (run / "config.yaml").write_text(yaml.safe_dump({"partition": {"gamma": 1.0}}))
    found = [{"budget": 21e6, "macs": 20e6, "test_acc": 0.55, "spec": "ignored when d/e/w are given",
              "d": [0, 0, 1, 1], "e": [0.1] * 4, "w": [1, 0, 2, 2, 1]},   # curve 60%: -5 pp
             {"budget": 31e6, "macs": 30e6, "test_acc": 0.40, "spec": "d=1111 e=(0.14,0.1,0.1,0.1) w=06648"},  # 70%: -30
             {"budget": 11e6, "macs": 10e6, "test_acc": 0.50, "spec": "d=0001 e=(0.1,0.1,0.1,0.1) w=10221"}]  # A: 0
    lines = tmp_path / "found.jsonl"
    lines.write_text("\n".join(json.dumps(e) for e in found))
    loaded = tool.load_run(run)
    assert [r["genes"] for r in tool.extraction_gaps(loaded, found)] == [0, 1, 2]
    tool.main([str(run), "--plot", str(tmp_path / "plot.png"), "--extractions", str(lines)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("11.00M", "21.00M", "31.00M"))]
    assert [(r[1], r[-2], r[-1]) for r in rows[-3:]] == [("10.00M", "+0.00", "0"), ("20.00M", "-5.00", "1"),
                                                         ("30.00M", "-30.00", "2")]
    assert "| 0 | 1 | +0.00 | +0.00 | +0.00 |" in out
    assert "| 1 | 1 | -5.00 | -5.00 | -5.00 |" in out and "| 2 | 1 | -30.00 | -30.00 | -30.00 |" in out


def test_an_extraction_without_a_known_architecture_has_no_distance():
    """The toy run's cache holds MACs only; an extraction without d/e/w or a readable spec: none."""
    rows = tool.extraction_gaps(RUN, EXTRACTIONS)
    assert all(r["genes"] is None for r in rows)
    assert tool.extraction_arch({"spec": "width=0.5"}) is None
    assert tool.distance_table([RUN], [EXTRACTIONS]).startswith("Gap by distance from the cache: skipped")
