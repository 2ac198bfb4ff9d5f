"""The server-side interface every method implements: a small abstract ``Algorithm``.

Each round the loop asks an algorithm for a plan, then hands it the plan's tasks:

- ``plan(round_idx) -> RoundPlan``: the cohort and what each client trains; ``work(task)``
  estimates each task's training work, by which ranks share the round's clients.
- ``fit_cohort(plan, owned)``: this rank's share of the plan, yielding ``(task, uplink)``: what
  each client sent back (``runtime/link.py``), counted by its channel.
- ``new_accumulator(plan)``: the round's state (``runtime/round_state.py``): the global
  tensors' weighted means, plus whatever sums and client stores the method declares.
- ``commit(acc, task, uplink, plan)``: what a finite uplink teaches, written into the
  accumulator and nowhere else; it reads the uplink only. A client whose loss or update is not
  finite is never committed.
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
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from fl_lightning.algorithms.bn_protocol import ServedStatistics, StatisticsOptions
from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.runtime.client_selection import UniformSelection
from fl_lightning.runtime.context import Population, RunContext
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.link import Uplink
from fl_lightning.runtime.round_state import RoundAccumulator


class Algorithm(ABC):
    """A federated method as the loop sees it: twelve hooks, and the set-up and checkpointing
    of the base.

    Its switches are set by its constructor (``super().__init__(...)``, nothing read from class
    attributes): ``statistics`` (a ``bn_protocol.StatisticsOptions``: where served models get
    their BN statistics), ``weighting`` (a committed client's weight in the round's means:
    samples or uniform), ``dense`` (every client returns every tensor, a plain average; False:
    position-wise counts) and ``sequential_clients`` (a round's clients train one after another
    against shared server state, SplitFed V2's single server model: the whole cohort then runs
    on rank 0, in plan order, so a multi-rank run gives the single-rank result).
    """

    kept = ()

    def __init__(self, statistics: StatisticsOptions = StatisticsOptions(), weighting: str = "samples",
                 dense: bool = True, sequential_clients: bool = False):
        self.statistics_options = statistics
        self.weighting, self.dense, self.sequential_clients = weighting, dense, sequential_clients

    @property
    def bn(self) -> str:
        """Where served models get their BN statistics (``bn_protocol.ServedStatistics``)."""
        return self.statistics_options.protocol

    @property
    def served_names(self) -> Dict[str, str]:
        """The served models' names in the logs, by ``evaluate`` figure key (e.g.
        ``{"variant03_acc": "variant03 4.46M MACs"}``): a method serving several models names
        them by their MACs; empty by default (``federation/log_tags.py``)."""
        return {}

    # -- set-up and state: the base's, never overridden ----------------------------------------
    def setup(self, ctx: RunContext) -> None:
        """The set-up every method goes through, in this order: its options checked, the run's
        context and the global tensors kept, its served-statistics part built (which checks
        the ``bn`` options before any work) and its client selector (uniform; a method may
        replace it), then :meth:`prepare`."""
        self.check(ctx.train, Population(ctx.budgets, ctx.model, tuple(ctx.data.bundle.input_shape)))
        self.ctx = ctx
        self.global_state = ctx.model.state_dict()
        o = self.statistics_options
        self.statistics = ServedStatistics(ctx, o.protocol, o.sbn_data, o.batch_size, o.transform)
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
    def check(self, train: LocalTrainConfig, population: Optional[Population] = None) -> None:
        """Refuse configurations the algorithm does not define (raise ConfigError): from the
        options alone, and with ``population`` (the clients' budgets, the model's shapes) what
        only they can refuse, before any rank starts."""

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
    def fit_cohort(self, plan: RoundPlan, owned: List[ClientTask]) -> Iterator[Tuple[ClientTask, Uplink]]:
        """Train this rank's clients of the plan, yielding each ``(task, result)``."""

    def new_accumulator(self, plan: RoundPlan) -> RoundAccumulator:
        """The round's accumulator (``runtime/round_state.py``): the global tensors' weighted
        means; a method declares its own sums and registers its client stores here."""
        return RoundAccumulator(SparseAccumulator(self.global_state, dense=self.dense,
                                                  pooled_variances=self.statistics.protocol == "client"))

    @abstractmethod
    def commit(self, acc: RoundAccumulator, task: ClientTask, result: Uplink, plan: RoundPlan) -> None:
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
