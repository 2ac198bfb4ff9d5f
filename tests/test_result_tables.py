"""The tables' statistics: paired differences over seeds with a 95% interval, checked against
scipy's paired t-test, and the verdict that needs the interval to exclude zero."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from submodel_tables import holm_survivors, paired_interval, paired_p_value, verdict  # noqa: E402


def test_paired_interval_is_scipys_paired_t_interval():
    from scipy import stats

    a = np.array([0.81, 0.77, 0.90, 0.68, 0.85, 0.79, 0.88, 0.74, 0.83, 0.80])
    b = np.array([0.78, 0.79, 0.84, 0.70, 0.80, 0.75, 0.86, 0.70, 0.84, 0.77])
    mean, half = paired_interval(a - b)
    interval = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert mean - half == pytest.approx(interval.low, abs=1e-12)
    assert mean + half == pytest.approx(interval.high, abs=1e-12)


@pytest.mark.parametrize("mean, half, expected", [(2.0, 1.5, "above ref"), (-2.0, 1.5, "below ref"),
                                                  (1.0, 1.5, "no difference detectable")])
def test_a_finding_needs_the_interval_to_exclude_zero(mean, half, expected):
    assert verdict(mean, half, "ref") == expected


def test_one_pair_has_no_interval():
    mean, half = paired_interval([1.0])
    assert mean == 1.0 and np.isnan(half)
    assert verdict(mean, half, "ref") == "too few seeds"


def test_table3_reads_each_drop_against_the_references_on_the_same_seeds(capsys):
    from scipy import stats

    from submodel_tables import print_table3

    best = {"hasfl": [0.80, 0.70, 0.75], "uniform": [0.60, 0.65, 0.50]}
    final = {"hasfl": [0.78, 0.69, 0.70], "uniform": [0.40, 0.44, 0.31]}
    figures = {name: {seed: {"best": best[name][seed], "final": final[name][seed], "p": 0.5, "largest": 1.0}
                      for seed in range(3)} for name in best}
    print_table3(figures)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| uniform"))
    # uniform's drops -20, -21, -19 against HAS-FL's -2, -1, -5: the paired t-interval by scipy
    interval = stats.ttest_rel([-20.0, -21.0, -19.0], [-2.0, -1.0, -5.0]).confidence_interval(0.95)
    mean, half = (interval.low + interval.high) / 2, (interval.high - interval.low) / 2
    assert f"{mean:+.1f} ± {half:.1f} (below hasfl)" in row
    assert "| -20.0 ± 1.0 |" in row  # the drop's own mean ± std over the three seeds


def test_table4_prints_the_interval_of_each_correlation_over_seeds(capsys):
    from submodel_tables import print_table4

    keys = ["r(H,TV)", "r(H,pmax)", "pr(H,TV|pmax)", "pr(p,TV|pmax)"]
    rows = {0: dict.fromkeys(keys, -0.5), 1: dict.fromkeys(keys, -0.7), 2: dict.fromkeys(keys, -0.6)}
    print_table4("hasfl", rows)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    half = 4.302653 * 0.1 / np.sqrt(3)  # t(0.975, 2) x std / sqrt(n)
    assert last == "| 95% CI | " + " | ".join([f"-0.60 ± {half:.2f}"] * 4) + " |"


def test_tables_refuse_a_missing_root_or_an_unknown_reference_before_printing(tmp_path, capsys):
    from submodel_tables import main

    with pytest.raises(SystemExit) as missing:
        main([str(tmp_path / "nowhere")])
    (tmp_path / "hasfl_s0").mkdir()
    with pytest.raises(SystemExit) as unknown:
        main([str(tmp_path), "--reference", "fjord"])
    out, err = capsys.readouterr()
    assert missing.value.code == unknown.value.code == 2 and out == ""
    assert "root: no folder at" in err and "--reference: no runs named fjord_s<seed>" in err


def test_table4_without_the_runs_data_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Table 4's label-skew column loads each run's data again from the path in its config; run
    from another folder, the tool says so in one line instead of a traceback."""
    import submodel_tables

    from fl_lightning.errors import ConfigError

    def no_data(run):
        raise ConfigError("data.root", "no Shakespeare data under 'data'")

    monkeypatch.setattr(submodel_tables, "collect", lambda root: {"hasfl": {0: None, 1: None}})
    monkeypatch.setattr(submodel_tables, "run_figures", lambda run: {"best": 0.4, "final": 0.4, "p": 0.6})
    monkeypatch.setattr(submodel_tables, "table4_row", no_data)
    with pytest.raises(SystemExit) as refused:
        submodel_tables.main([str(tmp_path), "--table4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert refused.value.code == 2
    assert err.endswith("--table4: data.root: no Shakespeare data under 'data' (run the tool from the folder the runs "
                        "were made in)")


def test_paired_p_value_by_hand():
    """d = 1, 2, 3: t = 2 / (1 / sqrt 3) = 3.464 on 2 degrees of freedom, two-sided p = 0.0742
    (a one-sided test would give 0.0371, a normal approximation 0.0005)."""
    assert paired_p_value([1.0, 2.0, 3.0]) == pytest.approx(0.0741799, abs=1e-6)
    assert paired_p_value([2.0, 2.0, 2.0]) == 0.0 and paired_p_value([0.0, 0.0]) == 1.0


@pytest.mark.parametrize("p_values, expected", [
    # thresholds 0.05/3, 0.05/2, 0.05: all three survive (Bonferroni's 0.0167 keeps only "a")
    ({"a": 0.01, "b": 0.02, "c": 0.04}, {"a": True, "b": True, "c": True}),
    # 0.03 > 0.025 stops the step-down: only "a" survives (Hochberg's step-up would keep all three)
    ({"a": 0.01, "b": 0.03, "c": 0.04}, {"a": True, "b": False, "c": False}),
    # the order of the table does not matter, an untestable row never survives
    ({"c": 0.2, "a": 0.001, "n": float("nan")}, {"a": True, "c": False, "n": False}),
])
def test_holm_is_the_step_down_correction(p_values, expected):
    assert holm_survivors(p_values) == expected


@pytest.mark.parametrize("accs, expected", [
    ([0.50, 0.90, 0.952, 0.960, 0.958], True),  # climbed early, the last three within 0.8 points
    ([0.960, 0.970, 0.950, 0.962, 0.955], False),  # the last two agree, the third from last is 1.2 below
    ([0.960, 0.958], False),  # fewer than three evaluations: not yet levelled
])
def test_a_run_has_levelled_when_its_last_three_evaluations_lie_within_a_point(accs, expected):
    from submodel_tables import levelled

    assert levelled(accs) is expected


def test_split_tables_refuse_an_unknown_reference_before_printing(tmp_path, capsys):
    from split_tables import main

    (tmp_path / "fedsga_s0").mkdir()
    (tmp_path / "fedsga_s0" / "summary.json").write_text("{}")
    (tmp_path / "splitfed_s0").mkdir()  # unfinished: no summary, not a method of the table
    with pytest.raises(SystemExit) as unknown:
        main([str(tmp_path), "--reference", "splitfed"])
    out, err = capsys.readouterr()
    assert unknown.value.code == 2 and out == ""
    assert err.strip().splitlines()[-1].endswith(
        f"--reference: no runs named splitfed_s<seed> under {tmp_path} (methods there: fedsga)")
