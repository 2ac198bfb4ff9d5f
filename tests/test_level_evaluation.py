"""The per-level evaluator shared by HeteroFL tiers, ScaleFL levels and FEAST variants, and
the level report's layout."""

import pytest

from fl_lightning.algorithms.level_report import tier_report
from fl_lightning.runtime.evaluation import evaluate_levels


def test_population_accuracy_weights_each_level_by_the_clients_it_serves():
    accuracies = {0: 0.5, 1: 0.7, 2: 0.9}
    scored = []

    def score(k):
        scored.append(k)
        return {"acc": accuracies[k], "loss": 1.0}

    served = [0, 0, 0, 2, 1]  # three clients on level 0, one on level 2, one on level 1
    out = evaluate_levels(score, [0, 1, 2], served, lambda k: f"level{k + 1}", "mean_level_acc")
    assert scored == [0, 1, 2]
    assert out["acc"] == pytest.approx((3 * 0.5 + 0.9 + 0.7) / 5, rel=1e-12)
    assert out["mean_level_acc"] == pytest.approx((0.5 + 0.7 + 0.9) / 3, rel=1e-12)
    assert {k: v for k, v in out.items() if k.startswith("level")} == {"level1_acc": 0.5, "level2_acc": 0.7,
                                                                       "level3_acc": 0.9}


def test_an_empty_split_gives_no_figures():
    assert evaluate_levels(lambda k: {}, [0, 1], [0, 1], str, "mean") == {}


def test_the_tier_report_lists_every_level_and_every_client_once():
    summary = {"best": {"test_level1_acc": 0.25, "test_level2_acc": 0.5, "test_acc": 0.375}}
    population = [{"client": 0, "level": 1, "fallback": True}, {"client": 1, "level": 2, "fallback": False}]
    text = tier_report(summary, [0.5, 1.0], [1e6, 4e6], [1e5, 4e5], [1, 1], population, "recalibrated")
    lines = text.splitlines()
    assert lines[0] == "HeteroFL test accuracy (best-validation checkpoint, BN: recalibrated):"
    assert lines[2].split() == ["1", "0.5", "1.00M", "0.100M", "1", "25.00"]
    assert lines[3].split() == ["2", "1", "4.00M", "0.400M", "1", "50.00"]
    assert "37.50% (2 clients, 1 served level 1 as the fallback)" in lines[4]
    assert lines[-2:] == ["  level 1: 0*", "  level 2: 1"]
