"""Offline architecture search over FEAST's OFA-style supernet and the fixed variant cache.

- :mod:`.cost`: exact analytic MACs / parameters of a spec (fvcore's convention), vectorized;
- :mod:`.fitness`: the training-free fitness ``F`` and effectiveness ``rho`` (a DeepMAD /
  DeepFedNAS-style reconstruction, see docs/variant_cache.md);
- :mod:`.genetic`: the feasibility-preserving genetic search of Supp. B.1 (Eq. 10);
- :mod:`.cache`: :class:`VariantCache` (budget queries, JSON files) and :func:`build_cache`.
"""

from fl_lightning.elastic.search.cache import (PAPER_SEGMENTS, Variant, VariantCache, build_cache,
                                               segment_targets)
from fl_lightning.elastic.search.cost import OFACostModel, analytic_macs, analytic_params, cost_model
from fl_lightning.elastic.search.fitness import Fitness, FitnessConfig
from fl_lightning.elastic.search.genetic import InfeasibleError, SearchResult, search

__all__ = ["PAPER_SEGMENTS", "Variant", "VariantCache", "build_cache", "segment_targets", "OFACostModel",
           "analytic_macs", "analytic_params", "cost_model", "Fitness", "FitnessConfig", "InfeasibleError",
           "SearchResult", "search"]
