"""The tables' statistics: paired differences over seeds with a 95% interval, checked against
scipy's paired t-test, and the verdict that needs the interval to exclude zero."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from submodel_tables import paired_interval, verdict  # noqa: E402


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
