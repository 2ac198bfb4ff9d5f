"""The Fabric round loop: plan, fit each client, aggregate, evaluate, checkpoint.

Each rank trains a contiguous share of the round's plan, one client after another (an
algorithm whose clients share server state runs the whole plan on rank 0). The only
cross-rank traffic is one all-reduce of the aggregation accumulators (plus whatever sums the
algorithm asks for) and a gather of the clients' log rows. Every random draw is keyed by
(seed, round, client), so the result does not depend on how many ranks there are, and
resuming from a checkpoint replays nothing.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional

import torch
from lightning.fabric import Fabric

from fl_lightning.errors import ConfigError, Interrupted, RunError
from fl_lightning.federation import interrupts
from fl_lightning.federation.builder import Prepared, RunSpec, build_context, make_fabric, prepare_run
from fl_lightning.federation.log_tags import LAYOUT, RunTags
from fl_lightning.federation.loggers import RunLoggers, build_loggers
from fl_lightning.federation.progress import RoundProgress, end_line
from fl_lightning.runtime.checkpoint import check_model_state, load_checkpoint, load_model_state, save_checkpoint
from fl_lightning.federation.machine import hand_down, launched_by_command_line, placement_for, process_age
from fl_lightning.federation.provenance import METHOD, check_method, load_algorithm_state, method_record
from fl_lightning.federation.run_dir import RESUME, JsonLines, RunDir, flat_config
from fl_lightning.federation.run_lock import LOCK
from fl_lightning.runtime.collectives import all_gather_objects, lost_peer
from fl_lightning.runtime.evaluation import EvaluationPhase
from fl_lightning.runtime.output_files import OutputError, write_file
from fl_lightning.runtime.plan import RoundPlan
from fl_lightning.runtime.seeding import balanced_share

NOT_SUMMED = ("round", "client", "loss")  # client-row keys that make no sense summed


def run_fit(spec: RunSpec) -> dict:
    """Place the run on the machine (``devices`` and ``threads_per_rank`` auto), launch Fabric
    and run the federation; returns the summary on rank 0."""
    # Start-up is counted from the process's start on the command line, else from this call.
    # The start-up lines are the command line's; a run started from Python stays quiet.
    command_line = launched_by_command_line()
    origin = time.perf_counter() - (process_age() if command_line else 0.0)
    placement = placement_for(spec.fabric, spec.model, spec.data, spec.federation.clients_per_round,
                              bool(spec.algorithm.sequential_clients), spec.train.batch_size, spec.algorithm)
    spec = replace(spec, fabric=placement.apply(spec.fabric))
    if placement.ranks > 1 and placement.strategy is None and command_line:  # ranks re-run the command
        hand_down(placement)
    # what the data can refuse, refused before any rank starts: its one line is then all there is
    prepared = prepare_run(spec)
    if placement.line and command_line:  # rank 0 (the ranks it starts inherit its placement)
        print(f"{placement.line}; starting...", file=sys.stderr, flush=True)
    quiet_launch_banner()
    run_dir = RunDir(spec.out_dir, spec.name)
    loggers = build_loggers(spec.loggers, run_dir.path, spec.name, prepared.start_round)
    fabric = make_fabric(spec.fabric, loggers=loggers)
    forked = spec.fabric.strategy in ("ddp_fork", "ddp_notebook", "ddp_spawn")
    if spec.fabric.strategy == "ddp_spawn":  # spawned ranks would receive the data pickled: they build it
        prepared = None
    if not forked:
        result = fabric.launch(_fit, spec, run_dir, origin, forked, prepared)
        # Ranks started by torchrun leave the process group together: a rank whose process
        # group outlives the store's host can hang in teardown at exit.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return result
    with interrupts.forwarded_to_ranks() as interrupted:
        try:
            result = fabric.launch(_fit, spec, run_dir, origin, forked, prepared)
        except Exception:
            if interrupted():  # a rank ended without its answer: the CLI's generic interrupt line
                raise KeyboardInterrupt from None
            raise
    if isinstance(result, (ConfigError, RunError)):  # raised on rank 0 of forked ranks
        raise result
    return result


LAUNCH_BANNER = ("Initializing distributed: ", "-" * 20)
"""Fabric's lines as ranks join (one per rank, then a block naming the backend and the rank count)."""


