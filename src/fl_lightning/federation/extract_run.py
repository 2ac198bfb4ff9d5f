"""Post-hoc extraction (FEAST Supp. E.3): search an architecture under a MAC limit with the
cache's training-free objective, cut it out of a trained supernet, recalibrate its batch norm
on the server's calibration split and score it, with no further training."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from fl_lightning.config import FabricConfig
from fl_lightning.errors import ConfigError

_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_macs(text: str, key: str = "budget") -> float:
    """'30M', '1.5G', '25000000' -> MACs."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(key, f"expected a positive MAC count such as 30M or 1.5G, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def default_rho(budget: float) -> float:
    """The cache-construction ceilings reused for extraction: 0.40 below 50M MACs, else 0.31."""
    return 0.40 if budget < 50e6 else 0.31


def extract_from_run(run: Path, budget: float, checkpoint: str, rho: Optional[float], population: int,
                     generations: int, seed: int, fabric_cfg: FabricConfig, out: Optional[Path]) -> dict:
    from fl_lightning.data.federated import build_federated_data
    from fl_lightning.elastic.bn import recalibrate_bn
    from fl_lightning.elastic.models.ofa_resnet import OFAResNet
    from fl_lightning.elastic.search.genetic import InfeasibleError, search
    from fl_lightning.federation.checkpoint import load_checkpoint
    from fl_lightning.federation.client_data import eval_batches
    from fl_lightning.federation.evaluate_run import checkpoint_path, load_run_args, run_spec
    from fl_lightning.federation.evaluation import evaluate
    from fl_lightning.federation.loop import build_global_model, make_fabric

    args = load_run_args(run)
    path = checkpoint_path(run, checkpoint)
    if args.model.name != "ofa_resnet":
        raise ConfigError("run", f"post-hoc extraction needs an ofa_resnet supernet, the run trained {args.model.name}")
    rho = default_rho(budget) if rho is None else rho
    fabric = make_fabric(fabric_cfg)
    fabric.launch()
    spec = run_spec(args, fabric_cfg)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    if len(fed.calib) == 0:
        raise ConfigError("run", "the run holds no server calibration split (data.calib_size: 0)")
    model: OFAResNet = build_global_model(spec, fed)
    model.load_state_dict(load_checkpoint(path)["model"])
    try:
        found = search(model, budget, rho, population=population, generations=generations, seed=seed)
    except InfeasibleError as error:
        raise ConfigError("budget", str(error)) from None
    subnet = model.extract(found.spec).module.to(fabric.device)
    calib_set, calib_idx = fed.split("calib")
    recalibrate_bn(subnet, (x for x, _ in eval_batches(calib_set, calib_idx, 100, fabric.device)))
    bundle = fed.bundle
    result = {"budget": budget, "rho_limit": rho, "spec": str(found.spec), "macs": int(found.macs),
              "params": sum(p.numel() for p in subnet.parameters()), "checkpoint": str(path)}
    for split in ("test", "val"):
        dataset, indices = fed.split(split)
        if indices is None or len(indices):
            metrics = evaluate(fabric, subnet, dataset, indices, bundle.num_classes, spec.eval.batch_size)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    if out is not None and fabric.is_global_zero:
        from fl_lightning.federation.checkpoint import save_checkpoint

        save_checkpoint({"model": subnet.state_dict(), "spec": {"d": list(found.spec.d), "e": list(found.spec.e),
                                                                 "w": list(found.spec.w)}, "macs": int(found.macs)}, out)
        result["saved"] = str(out)
    return result
