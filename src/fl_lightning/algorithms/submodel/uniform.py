"""The HAS-FL paper's Uniform baseline: every client at ``min(width, p_max)``."""

from __future__ import annotations

from fl_lightning.algorithms.submodel.base import SubmodelAlgorithm
from fl_lightning.option_types import UnitFraction


class Uniform(SubmodelAlgorithm):
    """Every client at ``min(width, p_max)`` (the paper's Uniform baseline, width 0.5)."""

    def __init__(self, width: UnitFraction = 0.5, **kwargs):
        """
        Args:
            width: the common width before capping.
        """
        super().__init__(**kwargs)
        self.width = float(width)

    def widths_for(self, round_idx, cohort):
        return {c: min(self.width, float(self.caps[c])) for c in cohort}
