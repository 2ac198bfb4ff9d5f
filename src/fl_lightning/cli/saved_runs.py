"""Open a saved run again (``evaluate``, ``extract``): its config, data, model and algorithm,
built by the same run builder as ``fit``, with a checkpoint's weights loaded."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fl_lightning.cli.parser import load_fit_config
from fl_lightning.config import FabricConfig
from fl_lightning.errors import ConfigError
from fl_lightning.federation.builder import build_context, make_fabric
from fl_lightning.federation.provenance import check_method, load_algorithm_state, method_record
from fl_lightning.federation.run_dir import RunDir
from fl_lightning.federation.run_spec import RunSpec
from fl_lightning.runtime.checkpoint import load_checkpoint, load_model_state
from fl_lightning.runtime.context import RunContext


@dataclass
class SavedRun:
    spec: RunSpec
    ctx: RunContext
    checkpoint: Path
    round: int
    """Rounds done when the checkpoint was written."""


def load_run_spec(run: Path) -> RunSpec:
    """The run's saved config, parsed and instantiated exactly as ``fit`` parsed it, named after
    its folder."""
    config = run / "config.yaml"
    if not config.is_file():
        raise ConfigError("run", f"{run} holds no config.yaml (not a run directory)")
    return replace(load_fit_config(config, key="run"), name=run.name, out_dir=str(run.parent),
                   config_yaml=config.read_text())


def checkpoint_path(run: Path, checkpoint: str) -> Path:
    """'best', 'last' or a path, checked to exist."""
    run_dir = RunDir(str(run.parent), run.name)
    path = Path({"best": run_dir.best, "last": run_dir.last}.get(checkpoint, checkpoint))
    if not path.is_file():
        raise ConfigError("checkpoint", f"no checkpoint at {path}")
    return path


def open_saved_run(run: Path, checkpoint: str, fabric_cfg: FabricConfig) -> SavedRun:
    """Launch Fabric with ``fabric_cfg`` and rebuild the run around the checkpoint's weights."""
    spec = replace(load_run_spec(run), fabric=fabric_cfg)
    path = checkpoint_path(run, checkpoint)
    fabric = make_fabric(fabric_cfg)
    fabric.launch()
    state = load_checkpoint(path, map_location=fabric.device, key="checkpoint", required=("model", "round"))
    check_method(state, method_record(spec.algorithm, spec.config_yaml), path, key="checkpoint")
    ctx = build_context(spec, fabric, mode="evaluate")
    load_model_state(ctx.model, state["model"], path, key="checkpoint")
    if "algorithm" in state:  # per-client state (personalized methods) and server-side extras
        load_algorithm_state(spec.algorithm, state["algorithm"], path, key="checkpoint")
    return SavedRun(spec, ctx, path, int(state.get("round", 0)))
