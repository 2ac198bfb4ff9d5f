"""Sub-model FL: every client trains a width slice of the global model (the study of
``papers/hasfl-capacity-confounds-coverage.md``, ``docs/submodel.md``). ``base`` is the family's
shared machinery (caps, routing, coordinate-wise aggregation, coverage and cost monitoring); one
file per policy."""

from fl_lightning.algorithms.submodel.base import TIER_PROBS, TIERS, SubmodelAlgorithm, Width, draw_caps
from fl_lightning.algorithms.submodel.fedrolex import FedRolex
from fl_lightning.algorithms.submodel.fjord import FjORD
from fl_lightning.algorithms.submodel.hasfl import HASFL, allocation_rule, update_divergence
from fl_lightning.algorithms.submodel.heterofl import HeteroFL
from fl_lightning.algorithms.submodel.random_budget import RandomBudget, load_budget_trace, matched_widths
from fl_lightning.algorithms.submodel.uniform import Uniform

__all__ = ["SubmodelAlgorithm", "HeteroFL", "FjORD", "Uniform", "RandomBudget", "HASFL", "FedRolex", "draw_caps",
           "allocation_rule", "update_divergence", "matched_widths", "load_budget_trace", "TIERS", "TIER_PROBS",
           "Width"]
