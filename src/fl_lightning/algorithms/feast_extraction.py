"""Post-hoc extraction (FEAST Supp. E.3): search an architecture under a MAC limit with the
cache's training-free objective, cut it out of the trained supernet, recalibrate its batch
norm on the server's calibration split and score it, with no further training."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import extraction_rho

_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_macs(text: str, key: str = "budget") -> float:
    """'30M', '1.5G', '25000000' -> MACs."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(key, f"expected a positive MAC count such as 30M or 1.5G, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def extract_subnet(feast, budget: float, rho: Optional[float], population: int, generations: int, seed: int,
                   batch_size: int, out: Optional[Path] = None) -> dict:
    """Search, extract, recalibrate and score a subnet of ``feast``'s trained supernet (set up
    on a saved run); optionally save the subnet's weights and architecture to ``out``."""
    from fl_lightning.elastic.search.genetic import InfeasibleError, search
    from fl_lightning.elastic.specs import spec_to_dict
    from fl_lightning.runtime.checkpoint import save_checkpoint
    from fl_lightning.runtime.evaluation import evaluate

    ctx = feast.ctx
    rho = extraction_rho(budget) if rho is None else rho
    try:
        found = search(ctx.model, budget, rho, population=population, generations=generations, seed=seed)
    except InfeasibleError as error:
        raise ConfigError("budget", str(error)) from None
    subnet = feast.calibrated_subnet(found.spec)
    result = {"budget": budget, "rho_limit": rho, "spec": str(found.spec), "macs": int(found.macs),
              "params": sum(p.numel() for p in subnet.parameters())}
    for split in ("test", "val"):
        dataset, indices = ctx.data.split(split)
        if indices is None or len(indices):
            metrics = evaluate(ctx.fabric, subnet, dataset, indices, ctx.num_classes, batch_size)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    if out is not None and ctx.fabric.is_global_zero:
        save_checkpoint({"model": subnet.state_dict(), "spec": spec_to_dict(found.spec), "macs": int(found.macs)}, out)
        result["saved"] = str(out)
    return result
