"""The server-side interface every method implements: a small abstract ``Algorithm``.

Each round the loop asks an algorithm for a plan, then hands it the plan's tasks:

- ``plan(round_idx) -> RoundPlan``: the cohort and what each client trains; ``work(task)``
  estimates each task's training work, by which ranks share the round's clients.
- ``fit_cohort(plan, owned)``: this rank's share of the plan, yielding ``(task, result)``.
- ``new_accumulator(plan)``: the round's state (``runtime/round_state.py``): the global
  tensors' weighted means, plus whatever sums and client stores the method declares.
- ``commit(acc, task, result, plan)``: what a finite result teaches, written into the
  accumulator and nowhere else. A client whose loss or update is not finite is never committed.
- ``finish_round(acc, plan)``: once the loop has reduced the accumulator over ranks (one
  reduction; no method calls a collective), apply it and return the round's figures.
- ``evaluate(split)`` scores on the server what the method serves (the global model;
  HeteroFL's tiers, FEAST's variants); ``client_models(split)`` returns the clients' own models
  when they keep some, which the evaluation phase scores on each client's test shard.
- ``check`` refuses options the method does not define (before any work), ``prepare`` is the
  method's set-up, ``artifacts`` the files it writes into the run folder, ``report`` its
  end-of-run text.

Those twelve are the hooks. ``setup`` (the set-up template: check, context, served
statistics, prepare), ``keep`` and ``state_dict`` / ``load_state_dict`` are the base's and no
method overrides them: what a method keeps across rounds is a part it registers with
``keep`` (``runtime/kept_state.py``, a client-state store, the server step), which the base
checkpoints.

``fedavg.py`` is the concrete method most others extend: federated local training, one client
object per task (``algorithms/client.py``).

Algorithm modules import client modules (Lightning) and models inside the methods that use
them, so that the command line can list and parse algorithms in about a second.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Iterator, List, Tuple

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.feast_protocol import CALIB_BATCH_SIZE
from fl_lightning.runtime.client_selection import UniformSelection
from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.round_state import RoundAccumulator


class Algorithm(ABC):
    """A federated method as the loop sees it: twelve hooks, and the set-up and checkpointing
    of the base."""

    dense = True
    """Every client returns every tensor (a plain average); False: position-wise counts."""
    default_bn = "aggregated"
    """The family's served-statistics protocol when ``bn`` is not given."""
    bn = default_bn
    """Where served models get their BN statistics (``bn_protocol.ServedStatistics``); the
    families that expose it as an option set it in their constructor."""
    sbn_data, calib_batch_size, calib_transform = "train", CALIB_BATCH_SIZE, "train"
    sequential_clients = False
    """True when a round's clients must train one after another against shared server state
    (SplitFed V2's single server model): the whole cohort then runs on rank 0, in plan order,
    so a multi-rank run gives the single-rank result."""
    kept = ()

    # -- set-up and state: the base's, never overridden ----------------------------------------
    def setup(self, ctx: RunContext) -> None:
        """The set-up every method goes through, in this order: its options checked, the run's
        context and the global tensors kept, its served-statistics part built (which checks
        the ``bn`` options before any work) and its client selector (uniform; a method may
        replace it), then :meth:`prepare`."""
        from fl_lightning.algorithms.bn_protocol import ServedStatistics

        self.check(ctx.train)
        self.ctx = ctx
        self.global_state = ctx.model.state_dict()
        self.statistics = ServedStatistics(ctx, self.bn, self.sbn_data, self.calib_batch_size, self.calib_transform)
        self.selector = UniformSelection(ctx.seed, ctx.num_clients, ctx.clients_per_round)
        self.kept = []
        self.prepare(ctx)

    def keep(self, part):
        """Checkpoint ``part`` with the method (``runtime/kept_state.py``, a client-state store,
        the server step: anything whose ``state_dict`` keys are its own and whose
        ``load_state_dict`` takes the method's whole state, picking its keys); returns it."""
        self.kept.append(part)
        return part

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Server state beyond the global model: the kept parts'."""
        out: Dict[str, torch.Tensor] = {}
        for part in self.kept:
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for part in self.kept:
            part.load_state_dict(state)

    # -- the hooks ---------------------------------------------------------------------------
    def check(self, train: LocalTrainConfig) -> None:
        """Refuse configurations the algorithm does not define (raise ConfigError)."""

    def prepare(self, ctx: RunContext) -> None:
        """The method's own set-up (``ctx``, ``global_state`` and ``statistics`` are there
        already); it registers what it keeps across rounds with :meth:`keep`."""

    def artifacts(self) -> Dict[str, str]:
        """Files (name -> text) written into the run folder once it is created."""
        return {}

    @abstractmethod
    def plan(self, round_idx: int) -> RoundPlan:
        """The round's cohort, in order, and what each client trains."""

    def work(self, task: ClientTask) -> float:
        """The client's estimated training work this round, relative to the others' (ranks
        share a round's clients by it): its number of examples."""
        return float(len(self.ctx.shards[task.client]))

    @abstractmethod
    def fit_cohort(self, plan: RoundPlan, owned: List[ClientTask]) -> Iterator[Tuple[ClientTask, ClientResult]]:
        """Train this rank's clients of the plan, yielding each ``(task, result)``."""

    def new_accumulator(self, plan: RoundPlan) -> RoundAccumulator:
        """The round's accumulator (``runtime/round_state.py``): the global tensors' weighted
        means; a method declares its own sums and registers its client stores here."""
        return RoundAccumulator(SparseAccumulator(self.global_state, dense=self.dense,
                                                  pooled_variances=self.statistics.protocol == "client"))

    @abstractmethod
    def commit(self, acc: RoundAccumulator, task: ClientTask, result: ClientResult, plan: RoundPlan) -> None:
        """Write what a finite result teaches into the round's accumulator (nothing else)."""

    @abstractmethod
    def finish_round(self, acc: RoundAccumulator, plan: RoundPlan) -> Dict[str, float]:
        """Apply the reduced accumulator to the server's state; returns the round's figures
        for the metrics file and TensorBoard."""

    @abstractmethod
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Metrics of what the method serves on a server split ('val' or 'test'); ``acc`` is
        the figure that selects checkpoints on 'val'."""

    def client_models(self, split: str):
        """The clients' own models to score on ``split`` (a ``ClientModels``), or None: the
        method serves only what ``evaluate`` scores (the default)."""
        return None

    def report(self, summary: dict) -> str:
        """Text printed at the end of a run (tables of the final evaluation); empty by default."""
        return ""


__all__ = ["Algorithm", "RunContext"]
