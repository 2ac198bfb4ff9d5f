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


def checkpoint_path(run: Path, checkpoint: str) -> Path:
    """'best', 'last' or a path, checked to exist."""
    run_dir = RunDir(str(run.parent), run.name)
    path = Path({"best": run_dir.best, "last": run_dir.last}.get(checkpoint, checkpoint))
    if not path.is_file():
        raise ConfigError("checkpoint", f"no checkpoint at {path}")
    return path


def run_spec(args, fabric_cfg: FabricConfig):
    """The saved run's RunSpec with another device configuration."""
    from fl_lightning.federation.loop import RunSpec

    return RunSpec(name=args.name, out_dir=args.out_dir, seed=args.seed, data=args.data,
                   partition=args.partition, model=args.model, train=args.train,
                   federation=args.federation, eval=args.eval, fabric=fabric_cfg, algorithm=args.algorithm)


def evaluate_run(run: Path, checkpoint: str, fabric_cfg: FabricConfig) -> dict:
    """The run's algorithm evaluates the checkpoint on the test set and validation split (FEAST:
    every cached variant after BN recalibration)."""
    from fl_lightning.algorithms.base import RunContext
    from fl_lightning.elastic.models import build_model
    from fl_lightning.federation.loop import build_global_model, make_fabric

    args = load_run_args(run)
    path = checkpoint_path(run, checkpoint)
    spec = run_spec(args, fabric_cfg)
    fabric = make_fabric(fabric_cfg)
    fabric.launch()
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    bundle = fed.bundle
    model = build_global_model(spec, fed).to(fabric.device)
    state = load_checkpoint(path, map_location=fabric.device)
    model.load_state_dict(state["model"])
    algorithm = spec.algorithm
    algorithm.setup(RunContext(
        fabric=fabric, model=model,
        make_model=lambda: build_model(spec.model.name, bundle.num_classes, bundle.input_shape, **spec.model.kwargs),
        num_clients=spec.partition.num_clients, client_sizes=[len(c) for c in fed.clients], train=spec.train,
        seed=spec.seed, budgets=fed.budgets,
        extras={"data": fed, "run_dir": run, "rounds": spec.federation.rounds,
                "clients_per_round": spec.federation.clients_per_round, "resuming": True}))
    result = {"checkpoint": str(path), "round": int(state["round"])}
    for split in ("test", "val"):
        if split == "test" or len(fed.val):
            metrics = algorithm.evaluate(fabric, split, spec.eval.batch_size)
            result.update({f"{split}_{k}": v for k, v in metrics.items()})
    return result
