"""The supernet comparison's common serving form and its controls (analysis/serving.py,
analysis/serving_controls.py, tools/supernet_tables.py): every expected number is worked out
here by hand or by a direct sum over the run's files."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fl_lightning.algorithms.supernet.feast_accounting import PAPER_ANCHORS
from fl_lightning.analysis.serving import (RunFormatError, ServingRun, largest_affordable, load_run,
                                           training_proxy)
from fl_lightning.analysis.serving_controls import (anchor_accuracy, client_wins, density_control,
                                                   end_to_end_change, horizon_overrides, matched_rounds,
                                                   range_ends, scaled_anchors)

TOOLS = Path(__file__).resolve().parents[1] / "tools"


# -- serving ----------------------------------------------------------------------------------

def test_largest_affordable_serving_with_the_minimum_tier_fallback():
    macs = [40.0, 10.0, 20.0]  # unsorted on purpose: indices refer to this order
    budgets = [5.0, 10.0, 15.0, 39.9, 40.0, 1000.0]
    served, fallback = largest_affordable(macs, budgets)
    # 5 affords nothing -> the cheapest point (10, index 1), flagged; 10 and 15 afford 10;
    # 39.9 affords 20; 40 and 1000 afford 40.
    assert served.tolist() == [1, 1, 1, 2, 0, 0]
    assert fallback.tolist() == [True, False, False, False, False, False]


def test_client_wins_ties_and_losses():
    assert client_wins([0.7, 0.5, 0.4, 0.9], [0.6, 0.5, 0.45, 0.1]) == \
        {"wins": 2, "ties": 1, "losses": 1, "clients": 4}


def test_density_control_on_a_hand_made_curve():
    macs = [25, 30, 35, 50, 140, 550]
    accs = [0.60, 0.62, 0.64, 0.66, 0.70, 0.72]
    tiers = [2, 9, 35.7, 139.5, 555]  # HeteroFL-like: the two smallest both map to the 25 floor
    budgets = [25, 32, 60, 200, 600]
    out = density_control(macs, accs, tiers, baseline_acc=0.50, budgets=budgets)
    assert out["subset"] == [0, 2, 4, 5]  # 25, 35, 140, 550
    # full curve: 25->0.60, 32->30 (0.62), 60->50 (0.66), 200->140 (0.70), 600->550 (0.72)
    full = (0.60 + 0.62 + 0.66 + 0.70 + 0.72) / 5
    # subset: 25->0.60, 32->25 (0.60), 60->35 (0.64), 200->140 (0.70), 600->550 (0.72)
    matched = (0.60 + 0.60 + 0.64 + 0.70 + 0.72) / 5
    assert out["full"] == pytest.approx(full) and out["matched"] == pytest.approx(matched)
    assert out["density"] == pytest.approx(0.008)
    assert out["full_margin"] == pytest.approx(0.16) and out["residual"] == pytest.approx(0.152)
    assert out["retained"] == pytest.approx(0.152 / 0.16)
    assert out["subset_fallback"] == 0


def test_equal_compute_horizon_arithmetic():
    # FEAST Table 8: 31.01 PMACs against 14.97, 15.22 and 29.97 over 4000 rounds
    assert matched_rounds(4000, 31.01, 14.97) == 8286
    assert matched_rounds(4000, 31.01, 15.22) == 8150
    assert matched_rounds(4000, 31.01, 29.97) == 4139
    assert matched_rounds(10, 0.3, 0.1) == 30  # an exact multiple stays exact despite float rounding
    assert matched_rounds(3, 1.0, 3.0) == 1


def test_horizon_overrides_stretch_an_exponential_schedule():
    config = {"federation": {"rounds": 100}, "train": {"lr_schedule": "exponential", "lr_decay": 0.99},
              "algorithm": {"init_args": {}}}
    run = ServingRun(Path("/runs/x"), "ScaleFL", "scalefl", config, [], "fvcore", np.zeros(1), np.ones(1),
                     np.zeros(1, int), np.zeros(1, bool), None)
    out = horizon_overrides(run, 200)
    assert out[:2] == ["--federation.rounds", "200"]
    # the stretched decay reaches at round 200 the learning rate the original had at round 100
    assert float(out[out.index("--train.lr_decay") + 1]) == pytest.approx(0.99 ** 0.5)
    run.config["train"]["lr_schedule"] = "cosine"  # follows federation.rounds by itself
    assert horizon_overrides(run, 200) == ["--federation.rounds", "200"]


def test_training_proxy_is_kappa_times_macs_times_shards_times_participations():
    # 4 clients, 6 rounds of 2: each client takes part 3 times in expectation
    value = training_proxy([10, 20, 30, 40], [1, 2, 3, 4], rounds=6, clients_per_round=2, epochs=2, kappa=3.0)
    assert value == pytest.approx(3.0 * 2 * 3 * (10 + 40 + 90 + 160))


def test_anchors_scale_to_a_small_cache_and_pick_the_largest_point_within():
    assert scaled_anchors(24.96e6, 595.67e6) == list(PAPER_ANCHORS)
    lo, hi = 0.2e6, 3.7e6
    scaled = scaled_anchors(lo, hi)
    assert scaled[0] == pytest.approx(lo) and scaled[-1] == pytest.approx(hi)
    for a, b in zip(PAPER_ANCHORS, scaled):  # same relative position in log MACs
        t = math.log(a / 25e6) / math.log(596e6 / 25e6)
        assert math.log(b / lo) / math.log(hi / lo) == pytest.approx(t)
    macs, accs = [1, 2, 4, 8], [0.1, 0.2, 0.3, 0.4]
    assert anchor_accuracy(macs, accs, 0.5) is None
    assert anchor_accuracy(macs, accs, 3.9) == 0.2 and anchor_accuracy(macs, accs, 8) == 0.4
    assert end_to_end_change([0.1, None, 0.4]) == pytest.approx(0.3)
    assert end_to_end_change([None, 0.4]) is None


# -- tiny real runs ---------------------------------------------------------------------------

BASE = {
    "seed": 0,
    "data": {"dataset": {"class_path": "fl_lightning.data.Synthetic",
                         "init_args": {"num_classes": 4, "image_size": 16, "num_train": 400, "num_test": 80}},
             "val_size": 40, "calib_size": 32},
    "partition": {"method": "gamma_dirichlet", "num_clients": 6, "alpha_eff": 1.0, "gamma": 1.0, "min_size": 5,
                  "budgets": {"zipf_s": 1.2, "b_min": 1e5, "b_max": 3e6, "b_cap": 2e6}},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "federation": {"rounds": 1, "clients_per_round": 3},
    "eval": {"every": 1, "test": "final"},
    "fabric": {"accelerator": "cpu"},
}
OFA = {"class_path": "fl_lightning.elastic.models.OFAResNet",
       "init_args": {"width_scale": 0.0625, "max_extra_blocks": 1, "divisor": 2}}


def _cache(path: Path) -> str:
    from fl_lightning.elastic.models import build_model
    from fl_lightning.elastic.search.cache import VariantCache

    model = build_model(OFA, 4, (3, 16, 16))
    g = torch.Generator().manual_seed(3)
    specs = {model.min_spec()} | {model.sample_spec(g) for _ in range(4)}
    VariantCache.from_specs(model, sorted(specs, key=str)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """One-round FEAST and ScaleFL runs of the same population, through the command line."""
    from fl_lightning.cli import main

    root = tmp_path_factory.mktemp("supernet")
    configs = {
        "feast": {"model": OFA, "algorithm": {
            "class_path": "fl_lightning.algorithms.Feast",
            "init_args": {"cache": _cache(root / "cache.json"), "mix_schedule": "none"}}},
        "scalefl": {"model": {"class_path": "fl_lightning.elastic.models.ScaleFLResNet18",
                              "init_args": {"width": 0.125}},
                    "algorithm": {"class_path": "fl_lightning.algorithms.supernet.scalefl.ScaleFL"}},
    }
    for name, extra in configs.items():
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**BASE, **extra}))
        assert main(["fit", "--config", str(path), "--out_dir", str(root / "runs"), "--name", name]) == 0
    return root / "runs"


def test_loader_reads_feast_and_scalefl_runs_into_one_form(tiny_runs):
    from fl_lightning.algorithms.supernet.feast_accounting import affordable_sets, training_computation
    from fl_lightning.elastic.search.cache import VariantCache

    feast, scalefl = load_run(tiny_runs / "feast"), load_run(tiny_runs / "scalefl")
    part = torch.load(tiny_runs / "feast" / "partition.pt", weights_only=True)
    sizes = [len(part[f"client/{i}"]) for i in range(6)]
    for run in (feast, scalefl):
        assert run.budgets.tolist() == part["budgets"].double().tolist() and run.sizes.tolist() == sizes
        assert run.population_acc == pytest.approx(run.reported_acc)  # the run's own test_acc
        assert all(p.acc is not None for p in run.points)
        assert list(run.point_macs) == sorted(run.point_macs)
    assert feast.method == "FEAST" and scalefl.method == "ScaleFL" and len(scalefl.points) == 4
    # FEAST's proxy is its accounting (Eq. 26), recomputed here from the cache and partition
    cache = VariantCache.load(tiny_runs / "feast" / "cache.json")
    expected = training_computation(cache, affordable_sets(cache, feast.budgets.tolist()), sizes, 1, 3)
    assert feast.proxy == pytest.approx(expected["feast_train_macs"])
    # ScaleFL: 3 x (1 round x 3 clients / 6) x sum_i n_i x (all-exit MACs of client i's level)
    levels = json.loads((tiny_runs / "scalefl" / "levels.json").read_text())
    direct = 0.0
    for i, budget in enumerate(part["budgets"].tolist()):
        affordable = [lv for lv in levels["levels"] if lv["served_macs"] <= budget]
        level = affordable[-1] if affordable else levels["levels"][0]
        direct += sizes[i] * level["train_macs"]
    assert scalefl.proxy == pytest.approx(3.0 * (1 * 3 / 6) * direct)
    # a client below level 1 (0.14M MACs at width 1/8) is served level 1 and flagged, as in
    # ScaleFL's own assignment
    assert scalefl.fallback.any() and (scalefl.served[scalefl.fallback] == 0).all()
    assert [c["fallback"] for c in levels["clients"]] == scalefl.fallback.tolist()


def test_heterofl_hook_reads_a_tier_artifact_and_other_folders_are_refused(tiny_runs, tmp_path):
    fake = tmp_path / "heterofl"
    shutil.copytree(tiny_runs / "scalefl", fake, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
    config = yaml.safe_load((fake / "config.yaml").read_text())
    config["algorithm"]["class_path"] = "fl_lightning.algorithms.HeteroFL"
    (fake / "config.yaml").write_text(yaml.safe_dump(config))
    run = load_run(fake)
    assert run.method == "HeteroFL" and len(run.points) == 4
    (fake / "levels.json").unlink()
    with pytest.raises(RunFormatError, match="tier artifact"):
        load_run(fake)
    with pytest.raises(RunFormatError, match="config.yaml"):
        load_run(tmp_path)


def test_shared_range_ends_from_the_first_anchor_up():
    """Sec. 4.2: the smallest point of at least the first anchor and the largest point (points
    given out of order; one just below the anchor by rounding counts as inside)."""
    macs = [600.0, 20.0, 25.0 * (1 - 1e-12), 229.0]
    accs = [0.72, 0.30, 0.60, 0.70]
    assert range_ends(macs, accs, 25.0) == pytest.approx((0.60, 0.72))
    assert range_ends(macs, accs, 100.0) == pytest.approx((0.70, 0.72))
    assert range_ends(macs, accs, 700.0) is None


def test_tool_prints_the_tables_it_has_runs_for(tiny_runs, tmp_path, capsys):
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))
    figure = tmp_path / "acc.png"
    assert supernet_tables.main([str(tiny_runs / "feast"), str(tiny_runs / "scalefl"), "--figure", str(figure)]) == 0
    out = capsys.readouterr().out
    feast, scalefl = load_run(tiny_runs / "feast"), load_run(tiny_runs / "scalefl")
    row = next(line for line in out.splitlines() if line.startswith("| synthetic"))
    assert f"{100 * scalefl.population_acc:.2f}" in row and f"{100 * feast.population_acc:.2f}" in row
    assert "Table 5: serving-density control" in out and "| ScaleFL |" in out
    assert matched_rounds(1, feast.proxy, scalefl.proxy) == 1  # ScaleFL costs more: its run is the matched one
    assert "Matched-horizon reruns still to run" not in out
    assert "Table 3 skipped" in out and "Table 11 skipped" in out
    low = scaled_anchors(float(feast.point_macs.min()), float(feast.point_macs.max()))[0]
    ends = range_ends(feast.point_macs, feast.point_accs, low)
    ranges = out[out.index("Sec. 4.2"):out.index("Table 3")]
    feast_row = next(line for line in ranges.splitlines() if line.startswith("| FEAST |"))
    assert f"| {100 * (ends[1] - ends[0]):.2f} |" in feast_row
    assert f"| ScaleFL | {len(scalefl.points)} depth-width levels |" in out and "| FEAST |" in out
    assert figure.stat().st_size > 0


def test_sweep_tables_count_each_seed_once(tiny_runs, tmp_path, capsys):
    """Two overlays can give the same population (zipf_s1p2 is alpha_0p1): the second run of a
    seed must not enter Table 11 as another seed."""
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))
    ignore = shutil.ignore_patterns("checkpoints", "tensorboard")
    shutil.copytree(tiny_runs / "feast", tmp_path / "feast_again", ignore=ignore)
    other = tmp_path / "feast_s0p8"
    shutil.copytree(tiny_runs / "feast", other, ignore=ignore)
    config = yaml.safe_load((other / "config.yaml").read_text())
    config["partition"]["budgets"]["zipf_s"] = 0.8
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    runs = [str(tiny_runs / "feast"), str(tmp_path / "feast_again"), str(other), "--figure", str(tmp_path / "f.png")]
    assert supernet_tables.main(runs) == 0
    out = capsys.readouterr().out
    table = out[out.index("Table 11"):]
    rows = [line.split("|")[1:4] for line in table.splitlines() if line.startswith("| 1.2 ") or line.startswith("| 0.8 ")]
    assert [[c.strip() for c in row] for row in rows] == [["0.8", "FEAST", "1"], ["1.2", "FEAST", "1"]]


def test_table_4_deployment_ranges_on_hand_made_runs():
    """Per method: the structure, the number of points (a range when seeds differ) and the
    smallest-to-largest MACs over its runs, in order of first appearance."""
    from types import SimpleNamespace

    from fl_lightning.analysis.serving import Point

    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))

    def run(method, kind, macs):
        return SimpleNamespace(method=method, kind=kind, points=[Point(f"p{j}", m, None, None) for j, m in enumerate(macs)])

    runs = [run("ScaleFL", "scalefl", [35e6, 120e6, 300e6, 555e6]),
            run("FEAST", "feast", [25e6, 40e6, 596e6]),
            run("FIARSE", "fiarse", [9e6, 100e6]),
            run("FEAST", "feast", [24e6, 50e6, 90e6, 590e6]),  # another seed's cache: 4 points, 24M
            run("HeteroFL", "heterofl", []),  # nothing measured: left out
            run("HeteroFL", "heterofl", [2e6, 8e6, 34e6, 137e6, 550e6])]
    rows = supernet_tables.deployment_ranges(runs)
    assert [(r["method"], r["structure"], sorted(r["counts"]), r["low"], r["high"]) for r in rows] == [
        ("ScaleFL", "depth-width levels", [4], 35e6, 555e6),
        ("FEAST", "cached variants", [3, 4], 24e6, 596e6),
        ("FIARSE", "mask grid points", [2], 9e6, 100e6),
        ("HeteroFL", "width tiers", [5], 2e6, 550e6)]
    text = supernet_tables.table4(runs)
    assert "| FEAST | 3-4 cached variants | 24.00M-596.00M |" in text
    assert "| HeteroFL | 5 width tiers | 2.00M-550.00M |" in text
    assert supernet_tables.table4([]).startswith("Table 4 skipped")


def test_paired_comparison_and_noise_floor_on_hand_made_runs():
    """FEAST minus each method seed by seed on the seeds both hold, the 95% interval from
    scipy's paired t-test, the finding; and the same runs under other arithmetic as the noise
    floor (absolute changes)."""
    from types import SimpleNamespace

    from scipy import stats

    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))

    def run(method, seed, acc):
        return SimpleNamespace(method=method, seed=seed, rounds=30, population_acc=acc, name=f"{method}_{seed}",
                               path=Path(f"{method}_{seed}"))

    feast = [0.80, 0.75, 0.82, 0.78]
    heterofl = [0.70, 0.71, 0.69, 0.74, 0.99]  # a fifth seed FEAST lacks: left out
    scalefl = [0.79, 0.77, 0.80, 0.80]
    runs = ([run("FEAST", s, a) for s, a in enumerate(feast)] + [run("HeteroFL", s, a) for s, a in enumerate(heterofl)]
            + [run("ScaleFL", s, a) for s, a in enumerate(scalefl)])
    setting = (("dataset", "synthetic"),)
    groups = {setting: supernet_tables.Group(runs)}
    text = supernet_tables.paired_table(groups)
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:7]]
            for line in text.splitlines() if line.startswith("| synthetic")}
    for method, accs, finding in (("HeteroFL", heterofl, "FEAST above HeteroFL"),
                                  ("ScaleFL", scalefl, "FEAST no difference detectable")):
        d = 100 * (np.array(feast) - np.array(accs[:4]))
        low, high = stats.ttest_rel(100 * np.array(feast), 100 * np.array(accs[:4])).confidence_interval(0.95)
        assert rows[method][0] == "4"
        assert rows[method][1] == ", ".join(f"{x:+.1f}" for x in d)
        mean, half = (float(x) for x in rows[method][2].split(" ± "))  # printed to 0.1 points
        assert mean == pytest.approx((low + high) / 2, abs=0.051) and half == pytest.approx((high - low) / 2, abs=0.051)
        assert rows[method][3] == finding
    again = {setting: supernet_tables.Group([run("FEAST", 0, 0.77), run("FEAST", 1, 0.76)])}
    floor = supernet_tables.noise_table(groups, again)
    row = next(line for line in floor.splitlines() if line.startswith("| synthetic | FEAST"))
    assert [c.strip() for c in row.split("|")[3:7]] == ["2", "3.0, 1.0", "2.0", "3.0"]
    assert supernet_tables.noise_table(groups, {}).startswith("Noise floor skipped")


def test_an_archived_run_gets_back_the_partition_fit_wrote(tiny_runs, tmp_path):
    """Archives keep a run's text only; the rebuilt partition.pt must equal fit's tensor for tensor."""
    sys.path.insert(0, str(TOOLS))
    try:
        import restore_partitions
    finally:
        sys.path.remove(str(TOOLS))
    archived = tmp_path / "feast"
    shutil.copytree(tiny_runs / "feast", archived, ignore=shutil.ignore_patterns("partition.pt", "checkpoints"))
    with pytest.raises(RunFormatError, match="no partition.pt"):
        load_run(archived)
    assert restore_partitions.main([str(archived)]) == 0
    written = torch.load(tiny_runs / "feast" / "partition.pt", weights_only=True)
    rebuilt = torch.load(archived / "partition.pt", weights_only=True)
    assert sorted(rebuilt) == sorted(written)
    assert all(torch.equal(rebuilt[k], written[k]) for k in written)
    assert load_run(archived).population_acc == pytest.approx(load_run(tiny_runs / "feast").population_acc)
    assert not restore_partitions.restore(archived)  # present: left as it is


def test_table8_reads_a_matched_horizon_rerun_and_pairs_it_with_feast(tiny_runs, tmp_path, capsys):
    """At 10 rounds ScaleFL's matched horizon is shorter (it costs more than FEAST per round): the
    tool prints the rerun's command, and once the rerun exists fills Table 8 with its accuracy,
    FEAST's margin over it and the paired interval (one seed: too few for an interval)."""
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))

    def copy(name: str, target: str, rounds: int, test_acc=None):
        out = tmp_path / target
        shutil.copytree(tiny_runs / name, out, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
        config = yaml.safe_load((out / "config.yaml").read_text())
        config["federation"]["rounds"] = rounds
        (out / "config.yaml").write_text(yaml.safe_dump(config))
        if (out / "accounting.json").exists():  # FEAST's expected total (Eq. 26) is linear in rounds
            accounting = json.loads((out / "accounting.json").read_text())
            accounting["computation"]["feast_train_macs"] *= rounds
            (out / "accounting.json").write_text(json.dumps(accounting))
        if test_acc is not None:  # the rerun's own score, apart from the original's
            summary = json.loads((out / "summary.json").read_text())
            summary["best" if "test_acc" in summary.get("best", {}) else "final"]["test_acc"] = test_acc
            (out / "summary.json").write_text(json.dumps(summary))
        return out

    feast, scalefl = copy("feast", "feast", 10), copy("scalefl", "scalefl", 10)
    r_new = matched_rounds(10, load_run(feast).proxy, load_run(scalefl).proxy)
    assert 1 < r_new < 10  # proxies are linear in rounds: 10 x FEAST / ScaleFL, rounded up
    assert supernet_tables.main([str(feast), str(scalefl)]) == 0
    assert f"--federation.rounds {r_new} --out_dir {tmp_path} --name scalefl_r{r_new}" in capsys.readouterr().out
    rerun = copy("scalefl", f"scalefl_r{r_new}", r_new, test_acc=0.125)
    assert supernet_tables.main([str(feast), str(scalefl), str(rerun)]) == 0
    out = capsys.readouterr().out
    table8 = out[out.index("Table 8"):]
    row = next(line for line in table8.splitlines() if line.startswith("| ScaleFL |"))
    margin = 100 * (load_run(feast).population_acc - load_run(rerun).population_acc)
    assert f"| {r_new} |" in row and f"{margin:+.1f} ± nan (too few seeds)" in row
    assert "Matched-horizon reruns still to run" not in table8


def _anchor_run(method, seed, accs, macs=(1e6, 2e6, 4e6), **setting):
    """A hand-made run: ``accs`` at the points ``macs`` of one population setting."""
    from types import SimpleNamespace

    config = {"partition": {"num_clients": 20, "gamma": setting.get("gamma", 1.0), "alpha_eff": setting.get("alpha", 0.45),
                            "budgets": {"b_min": 1e6, "b_max": 4e6, "zipf_s": setting.get("s", 1.2)}}}
    run = SimpleNamespace(method=method, seed=seed, rounds=30, kind="feast", dataset="synthetic",
                          point_macs=np.array(macs), point_accs=np.array(accs), path=Path(f"{method}_{seed}"),
                          config=config)
    run.get = lambda dotted, default=None: ServingRun.get(run, dotted, default)
    return run


def _t_interval(differences):
    from scipy import stats

    d = np.asarray(differences, dtype=np.float64)
    low, high = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    return (low + high) / 2, (high - low) / 2


def _cells(line):
    return [c.strip() for c in line.split("|")[1:-1]]


def test_sweep_paired_intervals_gains_and_the_feast_margin_by_hand():
    """Table 12's paired block on hand-made curves: FEAST - FIARSE at every anchor and in the
    change, each value against the first, and each anchor's gain over the first, whose interval
    below zero is a curve inversion; every interval recomputed with scipy's one-sample t interval."""
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))
    feast = {0.45: [[0.80, 0.70, 0.85], [0.78, 0.69, 0.86], [0.82, 0.74, 0.88]],
             1.35: [[0.90, 0.91, 0.93], [0.88, 0.90, 0.95], [0.91, 0.93, 0.94]]}
    fiarse = {0.45: [[0.10, 0.40, 0.80], [0.12, 0.45, 0.79], [0.11, 0.38, 0.84]],
              1.35: [[0.10, 0.60, 0.90], [0.11, 0.55, 0.96], [0.09, 0.62, 0.91]]}
    runs = [_anchor_run(m, seed, accs, alpha=alpha) for m, curves in (("FEAST", feast), ("FIARSE", fiarse))
            for alpha, seeds in curves.items() for seed, accs in enumerate(seeds)]
    text = supernet_tables.sweep_table(runs, "alpha", ("FEAST", "FIARSE"), "Table 12: t", [1e6, 2e6, 4e6])
    rows = {_cells(line)[0]: _cells(line)[1:] for line in text.splitlines() if line.startswith("| FEAST")
            or line.startswith("| FIARSE")}

    def expect(row, differences):
        """``row``'s anchor cells, change and verdict count against the per-seed differences
        (fractions; the first column None for no value)."""
        counts = {"above": 0, "below": 0, "not detectable": 0}
        for j, (cell, column) in enumerate(zip(row[1:5], zip(*differences))):
            if column[0] is None:
                assert cell == "–"
                continue
            mean, half = (float(x) for x in cell.split(" ± "))
            m, h = _t_interval(100 * np.array(column))
            assert mean == pytest.approx(m, abs=0.051) and half == pytest.approx(h, abs=0.051)
            if j < 3:  # the change column is not an anchor
                counts["above" if m - h > 0 else "below" if m + h < 0 else "not detectable"] += 1
        assert row[-1] == f"{counts['above']} above, {counts['below']} below, {counts['not detectable']} not detectable"

    def with_change(curve):
        return [*curve, curve[-1] - curve[0]]

    margin = [[a - b for a, b in zip(with_change(f), with_change(g))] for f, g in zip(feast[0.45], fiarse[0.45])]
    row = rows["FEAST - FIARSE at alpha_eff=0.45"]
    assert row[0] == "3"
    expect(row, margin)
    assert row[-1] == "3 above, 0 below, 0 not detectable"
    skew = [[a - b for a, b in zip(with_change(f), with_change(g))] for f, g in zip(feast[1.35], feast[0.45])]
    expect(rows["FEAST alpha_eff=1.35 - alpha_eff=0.45"], skew)
    expect(rows["FIARSE alpha_eff=1.35 - alpha_eff=0.45"],
           [[a - b for a, b in zip(with_change(f), with_change(g))] for f, g in zip(fiarse[1.35], fiarse[0.45])])
    gains = rows["FEAST alpha_eff=0.45: gain over the first anchor"]
    expect(gains, [[None, f[1] - f[0], f[2] - f[0], f[2] - f[0]] for f in feast[0.45]])
    assert gains[-1] == "1 above, 1 below, 0 not detectable"  # 2M below 1M on every seed: an inversion


