"""Offline architecture search over FEAST's OFA-style supernet and the fixed variant cache.

- :mod:`.cost`: exact analytic MACs / parameters of a spec, vectorized: :class:`OFACostModel`
  (this project's bottleneck supernet, fvcore's convention) and :class:`DeepFedNASCostModel`
  (the DeepFedNAS construction in DeepFedNAS's convention, the paper's);
- :mod:`.convention`: fvcore's count next to the paper's on one module (the independent check);
- :mod:`.fitness`: the training-free fitness ``F`` and effectiveness ``rho`` (DeepFedNAS's,
  checked against its published cache; see docs/variant_cache.md);
- :mod:`.genetic`: the feasibility-preserving genetic search of Supp. B.1 (Eq. 10);
- :mod:`.cache`: :class:`VariantCache` (budget queries, JSON files) and :func:`build_cache`.
"""

from fl_lightning.elastic.search.cache import (Variant, VariantCache, build_cache,
                                               segment_targets)
from fl_lightning.elastic.search.cost import (DEEPFEDNAS_4_STAGE, FEAST_DEEPFEDNAS, DeepFedNASArch,
                                              DeepFedNASCostModel, OFACostModel, analytic_macs, analytic_params,
                                              cost_model, counter_make_divisible)
from fl_lightning.elastic.search.fitness import Fitness, FitnessConfig
from fl_lightning.elastic.search.genetic import InfeasibleError, SearchResult, search

__all__ = ["Variant", "VariantCache", "build_cache", "segment_targets", "OFACostModel",
           "DeepFedNASArch", "DeepFedNASCostModel", "DEEPFEDNAS_4_STAGE", "FEAST_DEEPFEDNAS",
           "counter_make_divisible", "analytic_macs", "analytic_params", "cost_model", "Fitness",
           "FitnessConfig", "InfeasibleError", "SearchResult", "search"]
