"""Capacity-confound statistics: partial correlation against a regression-residual computation,
label TV on a hand-made partition."""

import numpy as np
import pytest
import torch

from fl_lightning.analysis.heterogeneity import label_tv, partial_corr, pearson


def residual(v, z):
    design = np.column_stack([np.ones_like(z), z])
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    return v - design @ coef


def test_partial_correlation_equals_the_correlation_of_regression_residuals():
    rng = np.random.default_rng(0)
    for _ in range(5):
        z = rng.choice([0.25, 0.5, 0.75, 1.0], size=20)
        x = -2.0 * z + rng.normal(size=20)
        y = 0.5 * z + rng.normal(size=20)
        direct = np.corrcoef(residual(x, z), residual(y, z))[0, 1]
        assert partial_corr(x, y, z) == pytest.approx(direct, abs=1e-10)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)


def test_label_tv_on_a_hand_made_partition():
    targets = torch.tensor([0, 0, 1, 1, 0, 1])
    tv = label_tv([torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])], targets, 2)
    assert tv.tolist() == pytest.approx([0.5, 0.5, 0.0])