def test_table3_pairs_feast_with_each_transfer_on_the_same_seed():
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))
    feast = [[0.70, 0.75, 0.80], [0.72, 0.71, 0.79], [0.68, 0.77, 0.83]]
    dfn = [[0.10, 0.12, 0.11], [0.09, 0.10, 0.15], [0.12, 0.09, 0.10]]
    runs = [_anchor_run("FEAST", s, a) for s, a in enumerate(feast)]
    runs += [_anchor_run("DFN, unconstrained", s, a, gamma=0.0) for s, a in enumerate(dfn)]
    runs[-1].kind = runs[-2].kind = runs[-3].kind = "transfer"
    text = supernet_tables.table3(runs, [1e6, 2e6, 4e6])
    row = next(_cells(line) for line in text.splitlines() if line.startswith("| FEAST - DFN"))
    assert row[0] == "FEAST - DFN, unconstrained (gamma=0)" and row[1] == "3"
    for cell, column in zip(row[2:5], zip(*[[a - b for a, b in zip(f, d)] for f, d in zip(feast, dfn)])):
        mean, half = (float(x) for x in cell.split(" ± "))
        m, h = _t_interval(100 * np.array(column))
        assert mean == pytest.approx(m, abs=0.051) and half == pytest.approx(h, abs=0.051)
    assert row[-1] == "3 above, 0 below, 0 not detectable"


@pytest.mark.parametrize("argv, key", [(["{tmp}/absent"], "runs: no run at"),
                                       (["{tmp}"], "runs: no readable run"),
                                       (["{tmp}", "--noise", "{tmp}/absent"], "--noise: no run at")])
def test_a_missing_or_empty_run_path_stops_with_one_line_naming_it(tmp_path, capsys, argv, key):
    sys.path.insert(0, str(TOOLS))
    try:
        import supernet_tables
    finally:
        sys.path.remove(str(TOOLS))
    with pytest.raises(SystemExit) as stop:
        supernet_tables.main([a.format(tmp=tmp_path) for a in argv])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line: no usage block before it
    assert key in line
    assert list(tmp_path.iterdir()) == []
