"""From a resolved config to a set-up run: Fabric, data, global model, algorithm.

``fit``, ``evaluate`` and ``extract`` build their run here, so a saved run is re-scored with
exactly the data, model and algorithm state it was trained with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from lightning.fabric import Fabric

from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                 PartitionConfig)
from fl_lightning.data.federated import FederatedData, build_federated_data
from fl_lightning.elastic.models import build_model
from fl_lightning.errors import ConfigError
from fl_lightning.federation.memory import check_model_fits
from fl_lightning.runtime.client_data import ClientData
from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.seeding import derive_seed

MODEL_INIT = 3  # seed stream of the global model's initialization


@dataclass
class RunSpec:
    """Everything a run needs, resolved and validated by the CLI."""

    name: str
    out_dir: str
    seed: int
    data: DataConfig
    partition: PartitionConfig
    model: Any
    """The model section: ``class_path`` and ``init_args`` (``fl_lightning.elastic.models``)."""
    train: LocalTrainConfig
    federation: FederationConfig
    eval: EvalConfig
    fabric: FabricConfig
    algorithm: Any
    """The server-side algorithm (an ``fl_lightning.algorithms.Algorithm``)."""
    resume_from: Optional[str] = None
    config_yaml: str = ""
    checkpoint_every: int = 1
    stop_after: Optional[int] = None

    @property
    def run_path(self) -> Path:
        return Path(self.out_dir) / self.name


def make_fabric(cfg: FabricConfig, loggers=None) -> Fabric:
    """Fabric for ``cfg``; ``devices: auto`` not placed by ``fit`` (evaluate, extract) is one rank."""
    devices = 1 if cfg.devices == "auto" else cfg.devices
    try:
        return Fabric(accelerator=cfg.accelerator, devices=devices, num_nodes=cfg.num_nodes,
                      strategy=cfg.strategy, precision=cfg.precision, loggers=loggers)
    except (ValueError, RuntimeError, ImportError, TypeError) as error:  # combinations Fabric refuses
        raise ConfigError("fabric", " ".join(str(error).split())) from None


def set_threads(fabric: Fabric, cfg: FabricConfig, sequential: bool = False) -> None:
    """torch's intra-op threads on this rank (``threads_per_rank``; auto: 1, or every physical
    core for a sequential-client method on CPU; None keeps Lightning's ``cores // ranks``).
    Float reductions split over threads round differently, so only equal thread counts give
    bit-identical results across rank counts (docs/runtime.md)."""
    from fl_lightning.federation.machine import physical_cores, resolve_threads

    on_gpu = fabric.device.type != "cpu"
    threads = resolve_threads(cfg.threads_per_rank, sequential, on_gpu,
                              physical_cores() if cfg.threads_per_rank == "auto" else 1)
    if threads:
        torch.set_num_threads(threads)


def build_global_model(spec: RunSpec, fed: FederatedData) -> torch.nn.Module:
    """The global model, identically initialized on every rank."""
    torch.manual_seed(derive_seed(spec.seed, MODEL_INIT))
    return build_model(spec.model, fed.bundle.num_classes, fed.bundle.input_shape)


def build_context(spec: RunSpec, fabric: Fabric, mode: Literal["fit", "evaluate"] = "fit",
                  timings: Optional[dict] = None, prepared: Optional["Prepared"] = None) -> RunContext:
    """Data, global model and client shards on this rank, with the algorithm set up on them;
    ``timings`` (if given) receives the seconds of each part (data, model, algorithm).
    ``prepared``: the data ``prepare_run`` built before the ranks launched (else built here).

    Nothing is written: an algorithm that refuses the set-up (a ConfigError) leaves no trace.
    """
    timings = {} if timings is None else timings
    set_threads(fabric, spec.fabric, bool(getattr(spec.algorithm, "sequential_clients", False)))
    started = time.perf_counter()
    fed = prepared.data if prepared is not None else build_federated_data(spec.data, spec.partition, spec.seed)
    bundle = fed.bundle
    timings["data"] = prepared.seconds if prepared is not None else time.perf_counter() - started
    started = time.perf_counter()
    check_model_fits(spec.model, bundle.num_classes, bundle.input_shape, fabric.device)
    model = build_global_model(spec, fed).to(fabric.device)
    shards = [ClientData(bundle.train, idx, spec.train.batch_size, fabric.device) for idx in fed.clients]
    ctx = RunContext(
        fabric=fabric, model=model,
        make_model=lambda: build_model(spec.model, bundle.num_classes, bundle.input_shape),
        data=fed, shards=shards, train=spec.train, seed=spec.seed, rounds=spec.federation.rounds,
        clients_per_round=spec.federation.clients_per_round, run_dir=spec.run_path, mode=mode,
        resuming=mode == "evaluate" or spec.resume_from is not None)
    timings["model"] = time.perf_counter() - started
    started = time.perf_counter()
    spec.algorithm.setup(ctx)
    timings["algorithm"] = time.perf_counter() - started
    return ctx


@dataclass
class Prepared:
    """What ``fit`` builds before its ranks launch: the federated data, and the seconds it took."""

    data: FederatedData
    seconds: float


def prepare_run(spec: RunSpec) -> Prepared:
    """Build the run's data and check every checkpoint the run will read against the model it
    builds, before any rank is launched or any file written: what only the data can refuse (a
    pool too small for the clients, server splits larger than the dataset, a test fraction that
    leaves no training examples) and a checkpoint of another size end in one line. Forked ranks
    inherit the data; ranks started by a launcher each prepare their own."""
    from fl_lightning.federation.run_dir import RunDir
    from fl_lightning.runtime.checkpoint import check_model_state, load_checkpoint

    started = time.perf_counter()
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    seconds = time.perf_counter() - started
    checkpoints = []
    if spec.resume_from is not None:
        best = RunDir(spec.out_dir, spec.name).best
        checkpoints = [Path(spec.resume_from)] + ([best] if best.is_file() else [])
    if checkpoints:
        with torch.device("meta"):  # shapes only
            expected = build_model(spec.model, fed.bundle.num_classes, fed.bundle.input_shape).state_dict()
        for path in checkpoints:
            state = load_checkpoint(path, key="resume", required=("model",))
            check_model_state(expected, state["model"], path, key="resume", names=False)
    return Prepared(fed, seconds)