def quiet_launch_banner() -> None:
    """Leave out Fabric's launch banner: the placement line says how many ranks start, and an
    error found once they run (an algorithm refusing its set-up) is then the only line."""
    from lightning_utilities.core import rank_zero  # its ``log`` is whichever Lightning set last

    for log in (logging.getLogger("lightning.fabric.utilities.distributed"), rank_zero.log):
        if not any(isinstance(f, _BannerFilter) for f in log.filters):
            log.addFilter(_BannerFilter())


class _BannerFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LAUNCH_BANNER)


def _fit(fabric: Fabric, spec: RunSpec, run_dir: RunDir, origin: float, forked: bool = False,
         prepared: Optional[Prepared] = None) -> dict:
    """One rank's run. Forked ranks return a ConfigError or RunError instead of raising it, so
    that it reaches the launching process as the one-line error it is."""
    # a folder holding nothing but this run's lock was created for this run
    fresh = not run_dir.path.exists() or all(p.name == LOCK for p in run_dir.path.iterdir())
    if forked:
        interrupts.take_once_on_rank()
    try:
        return Federation(fabric, spec, run_dir, origin, prepared).run()
    except ConfigError as error:
        # Bad input found only once data is read (a damaged image in a lazily loaded folder):
        # a run folder this call created holds nothing worth keeping, so it goes.
        if fresh and fabric.is_global_zero and not run_dir.last.exists():
            shutil.rmtree(run_dir.path, ignore_errors=True)
        if forked:
            return error
        raise
    except RunError as error:
        if forked:
            return error
        raise
    except BaseException:
        if forked and interrupts.requested():  # before the round loop, or a collective its peers left
            return Interrupted("interrupted; run the same command again (with --resume auto once a checkpoint exists)")
        raise


