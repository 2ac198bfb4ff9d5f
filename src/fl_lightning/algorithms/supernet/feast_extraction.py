"""Post-hoc extraction (FEAST Supp. E.3): search an architecture under a MAC limit with the
cache's training-free objective, cut it out of the trained supernet, recalibrate its batch
norm on the server's calibration split and score it, with no further training. The search
takes its ceiling, objective and seed from the run's own cache
(:mod:`fl_lightning.algorithms.supernet.extraction_search`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from fl_lightning.errors import ConfigError

_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_macs(text: str, key: str = "budget") -> float:
    """'30M', '1.5G', '25000000' -> MACs."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(key, f"expected a positive MAC count such as 30M or 1.5G, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def extract_subnet(feast, budget: float, rho: Optional[float], population: int, generations: int,
                   seed: Optional[int], batch_size: int, out: Optional[Path] = None, space: str = "trained",
                   reuse_cache: bool = True) -> dict:
    """Search, extract, recalibrate and score a subnet of ``feast``'s trained supernet (set up
    on a saved run); optionally save the subnet's weights and architecture to ``out``.
    ``rho`` and ``seed`` (None: derived from the run's cache), ``space`` and ``reuse_cache`` as
    in :func:`~fl_lightning.algorithms.supernet.extraction_search.extraction_search`."""
    from fl_lightning.algorithms.supernet.extraction_search import extraction_architecture, extraction_search, nearest_distance
    from fl_lightning.elastic.search.genetic import InfeasibleError
    from fl_lightning.elastic.specs import spec_to_dict
    from fl_lightning.runtime.checkpoint import save_checkpoint
    from fl_lightning.runtime.evaluation import evaluate

    ctx, cache = feast.ctx, feast.variants.cache
    settings = extraction_search(cache, budget, rho, seed, space, reuse_cache)
    try:
        found, answered = extraction_architecture(ctx.model, cache, budget, settings, population, generations)
    except InfeasibleError as error:
        hint = "; --space full searches beyond the cached variants' range" if space == "trained" else ""
        raise ConfigError("budget", f"{error}{hint}") from None
    subnet = feast.variants.calibrated_subnet(found.spec)
    result = {"budget": budget, "rho_limit": settings.rho_limit, "seed": settings.seed, "space": space,
              "reuse_cache": reuse_cache,
              "spec": str(found.spec), **spec_to_dict(found.spec), "macs": int(found.macs),
              "params": sum(p.numel() for p in subnet.parameters()),
              "searched": answered is None, "genes_from_cache": nearest_distance(found.spec, cache.specs)}
    for split in ("test", "val"):
        dataset, indices = ctx.data.split(split)
        if indices is None or len(indices):
            metrics = evaluate(ctx.fabric, subnet, dataset, indices, ctx.num_classes, batch_size)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    if out is not None and ctx.fabric.is_global_zero:
        save_checkpoint({"model": subnet.state_dict(), "spec": spec_to_dict(found.spec), "macs": int(found.macs)}, out)
        result["saved"] = str(out)
    return result
