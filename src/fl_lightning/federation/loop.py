"""The Fabric round loop: sample, route, train clients, aggregate, evaluate, checkpoint.

Each rank trains a contiguous share of the round's cohort, one client after another. The only
cross-rank traffic is one all-reduce of the aggregation accumulators (plus whatever sums the
algorithm asks for). Every random draw is keyed by (seed, round, client), so the result does
not depend on how many ranks there are, and resuming from a checkpoint replays nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from tqdm import tqdm

from fl_lightning.algorithms.base import Algorithm, RunContext
from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                 ModelConfig, PartitionConfig)
from fl_lightning.data.federated import FederatedData, build_federated_data
from fl_lightning.elastic.models import build_model
from fl_lightning.federation.checkpoint import load_checkpoint, save_checkpoint
from fl_lightning.federation.client_data import ClientData
from fl_lightning.federation.evaluation import evaluate
from fl_lightning.federation.local_training import ClientResult, train_client
from fl_lightning.federation.run_dir import JsonLines, RunDir
from fl_lightning.federation.schedule import round_lr
from fl_lightning.federation.seeding import (client_generator, derive_seed, sample_clients, seed_client,
                                             shard_for_rank)

MODEL_INIT = 3  # seed stream of the global model's initialization


@dataclass
class RunSpec:
    """Everything a run needs, resolved and validated by the CLI."""

    name: str
    out_dir: str
    seed: int
    data: DataConfig
    partition: PartitionConfig
    model: ModelConfig
    train: LocalTrainConfig
    federation: FederationConfig
    eval: EvalConfig
    fabric: FabricConfig
    algorithm: Algorithm
    resume_from: Optional[str] = None
    config_yaml: str = ""
    checkpoint_every: int = 1
    stop_after: Optional[int] = None
    extras: dict = field(default_factory=dict)


def make_fabric(cfg: FabricConfig, loggers=None) -> Fabric:
    return Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes,
                  strategy=cfg.strategy, precision=cfg.precision, loggers=loggers)


def build_global_model(spec: RunSpec, fed: FederatedData) -> torch.nn.Module:
    """The global model, identically initialized on every rank."""
    torch.manual_seed(derive_seed(spec.seed, MODEL_INIT))
    return build_model(spec.model.name, fed.bundle.num_classes, fed.bundle.input_shape, **spec.model.kwargs)


def run_fit(spec: RunSpec) -> dict:
    """Launch Fabric and run the federation; returns the summary on rank 0."""
    run_dir = RunDir(spec.out_dir, spec.name)
    logger = TensorBoardLogger(root_dir=str(run_dir.path), name="tensorboard", version="")
    fabric = make_fabric(spec.fabric, loggers=[logger])
    return fabric.launch(_fit, spec, run_dir)


def _fit(fabric: Fabric, spec: RunSpec, run_dir: RunDir) -> dict:
    if spec.fabric.threads_per_rank:
        torch.set_num_threads(spec.fabric.threads_per_rank)
    fed = build_federated_data(spec.data, spec.partition, spec.seed)
    model = build_global_model(spec, fed).to(fabric.device)
    algorithm = spec.algorithm
    algorithm.setup(RunContext(
        fabric=fabric, model=model,
        make_model=lambda: build_model(spec.model.name, fed.bundle.num_classes, fed.bundle.input_shape,
                                       **spec.model.kwargs),
        num_clients=spec.partition.num_clients, client_sizes=[len(c) for c in fed.clients],
        train=spec.train, seed=spec.seed, budgets=fed.budgets, extras={"data": fed}))

    start_round, best = 0, {"val_acc": -1.0, "round": -1, "test_acc": None}
    if spec.resume_from:
        state = load_checkpoint(spec.resume_from, map_location=fabric.device)
        model.load_state_dict(state["model"])
        algorithm.load_state_dict(state["algorithm"])
        start_round, best = int(state["round"]), dict(state["best"])

    is_zero = fabric.is_global_zero
    if is_zero:
        run_dir.create()
        (run_dir.path / "config.yaml").write_text(spec.config_yaml)
        save_checkpoint(fed.state_dict(), run_dir.path / "partition.pt")
    fabric.barrier()
    metrics = JsonLines(run_dir.metrics, start_round if spec.resume_from else None) if is_zero else None
    client_log = JsonLines(run_dir.clients, start_round if spec.resume_from else None) if is_zero else None

    shards = [ClientData(fed.bundle.train, idx, spec.train.batch_size, fabric.device) for idx in fed.clients]
    rounds = spec.federation.rounds
    bar = tqdm(range(start_round, rounds), initial=start_round, total=rounds, desc=spec.name,
               unit="round", disable=not is_zero, dynamic_ncols=True)
    last_eval: dict = {}
    for round_idx in bar:
        if spec.stop_after is not None and round_idx >= spec.stop_after:
            break
        started = time.perf_counter()
        lr = round_lr(spec.train.lr, spec.train.lr_schedule, round_idx, rounds, spec.train.lr_decay)
        cohort = sample_clients(spec.seed, round_idx, spec.partition.num_clients, spec.federation.clients_per_round)
        owned = shard_for_rank(cohort, fabric.global_rank, fabric.world_size)
        acc = algorithm.new_accumulator()
        # Per cohort member: loss, samples, steps, seconds, values down, values up.
        stats = torch.zeros(len(cohort), 6, dtype=torch.float64, device=fabric.device)
        for client in owned:
            seed_client(spec.seed, round_idx, client)
            routed = algorithm.route(client, round_idx)
            module = algorithm.client_module(routed, client, round_idx, lr)
            result = train_client(fabric, module, shards[client], spec.train,
                                  client_generator(spec.seed, round_idx, client), client)
            algorithm.after_client(client, module, routed, result, lr)
            algorithm.accumulate(acc, routed, module, result)
            payload = _payload_bytes(routed, algorithm.global_state)
            stats[cohort.index(client)] = torch.tensor(
                [result.loss, result.num_samples, result.steps, result.seconds, payload, payload], dtype=torch.float64)
        sums = {**acc.tensors(), **algorithm.round_tensors(), "stats": stats}
        if fabric.world_size > 1:
            sums = fabric.all_reduce(sums, reduce_op="sum")
        acc.load_tensors(sums)
        algorithm.finish_round(acc.result(), sums, cohort, owned)

        row = _round_row(round_idx, lr, cohort, sums["stats"].cpu(), time.perf_counter() - started)
        if (round_idx + 1) % spec.eval.every == 0 or round_idx + 1 == rounds:
            last_eval = _evaluate_round(fabric, model, fed, spec)
            row.update(last_eval)
            if "val_acc" in last_eval and last_eval["val_acc"] > best["val_acc"]:
                best = {"val_acc": last_eval["val_acc"], "round": round_idx, "test_acc": last_eval.get("test_acc")}
                if is_zero:
                    save_checkpoint({"model": model.state_dict(), "round": round_idx + 1, "best": best}, run_dir.best)
        fabric.log_dict({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "round"}, step=round_idx)
        if is_zero:
            metrics.write(row)
            for i, client in enumerate(cohort):
                s = sums["stats"][i].tolist()
                client_log.write({"round": round_idx, "client": client, "loss": s[0], "samples": int(s[1]),
                                  "steps": int(s[2]), "seconds": s[3]})
            if "test_acc" in last_eval:
                bar.set_postfix(test_acc=f"{last_eval['test_acc']:.4f}", refresh=False)
            if (round_idx + 1) % spec.checkpoint_every == 0 or round_idx + 1 in (rounds, spec.stop_after):
                save_checkpoint({"model": model.state_dict(), "algorithm": algorithm.state_dict(),
                                 "round": round_idx + 1, "best": best}, run_dir.last)
        fabric.barrier()
    bar.close()
    done = min(rounds, spec.stop_after) if spec.stop_after is not None else rounds
    summary = {"rounds_done": done, "rounds": rounds, "final": last_eval, "best": best}
    if is_zero:
        run_dir.summary.write_text(json.dumps(summary, indent=2))
    for logger in fabric.loggers:
        logger.finalize("success")
    return summary


def _payload_bytes(routed, global_state) -> float:
    """Bytes of the routed tensors (parameters and buffers) in the server's precision."""
    return float(sum(region.numel() * global_state[key].element_size()
                     for key, region in routed.regions.values()))


def _round_row(round_idx: int, lr: float, cohort: list, stats: torch.Tensor, seconds: float) -> dict:
    samples = stats[:, 1]
    return {
        "round": round_idx,
        "lr": lr,
        "train_loss": float((stats[:, 0] * samples).sum() / samples.sum().clamp_min(1)),
        "round_seconds": seconds,
        "client_seconds_max": float(stats[:, 3].max()),
        "bytes_sent": float(stats[:, 4].sum()),
        "bytes_received": float(stats[:, 5].sum()),
        "clients": len(cohort),
    }


def _evaluate_round(fabric, model, fed: FederatedData, spec: RunSpec) -> dict:
    out = {}
    bundle = fed.bundle
    test = evaluate(fabric, model, bundle.test, None, bundle.num_classes, spec.eval.batch_size)
    out.update({"test_acc": test["acc"], "test_loss": test["loss"]})
    if len(fed.val):
        val = evaluate(fabric, model, bundle.train_eval, fed.val, bundle.num_classes, spec.eval.batch_size)
        out.update({"val_acc": val["acc"], "val_loss": val["loss"]})
    return out


def spec_summary(spec: RunSpec) -> dict:
    return {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in vars(spec).items()
            if k not in ("algorithm", "config_yaml")}
