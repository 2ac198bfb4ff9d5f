"""The Fabric round loop: sample, route, train clients, aggregate, evaluate, checkpoint.

Each rank trains a contiguous share of the round's cohort, one client after another. The only
cross-rank traffic is one all-reduce of the aggregation accumulators (plus whatever sums the
algorithm asks for). Every random draw is keyed by (seed, round, client), so the result does
not depend on how many ranks there are, and resuming from a checkpoint replays nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
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
from fl_lightning.federation.collectives import all_reduce_sum
from fl_lightning.federation.local_training import train_client
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
    return Federation(fabric, spec, run_dir).run()


class Federation:
    """One run on one rank: set-up, the round loop, evaluation, checkpoints, summary."""

    def __init__(self, fabric: Fabric, spec: RunSpec, run_dir: RunDir):
        if spec.fabric.threads_per_rank:
            torch.set_num_threads(spec.fabric.threads_per_rank)
        self.fabric, self.spec, self.run_dir = fabric, spec, run_dir
        self.is_zero = fabric.is_global_zero
        self.fed = build_federated_data(spec.data, spec.partition, spec.seed)
        bundle = self.fed.bundle
        self.model = build_global_model(spec, self.fed).to(fabric.device)
        self.algorithm = spec.algorithm
        self.algorithm.setup(RunContext(
            fabric=fabric, model=self.model,
            make_model=lambda: build_model(spec.model.name, bundle.num_classes, bundle.input_shape,
                                           **spec.model.kwargs),
            num_clients=spec.partition.num_clients, client_sizes=[len(c) for c in self.fed.clients],
            train=spec.train, seed=spec.seed, budgets=self.fed.budgets,
            extras={"data": self.fed, "run_dir": run_dir.path, "rounds": spec.federation.rounds,
                    "clients_per_round": spec.federation.clients_per_round,
                    "resuming": spec.resume_from is not None}))
        self.shards = [ClientData(bundle.train, idx, spec.train.batch_size, fabric.device) for idx in self.fed.clients]
        self.start_round, self.best = 0, {"val_acc": -1.0, "round": -1}
        if spec.resume_from:
            state = load_checkpoint(spec.resume_from, map_location=fabric.device)
            self.model.load_state_dict(state["model"])
            self.algorithm.load_state_dict(state["algorithm"])
            self.start_round, self.best = int(state["round"]), dict(state["best"])

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        spec, rounds = self.spec, self.spec.federation.rounds
        self._open_outputs()
        end = rounds if spec.stop_after is None else min(rounds, spec.stop_after)
        bar = tqdm(range(self.start_round, end), initial=self.start_round, total=rounds, desc=spec.name,
                   unit="round", disable=not self.is_zero, dynamic_ncols=True)
        for round_idx in bar:
            row, stats = self.run_round(round_idx)
            if (round_idx + 1) % spec.eval.every == 0 or round_idx + 1 == rounds:
                row.update(self.evaluate_round(round_idx))
                if "test_acc" in row:
                    bar.set_postfix(test_acc=f"{row['test_acc']:.4f}", refresh=False)
                elif "val_acc" in row:
                    bar.set_postfix(val_acc=f"{row['val_acc']:.4f}", refresh=False)
            self._log_round(row, stats)
            if (round_idx + 1) % spec.checkpoint_every == 0 or round_idx + 1 == end:
                self._save_last(round_idx + 1)
        bar.close()
        self.fabric.barrier()
        summary = {"rounds_done": end, "rounds": rounds}
        if end == rounds:
            summary.update(self.final_evaluation())
        if self.is_zero:
            self.run_dir.summary.write_text(json.dumps(summary, indent=2))
            report = self.algorithm.report(summary)
            if report:
                print(report)
        for logger in self.fabric.loggers:
            logger.finalize("success")
        return summary

    def run_round(self, round_idx: int) -> tuple[dict, torch.Tensor]:
        """Train the round's cohort (this rank's share) and aggregate across ranks."""
        spec, fabric, algorithm = self.spec, self.fabric, self.algorithm
        started = time.perf_counter()
        lr = round_lr(spec.train.lr, spec.train.lr_schedule, round_idx, spec.federation.rounds, spec.train.lr_decay)
        cohort = sample_clients(spec.seed, round_idx, spec.partition.num_clients, spec.federation.clients_per_round)
        owned = shard_for_rank(cohort, fabric.global_rank, fabric.world_size)
        acc = algorithm.new_accumulator()
        # Per cohort member: loss, samples, steps, seconds, bytes down, bytes up.
        stats = torch.zeros(len(cohort), 6, dtype=torch.float64, device=fabric.device)
        for client in owned:
            seed_client(spec.seed, round_idx, client)
            routed = algorithm.route(client, round_idx)
            module = algorithm.client_module(routed, client, round_idx, lr)
            result = train_client(fabric, module, self.shards[client], spec.train,
                                  client_generator(spec.seed, round_idx, client), client)
            algorithm.after_client(client, module, routed, result, lr)
            algorithm.accumulate(acc, routed, module, result)
            payload = _payload_bytes(routed, algorithm.global_state)
            stats[cohort.index(client)] = torch.tensor(
                [result.loss, result.num_samples, result.steps, result.seconds, payload, payload], dtype=torch.float64)
        sums = all_reduce_sum(fabric, {**acc.tensors(), **algorithm.round_tensors(), "stats": stats})
        acc.load_tensors(sums)
        algorithm.finish_round(acc.result(), sums, cohort, owned)
        stats = sums["stats"].cpu()
        row = _round_row(round_idx, lr, cohort, stats, time.perf_counter() - started)
        row.update(algorithm.round_metrics(sums))
        return row, stats

    # -- evaluation -----------------------------------------------------------------------------
    def _split_metrics(self, split: str) -> dict:
        metrics = self.algorithm.evaluate(self.fabric, split, self.spec.eval.batch_size)
        return {f"{split}_{k}": v for k, v in metrics.items()}

    def evaluate_round(self, round_idx: int) -> dict:
        """Validation (selects best.ckpt) and, with eval.test=every, the test set (never selects)."""
        out = {}
        if len(self.fed.val):
            out.update(self._split_metrics("val"))
            if out["val_acc"] > self.best["val_acc"]:
                self.best = {"val_acc": out["val_acc"], "round": round_idx}
                if self.is_zero:
                    save_checkpoint({"model": self.model.state_dict(), "round": round_idx + 1, "best": self.best},
                                    self.run_dir.best)
        if self.spec.eval.test == "every":
            out.update(self._split_metrics("test"))
        return out

    def final_evaluation(self) -> dict:
        """Test metrics of the last model and of the best-validation checkpoint."""
        test = self._split_metrics("test")
        summary = {"final": dict(test)}
        if len(self.fed.val):
            summary["final"].update(self._split_metrics("val"))
        self.fabric.barrier()
        if self.best["round"] == self.spec.federation.rounds - 1:  # best.ckpt is the last model
            summary["best"] = {**self.best, **test}
        elif self.run_dir.best.exists():
            best = load_checkpoint(self.run_dir.best, map_location=self.fabric.device)
            self.model.load_state_dict(best["model"])
            summary["best"] = {**self.best, **self._split_metrics("test")}
        return summary

    # -- outputs --------------------------------------------------------------------------------
    def _open_outputs(self) -> None:
        keep = self.start_round if self.spec.resume_from else None
        if self.is_zero:
            self.run_dir.create()
            (self.run_dir.path / "config.yaml").write_text(self.spec.config_yaml)
            save_checkpoint(self.fed.state_dict(), self.run_dir.path / "partition.pt")
            self.metrics = JsonLines(self.run_dir.metrics, keep)
            self.client_log = JsonLines(self.run_dir.clients, keep)
        self.fabric.barrier()

    def _log_round(self, row: dict, stats: torch.Tensor) -> None:
        round_idx, cohort = row["round"], row.pop("cohort")
        self.fabric.log_dict({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "round"},
                             step=round_idx)
        if not self.is_zero:
            return
        self.metrics.write(row)
        for client, s in zip(cohort, stats.tolist()):
            self.client_log.write({"round": round_idx, "client": client, "loss": s[0], "samples": int(s[1]),
                                   "steps": int(s[2]), "seconds": s[3]})

    def _save_last(self, rounds_done: int) -> None:
        if self.is_zero:
            save_checkpoint({"model": self.model.state_dict(), "algorithm": self.algorithm.state_dict(),
                             "round": rounds_done, "best": self.best}, self.run_dir.last)


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
        "cohort": cohort,
    }
