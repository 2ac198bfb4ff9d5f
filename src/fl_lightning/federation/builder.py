"""From a resolved config to a set-up run: Fabric, data, global model, algorithm.

``fit``, ``evaluate`` and ``extract`` build their run here, so a saved run is re-scored with
exactly the data, model and algorithm state it was trained with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
from lightning.fabric import Fabric

from fl_lightning.config import FabricConfig
from fl_lightning.data.federated import FederatedData, build_federated_data
from fl_lightning.elastic.models import build_model
from fl_lightning.errors import ConfigError
from fl_lightning.federation.machine import physical_cores, resolve_threads
from fl_lightning.federation.memory import check_model_fits
from fl_lightning.federation.run_dir import RunDir
from fl_lightning.federation.run_spec import RunSpec
from fl_lightning.runtime.checkpoint import check_model_state, load_checkpoint
from fl_lightning.runtime.client_data import ClientData, batched_form, training_batches
from fl_lightning.runtime.context import Population, RunContext
from fl_lightning.runtime.seeding import derive_seed

MODEL_INIT = 3  # seed stream of the global model's initialization


def make_fabric(cfg: FabricConfig, loggers=None) -> Fabric:
    """Fabric for ``cfg``; ``devices: auto`` not placed by ``fit`` (evaluate, extract) is one rank
    (on one device, whatever ``ranks_per_device`` says)."""
    devices = 1 if cfg.devices == "auto" else cfg.devices
    strategy = cfg.strategy
    if cfg.ranks_per_device > 1 and cfg.devices != "auto":
        strategy = shared_device_strategy(cfg, devices)
    try:
        return Fabric(accelerator=cfg.accelerator, devices=devices, num_nodes=cfg.num_nodes,
                      strategy=strategy, precision=cfg.precision, loggers=loggers)
    except (ValueError, RuntimeError, ImportError, TypeError) as error:  # combinations Fabric refuses
        raise ConfigError("fabric", " ".join(str(error).split())) from None


SHARED_DEVICE_START = {"auto": "popen", "ddp": "popen", "ddp_fork": "fork", "ddp_spawn": "spawn"}
"""How the ranks of ``ranks_per_device > 1`` start, per strategy that allows it."""


def shared_device_strategy(cfg: FabricConfig, devices: int):
    """Fabric's ddp with ``ranks_per_device`` ranks on each of ``devices`` devices (Fabric places
    local rank r on ``parallel_devices[r]``) and gloo between them: NCCL refuses two ranks on
    one GPU, and the round's one reduction is small next to its training."""
    from lightning.fabric.strategies import DDPStrategy

    if cfg.strategy not in SHARED_DEVICE_START:
        raise ConfigError("fabric.ranks_per_device", f"{cfg.ranks_per_device} ranks per device need strategy "
                                                     f"auto or ddp, not {cfg.strategy}")
    if cfg.accelerator in ("cuda", "gpu") or (cfg.accelerator == "auto" and torch.cuda.is_available()):
        parallel = [torch.device("cuda", d) for d in range(devices) for _ in range(cfg.ranks_per_device)]
    elif cfg.accelerator in ("cpu", "auto"):
        parallel = [torch.device("cpu")] * (devices * cfg.ranks_per_device)
    else:
        raise ConfigError("fabric.ranks_per_device", f"{cfg.ranks_per_device} ranks per device run on cuda or cpu, "
                                                     f"not {cfg.accelerator}")
    return DDPStrategy(parallel_devices=parallel, process_group_backend="gloo",
                       start_method=SHARED_DEVICE_START[cfg.strategy])


def set_threads(fabric: Fabric, cfg: FabricConfig, sequential: bool = False) -> None:
    """torch's intra-op threads on this rank (``threads_per_rank``; auto: 1, or every physical
    core for a sequential-client method on CPU; None keeps Lightning's ``cores // ranks``).
    Float reductions split over threads round differently, so only equal thread counts give
    bit-identical results across rank counts (docs/runtime.md)."""
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
    source = training_batches(bundle.train, fabric.device, spec.data.augment_on)  # one per rank, every shard's
    shards = [ClientData(bundle.train, idx, spec.train.batch_size, fabric.device, source=source) for idx in fed.clients]
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
    """What ``fit`` builds before its ranks launch: the federated data, the seconds it took, and
    the round the run continues from (0 for a fresh run)."""

    data: FederatedData
    seconds: float
    start_round: int = 0


def prepare_run(spec: RunSpec) -> Prepared:
    """Build the run's data and check every checkpoint the run will read against the model it
    builds, before any rank is launched or any file written: what only the data can refuse (a
    pool too small for the clients, server splits larger than the dataset, a test fraction that
    leaves no training examples) and a checkpoint of another size end in one line. Forked ranks
    inherit the data; ranks started by a launcher each prepare their own."""
    started = time.perf_counter()
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    seconds = time.perf_counter() - started
    batched_form(fed.bundle.train, spec.data.augment_on)  # data.augment_on: device refused here, not on the ranks
    with torch.device("meta"):  # shapes and costs only
        model = build_model(spec.model, fed.bundle.num_classes, fed.bundle.input_shape)
    # what the method can refuse only from the population (a searched cache no client can use)
    spec.algorithm.check(spec.train, Population(fed.budgets, model, tuple(fed.bundle.input_shape)))
    checkpoints, start_round = [], 0
    if spec.resume_from is not None:
        best = RunDir(spec.out_dir, spec.name).best
        checkpoints = [Path(spec.resume_from)] + ([best] if best.is_file() else [])
    if checkpoints:
        expected = model.state_dict()
        for path in checkpoints:
            state = load_checkpoint(path, key="resume", required=("model",))
            check_model_state(expected, state["model"], path, key="resume", names=False)
            if path == checkpoints[0]:
                start_round = int(state.get("round", 0))
    return Prepared(fed, seconds, start_round)
