"""Re-evaluate a checkpoint of a finished (or interrupted) run."""

from __future__ import annotations

from pathlib import Path

from fl_lightning.config import FabricConfig
from fl_lightning.data.federated import build_federated_data
from fl_lightning.errors import ConfigError
from fl_lightning.federation.checkpoint import load_checkpoint
from fl_lightning.federation.run_dir import RunDir


def load_run_args(run: Path):
    """The run's saved config, parsed and instantiated exactly as ``fit`` parsed it."""
    from fl_lightning.cli import build_parser

    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(run / "config.yaml")])
    return parser.instantiate(cfg).fit


def evaluate_run(run: Path, checkpoint: str, fabric_cfg: FabricConfig) -> dict:
    from fl_lightning.federation.loop import RunSpec, _evaluate_round, build_global_model, make_fabric

    args = load_run_args(run)
    run_dir = RunDir(str(run.parent), run.name)
    path = {"best": run_dir.best, "last": run_dir.last}.get(checkpoint, Path(checkpoint))
    if not Path(path).is_file():
        raise ConfigError("checkpoint", f"no checkpoint at {path}")
    spec = RunSpec(name=args.name, out_dir=args.out_dir, seed=args.seed, data=args.data,
                   partition=args.partition, model=args.model, train=args.train,
                   federation=args.federation, eval=args.eval, fabric=fabric_cfg, algorithm=args.algorithm)
    fabric = make_fabric(fabric_cfg)
    fabric.launch()
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed).to(fabric.device)
    state = load_checkpoint(path, map_location=fabric.device)
    model.load_state_dict(state["model"])
    result = _evaluate_round(fabric, model, fed, spec)
    result.update({"checkpoint": str(path), "round": int(state["round"])})
    return result