class Federation:
    """One run on one rank: set-up, the round loop, evaluation, checkpoints, summary."""

    def __init__(self, fabric: Fabric, spec: RunSpec, run_dir: RunDir, origin: Optional[float] = None,
                 prepared: Optional[Prepared] = None):
        """``origin``: the ``time.perf_counter()`` from which start-up is counted (default: now);
        ``prepared``: the data built before launch (``prepare_run``; default: built here)."""
        self.fabric, self.spec, self.run_dir = fabric, spec, run_dir
        self.origin = time.perf_counter() if origin is None else origin
        self.is_zero = fabric.is_global_zero
        before_launch = prepared.seconds if prepared is not None else 0.0
        # imports, checks, ranks joined (the data built before launch is counted as data)
        self.startup = {"launch": time.perf_counter() - self.origin - before_launch}
        self.ctx = build_context(spec, fabric, mode="fit", timings=self.startup, prepared=prepared)
        self.model, self.algorithm, self.fed = self.ctx.model, spec.algorithm, self.ctx.data
        self.start_round, self.best = 0, {"val_acc": -1.0, "round": -1}
        self.last_eval: tuple = (-1, {})  # (round, metrics) of the latest evaluate_round
        self.method = method_record(self.algorithm, spec.config_yaml)
        self.evaluation = EvaluationPhase(fabric, self.algorithm, self.fed, spec.eval.batch_size, spec.eval.client_test)
        self.tags = RunTags(self.algorithm.served_names)
        self.logs = RunLoggers(fabric.loggers, run_dir.path)
        self.logged_last: Optional[set] = None  # tags this call logged at the last round
        self.progress = RoundProgress(spec.name, spec.federation.rounds, shown=self.is_zero)
        if spec.resume_from:
            state = load_checkpoint(spec.resume_from, map_location=fabric.device, key="resume",
                                    required=("model", "algorithm", "round", "best"))
            check_method(state, self.method, spec.resume_from, key="resume")
            load_model_state(self.model, state["model"], spec.resume_from, key="resume")
            load_algorithm_state(self.algorithm, state["algorithm"], spec.resume_from, key="resume")
            if run_dir.best.is_file():  # read at the end of the run: it must fit now, before any write
                best = load_checkpoint(run_dir.best, map_location="cpu", key="resume", required=("model",))
                check_model_state(self.model.state_dict(), best["model"], run_dir.best, key="resume")
            self.start_round, self.best = int(state["round"]), dict(state["best"])
            if spec.stop_after is not None and spec.stop_after <= self.start_round:
                raise ConfigError("stop_after", f"the run is already at round {self.start_round}; pass a larger value")

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        spec, rounds = self.spec, self.spec.federation.rounds
        self._check_ranks_agree()
        self._open_outputs()
        if self.is_zero and launched_by_command_line():
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.startup.items())
            print(f"ready for round {self.start_round} after {time.perf_counter() - self.origin:.1f} s ({parts})",
                  file=sys.stderr,
                  flush=True)
        end = rounds if spec.stop_after is None else min(rounds, spec.stop_after)
        self.progress.start(self.start_round)
        round_idx = self.start_round
        try:
            for round_idx in range(self.start_round, end):
                started = time.perf_counter()
                row, clients = self.run_round(round_idx)
                best = False
                if (round_idx + 1) % spec.eval.every == 0 or round_idx + 1 == rounds:
                    metrics, best = self.evaluate_round(round_idx)
                    row.update(metrics)
                last = (round_idx + 1) % spec.checkpoint_every == 0 or round_idx + 1 == end
                self.write_round(row, clients, best, last)
                self.progress.round_done(row, time.perf_counter() - started)
        except (KeyboardInterrupt, Exception) as error:
            in_progress = max(round_idx, self.last_saved or 0)  # a save may have just completed the round
            if not isinstance(error, KeyboardInterrupt) and not interrupts.requested():
                reason = lost_peer(error) if self.fabric.world_size > 1 else None
                if reason is None:
                    raise
                # Another rank's process or node died: this rank cannot finish the round. Only
                # rank 0 writes, each file whole, so last.ckpt holds the last completed round.
                raise RunError(f"a rank left the run in round {in_progress} ({reason}); "
                               f"{self.checkpoint_held(resume=False)}; start every node again with "
                               "--resume auto") from None
            raise Interrupted(f"interrupted in round {in_progress}, {self.checkpoint_held()}") from None
        finally:
            self.progress.close()
        self.fabric.barrier()
        summary = {"rounds_done": end, "rounds": rounds}
        if end == rounds:
            summary.update(self.final_evaluation())
        self.on_zero(lambda: self._write_summary(summary))
        if self.is_zero:  # the summary stays in its file; the console ends with the method's table
            if launched_by_command_line():
                print(end_line(summary, self.run_dir.summary), file=sys.stderr, flush=True)
            report = self.algorithm.report(summary)
            if report:
                print(report)
        return summary

    def _write_summary(self, summary: dict) -> None:
        write_file(self.run_dir.summary, json.dumps(finite_or_null(summary), indent=2), then=RESUME)
        if "final" in summary and self.logged_last is not None:  # this call ran the last round
            self._log_end(summary)
        self.logs.finalize()

    def _log_end(self, summary: dict) -> None:
        """The end figures at their rounds: the last model's that the last round did not log
        (the test set with eval.test=final), the best-validation checkpoint's test figures at
        its round, and the flattened config with the headline figures as hyperparameters."""
        last = self.spec.federation.rounds - 1
        final = {tag: v for tag, v in self.tags.figures(summary["final"]).items() if tag not in self.logged_last}
        if final:
            self.logs.log(final, step=last)
        best = summary.get("best")
        if best:
            self.logs.log(self.tags.best(best), step=best["round"])
        headline = {"hparams/test_acc": summary["final"].get("test_acc"),
                    "hparams/best_test_acc": (best or {}).get("test_acc"),
                    "hparams/best_val_acc": (best or {}).get("val_acc")}
        headline = {k: v for k, v in headline.items() if isinstance(v, float) and math.isfinite(v)}
        self.logs.log_end(flat_config(self.spec.config_yaml), headline, step=last)

    def _check_ranks_agree(self) -> None:
        """Every rank continues from the same round. Nodes that read different run folders (no
        shared file system, or a node that kept a stale copy) would otherwise train on from
        different models; refused on every rank before anything is written."""
        if self.fabric.world_size == 1:
            return
        rounds = all_gather_objects(self.fabric, {self.fabric.global_rank: self.start_round})
        if len(set(rounds.values())) > 1:
            shown = ", ".join(f"rank {rank}: {done}" for rank, done in sorted(rounds.items()))
            raise ConfigError("resume", f"the ranks found different checkpoints (rounds done: {shown}); every node must "
                                        f"read the same run folder, {self.run_dir.path} (a shared file system)")

    def owned_tasks(self, plan: RoundPlan) -> list:
        """This rank's share of the plan (all of it on rank 0 for sequential-client methods)."""
        fabric = self.fabric
        if self.algorithm.sequential_clients:
            return list(plan.tasks) if fabric.global_rank == 0 else []
        work = [self.algorithm.work(task) for task in plan.tasks]
        return balanced_share(plan.tasks, work, fabric.global_rank, fabric.world_size)

    def run_round(self, round_idx: int) -> tuple[dict, List[dict]]:
        """Fit this rank's share of the plan, aggregate across ranks; returns the round's row
        and every client's log row (in plan order)."""
        fabric, algorithm = self.fabric, self.algorithm
        started = time.perf_counter()
        plan = algorithm.plan(round_idx)
        owned = self.owned_tasks(plan)
        acc = algorithm.new_accumulator(plan)
        rows: Dict[int, dict] = {}
        for task, result in algorithm.fit_cohort(plan, owned):
            problem = result.non_finite()
            if problem is None:
                algorithm.commit(acc, task, result, plan)
                acc.committed += 1
                rows[task.client] = result.row()
            else:  # left out of the round; the global model and the client's state stay as they were
                rows[task.client] = {**result.row(), "skipped": problem}
        acc.reduce(fabric, plan.cohort, [t.client for t in owned])
        rows = all_gather_objects(fabric, rows)
        clients = [{"round": round_idx, "client": c, **rows[c]} for c in plan.cohort]
        if acc.committed == 0:
            self.on_zero(lambda: self._log_clients(clients))
            reasons = "; ".join(f"client {r['client']}: {r['skipped']}" for r in clients[:3])
            raise RunError(f"round {round_idx}: every client's update was non-finite ({reasons}; all in "
                           f"{self.run_dir.clients.name}); {self.checkpoint_held(resume=False)}. Lower train.lr "
                           "or set train.grad_clip")
        figures = algorithm.finish_round(acc, plan)
        row = round_row(round_idx, plan.lr, clients, time.perf_counter() - started)
        row.update(figures)
        return row, clients

    # -- evaluation -----------------------------------------------------------------------------
    def _split_metrics(self, split: str) -> dict:
        metrics = self.evaluation(split)
        return {f"{split}_{k}": v for k, v in metrics.items()}

    def evaluate_round(self, round_idx: int) -> tuple[dict, bool]:
        """Validation (selects best.ckpt) and, with eval.test=every, the test set (never selects);
        returns the metrics and whether this model is the new best."""
        out, best = {}, False
        if len(self.fed.val):
            out.update(self._split_metrics("val"))
            if out["val_acc"] > self.best["val_acc"] and model_is_finite(self.model):
                self.best, best = {"val_acc": out["val_acc"], "round": round_idx}, True
        if self.spec.eval.test == "every":
            out.update(self._split_metrics("test"))
        self.last_eval = (round_idx, dict(out))
        return out, best

    def _final_split(self, split: str) -> dict:
        """The last model's metrics on ``split``: those of the last round's evaluation when it
        scored that split (the model has not changed since), else a fresh evaluation."""
        round_idx, metrics = self.last_eval
        kept = {k: v for k, v in metrics.items() if k.startswith(f"{split}_")}
        if round_idx == self.spec.federation.rounds - 1 and kept:
            return kept
        return self._split_metrics(split)

    def final_evaluation(self) -> dict:
        """Test metrics of the last model and of the best-validation checkpoint."""
        test = self._final_split("test")
        summary = {"final": dict(test)}
        if len(self.fed.val):
            summary["final"].update(self._final_split("val"))
        self.fabric.barrier()
        if self.best["round"] == self.spec.federation.rounds - 1:  # best.ckpt is the last model
            summary["best"] = {**self.best, **test}
        elif self.run_dir.best.exists():
            best = load_checkpoint(self.run_dir.best, map_location=self.fabric.device, key="checkpoint",
                                   required=("model",))
            check_method(best, self.method, self.run_dir.best, key="checkpoint")
            load_model_state(self.model, best["model"], self.run_dir.best, key="checkpoint")
            if "algorithm" in best:
                load_algorithm_state(self.algorithm, best["algorithm"], self.run_dir.best, key="checkpoint")
            summary["best"] = {**self.best, **self._split_metrics("test")}
        return summary

    # -- outputs --------------------------------------------------------------------------------
    # Rank 0 writes the run folder. Each batch of writes is one ``on_zero`` call, after which
    # every rank knows whether it succeeded: a full disk ends all ranks with rank 0's one line
    # instead of leaving the others waiting in the next round's all-reduce.
    def on_zero(self, write: Callable[[], None]) -> None:
        """Run ``write`` on rank 0; an OutputError there is raised on every rank."""
        failure = None
        if self.is_zero:
            try:
                write()
            except OutputError as error:
                failure = str(error)
        if self.fabric.world_size > 1:
            failure = self.fabric.broadcast(failure, src=0)
        if failure is not None:
            raise OutputError(failure)

    def _open_outputs(self) -> None:
        keep = self.start_round if self.spec.resume_from else None
        # rounds held by this folder's last.ckpt (None: no checkpoint yet, e.g. a fresh run)
        self.last_saved = self.start_round if self.run_dir.last.exists() else None
        self.on_zero(lambda: self._create_outputs(keep))
        self.fabric.barrier()

    def _create_outputs(self, keep: Optional[int]) -> None:
        self.run_dir.create()
        write_file(self.run_dir.path / "config.yaml", self.spec.config_yaml, then=RESUME)
        for name, text in self.algorithm.artifacts().items():
            write_file(self.run_dir.path / name, text, then=RESUME)
        save_checkpoint(self.fed.state_dict(), self.run_dir.path / "partition.pt")
        self.metrics = JsonLines(self.run_dir.metrics, keep)
        self.client_log = JsonLines(self.run_dir.clients, keep)
        self.tags.carry(self.metrics.kept)  # the cumulative costs run on from the resumed round
        self.progress.carry(self.metrics.kept)
        self.logs.open(LAYOUT, self.start_round)

    def write_round(self, row: dict, clients: List[dict], best: bool, last: bool) -> None:
        """The round's rows (metrics, clients, loggers), best.ckpt if this model is the best
        so far, and last.ckpt when due. The logs are written first: a resume drops rows past
        the checkpoint it continues from."""
        rounds_done = row["round"] + 1

        def write() -> None:
            self._log_round(row, clients)
            if best:  # the algorithm's state too: personalized methods score per-client models
                save_checkpoint(self._state(rounds_done), self.run_dir.best)
            if last:
                save_checkpoint(self._state(rounds_done), self.run_dir.last)
                # held from the moment it is on disk: a peer lost in the broadcast that follows
                # must not make rank 0 report that no checkpoint was written
                self.last_saved = rounds_done

        self.on_zero(write)
        if last:
            self.last_saved = rounds_done

    def _log_round(self, row: dict, clients: List[dict]) -> None:
        figures = self.tags.round_figures(row)
        self.logs.log(figures, step=row["round"])  # on disk each round: a full disk shows at this round
        if row["round"] == self.spec.federation.rounds - 1:
            self.logged_last = set(figures)
        self.metrics.write(finite_or_null(row))
        self._log_clients(clients)

    def _log_clients(self, clients: List[dict]) -> None:
        for client in clients:
            self.client_log.write(finite_or_null(client))

    def checkpoint_held(self, resume: bool = True) -> str:
        """What the run folder's last checkpoint holds, truthfully (there may be none yet). Rounds
        are counted from 0, as in metrics.jsonl: a checkpoint after 5 rounds holds round 4."""
        if self.last_saved is None:
            return "no checkpoint has been written yet" + (", run the same command to start again" if resume else "")
        held = f"the last checkpoint holds round {self.last_saved - 1}"
        return held + (", resume with --resume auto" if resume else "")

    def _state(self, rounds_done: int) -> dict:
        """What a checkpoint holds: weights, server state, progress and the method that wrote it."""
        return {"model": self.model.state_dict(), "algorithm": self.algorithm.state_dict(), "round": rounds_done,
                "best": self.best, METHOD: self.method}


def round_row(round_idx: int, lr: float, clients: List[dict], seconds: float) -> dict:
    """The round's figures from its clients' rows: the sample-weighted loss of the committed
    clients, and ``sum/<key>`` over the cohort for every numeric client metric (traffic
    counts whether or not the client was committed)."""
    committed = [c for c in clients if "skipped" not in c]
    samples = sum(c["samples"] for c in committed)
    row = {
        "round": round_idx,
        "lr": lr,
        "train_loss": sum(c["loss"] * c["samples"] for c in committed) / max(samples, 1),
        "round_seconds": seconds,
        "client_seconds_max": max((c.get("seconds", 0.0) for c in clients), default=0.0),
        "clients": len(clients),
        "clients_skipped": len(clients) - len(committed),
    }
    for client in clients:
        for key, value in client.items():
            if key not in NOT_SUMMED and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"sum/{key}"] = row.get(f"sum/{key}", 0) + value
    return row


def model_is_finite(model: torch.nn.Module) -> bool:
    return all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())


def finite_or_null(value):
    """``value`` with NaN and inf floats replaced by None, so it is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value
