"""Server-side policy interface, and FedAvg as its plainest implementation.

Each round the loop asks an algorithm for a plan, then hands it the plan's tasks one by one:

- ``plan(round_idx) -> RoundPlan``: the cohort and what each client trains (default: a
  uniform sample of ``clients_per_round`` clients training the whole model).
- ``fit_cohort(plan, owned)``: this rank's share of the plan, yielding ``(task, result)``; by
  default one client after another, each through the object ``new_client(task, plan)`` makes
  (``algorithms/client.py``). A method that trains its cohort jointly (MergeSFL's lock-stepped
  clients) overrides it.
- ``new_client(task, plan)``: one client's round as an object; its ``fit()`` returns the
  ``ClientResult``. The default (``LocalClient``) routes the global tensors into a local model
  (``route``), wraps it in a LightningModule (``client_module``) and runs local training; what
  crosses between server and client goes through the client's ``Channel`` (``send_model`` /
  ``return_model`` say what: by default the routed slices both ways); ``client_figures`` adds
  the method's own per-client figures. A method whose client does more (FedAS's alignment,
  FedGH's prototypes, the split methods' server half in the loop) returns its own client
  object, which keeps what the round learns about that client.
- ``new_accumulator(plan)``: the round's state (``runtime/round_state.py``): the global
  tensors' weighted means, plus whatever sums and client stores the method declares.
- ``commit(acc, task, result)``: what a finite result teaches, written into the accumulator
  and nowhere else. A client whose loss or update is not finite is never committed.
- ``finish_round(acc, plan)``: once the loop has reduced the accumulator over ranks (one
  reduction; no method calls a collective), apply it and return the round's figures.

Evaluation is a phase of the loop (``runtime.evaluation.EvaluationPhase``): ``evaluate(split)``
scores on the server what the method serves (the global model; HeteroFL's tiers, FEAST's
variants), and a method whose clients keep models of their own returns them from
``client_models(split)``, which the phase scores on each client's test shard.

Everything an algorithm keeps across rounds is returned by ``state_dict`` and checkpointed.

Algorithm modules import client modules (Lightning) and models inside the methods that use
them, so that the command line can list and parse algorithms in about a second.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Literal, Optional, Tuple

import torch

from fl_lightning.algorithms.bn_protocol import Protocol, SbnData
from fl_lightning.algorithms.client import Client, LocalClient
from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.routing import Routed, full_region_map, load_routed_state
from fl_lightning.feast_protocol import CALIB_BATCH_SIZE
from fl_lightning.option_types import PositiveInt
from fl_lightning.runtime.channel import DOWN, UP, Channel
from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.evaluation import evaluate
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.round_state import RoundAccumulator
from fl_lightning.runtime.schedule import round_lr
from fl_lightning.runtime.seeding import sample_clients, seed_client


Weighting = Literal["samples", "uniform"]

class Algorithm:
    """Base policy: every client trains the whole model; dense sample-weighted averaging.

    This is FedAvg; other algorithms override the hooks they change.
    """

    dense = True
    """Every client returns every tensor (a plain average); False: position-wise counts."""
    default_bn = "aggregated"
    """The family's served-statistics protocol when ``bn`` is not given."""
    bn = default_bn
    """Where served models get their BN statistics (``bn_protocol.ServedStatistics``); the
    families that expose it as an option set it in their constructor."""
    sbn_data, calib_batch_size, calib_transform = "train", CALIB_BATCH_SIZE, "train"
    default_weighting = "samples"
    """A committed result's weight in the round's means when ``weighting`` is not given."""
    weighting = default_weighting
    sequential_clients = False
    """True when a round's clients must train one after another against shared server state
    (SplitFed V2's single server model): the whole cohort then runs on rank 0, in plan order,
    so a multi-rank run gives the single-rank result."""

    def check(self, train: LocalTrainConfig) -> None:
        """Refuse configurations the algorithm does not define (raise ConfigError)."""

    def setup(self, ctx: RunContext) -> None:
        """The set-up every method goes through, in this order: its options checked, the run's
        context and the global tensors kept, its served-statistics part built (which checks
        the ``bn`` options before any work), then :meth:`prepare`. Families and methods extend
        ``prepare``, not this, so none can skip a step."""
        self.check(ctx.train)
        self.ctx = ctx
        self.global_state = ctx.model.state_dict()
        self.statistics = self.served_statistics(ctx)
        self.kept = []
        self.prepare(ctx)

    def prepare(self, ctx: RunContext) -> None:
        """The family's and the method's own set-up (``ctx``, ``global_state`` and
        ``statistics`` are there already). By default one reusable worker per rank: clients
        train one after another, and loading the global tensors into it copies values
        without allocating a model per client."""
        self.worker = ctx.make_model().to(ctx.fabric.device)
        self.worker_regions = full_region_map(self.worker.state_dict())

    def served_statistics(self, ctx: RunContext):
        """The method's served-statistics part, per its ``bn`` options."""
        from fl_lightning.algorithms.bn_protocol import ServedStatistics

        return ServedStatistics(ctx, self.bn, self.sbn_data, self.calib_batch_size, self.calib_transform)

    server_step = None
    """The server's step (``runtime/server_optimizer.py``) when the method has one: ``apply``
    moves the global model through it; None: the global model takes the round's aggregate."""
    kept = ()

    def keep(self, part):
        """Checkpoint ``part`` with the method (a client-state store, the server step: anything
        whose ``state_dict`` keys are its own and whose ``load_state_dict`` takes the method's
        whole state, picking its keys); returns it."""
        self.kept.append(part)
        return part

    def artifacts(self) -> Dict[str, str]:
        """Files (name -> text) written into the run folder once it is created."""
        return {}

    # -- a round --------------------------------------------------------------------------------
    def plan(self, round_idx: int) -> RoundPlan:
        """Uniform sampling without replacement; every client trains the whole model."""
        ctx = self.ctx
        cohort = sample_clients(ctx.seed, round_idx, ctx.num_clients, ctx.clients_per_round)
        return RoundPlan(round_idx, self.round_lr(round_idx), [ClientTask(client) for client in cohort])

    def round_lr(self, round_idx: int) -> float:
        t = self.ctx.train
        return round_lr(t.lr, t.lr_schedule, round_idx, self.ctx.rounds, t.lr_decay)

    def work(self, task: ClientTask) -> float:
        """The client's estimated training work this round, relative to the others' (ranks
        share a round's clients by it): its number of examples."""
        return float(len(self.ctx.shards[task.client]))

    def fit_cohort(self, plan: RoundPlan, owned: List[ClientTask]) -> Iterator[Tuple[ClientTask, ClientResult]]:
        """This rank's clients one after another, each with its global RNG seeded from
        (seed, round, client)."""
        for task in owned:
            seed_client(self.ctx.seed, plan.round_idx, task.client)
            yield task, self.new_client(task, plan).fit()

    def new_client(self, task: ClientTask, plan: RoundPlan) -> Client:
        """The object that runs the client's round (``algorithms/client.py``): by default local
        training of what ``route`` gives, through ``send_model`` / ``client_module`` /
        ``return_model`` / ``client_figures``."""
        return LocalClient(self, task, plan)

    def client_figures(self, task: ClientTask, result: ClientResult, plan: RoundPlan) -> Dict[str, float]:
        """The method's own per-client figures of a trained client (its width, level, costs),
        logged beside the fit's; none by default."""
        return {}

    def send_model(self, channel: Channel, routed: Routed, task: ClientTask) -> None:
        """What the server sends a client to train: the routed slices."""
        channel.send_routed(DOWN, routed)

    def return_model(self, channel: Channel, routed: Routed, task: ClientTask) -> None:
        """What a client sends back: the slices it received, trained."""
        channel.send_routed(UP, routed)

    def route(self, task: ClientTask, plan: RoundPlan) -> Routed:
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        return self.statistics.route(Routed(self.worker, self.worker_regions))

    def client_module(self, routed: Routed, task: ClientTask, plan: RoundPlan):
        """The LightningModule that trains ``routed.module`` (plain cross-entropy and SGD)."""
        from fl_lightning.modules.supervised import SupervisedClient

        t = self.ctx.train
        return SupervisedClient(routed.module, plan.lr, t.momentum, t.weight_decay)

    def new_accumulator(self, plan: RoundPlan) -> RoundAccumulator:
        """The round's accumulator (``runtime/round_state.py``): the global tensors' weighted
        means; a method declares its own sums and registers its client stores here."""
        return RoundAccumulator(SparseAccumulator(self.global_state, dense=self.dense,
                                                  pooled_variances=self.statistics.protocol == "client"))

    def commit(self, acc: RoundAccumulator, task: ClientTask, result: ClientResult, plan: RoundPlan) -> None:
        """Write what a finite result teaches into the round's accumulator (nothing else):
        by default its tensors, weighted by :meth:`weight`."""
        if result.update is not None:
            acc.add(result.update.module.state_dict(), self.weight(result), result.update.regions)

    def weight(self, result: ClientResult) -> float:
        """A committed result's weight in the round's means: its examples (samples) or one
        per client (uniform)."""
        return float(result.num_samples) if self.weighting == "samples" else 1.0

    def finish_round(self, acc: RoundAccumulator, plan: RoundPlan) -> Dict[str, float]:
        """Apply the reduced accumulator to the server's state; returns the round's figures
        for the metrics file and TensorBoard (none by default)."""
        self.apply(acc.result())
        return {}

    def apply(self, new_state: Dict[str, torch.Tensor]) -> None:
        """Move the global model to new values: through the server step when the method has
        one, else by writing them."""
        if self.server_step is not None:
            self.server_step.apply(new_state)
            return
        with torch.no_grad():
            for key, value in new_state.items():
                self.global_state[key].copy_(value)

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Metrics of the global model on a server split ('val' or 'test'); ``acc`` is the
        figure that selects checkpoints on 'val'."""
        data = self.ctx.data
        dataset, indices = data.split(split)
        model = self.statistics.served(self.ctx.model)
        return evaluate(self.ctx.fabric, model, dataset, indices, data.bundle.num_classes, batch_size)

    def client_models(self, split: str):
        """The clients' own models to score on ``split`` (a ``ClientModels``), or None: the
        method serves only what ``evaluate`` scores (the default)."""
        return None

    def report(self, summary: dict) -> str:
        """Text printed at the end of a run (tables of the final evaluation); empty by default."""
        return ""

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Server state beyond the global model: the kept parts' (none for FedAvg). A method
        with state of its own extends it (``{**super().state_dict(), ...}``)."""
        out: Dict[str, torch.Tensor] = {}
        for part in self.kept:
            out.update(part.state_dict())
        return out

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for part in self.kept:
            part.load_state_dict(state)


class FedAvg(Algorithm):
    """Federated averaging (McMahan et al., 2017): dense models, sample-weighted mean.

    Served BN statistics (``bn``): by default the clients' running statistics, averaged with
    everything else, as the original protocol; ``sbn``, ``recalibrate`` and ``client`` serve
    statistics of the population instead (``docs/served_statistics.md``).
    """

    def __init__(self, bn: Optional[Protocol] = None, sbn_data: SbnData = "train",
                 calib_batch_size: PositiveInt = CALIB_BATCH_SIZE, calib_transform: Literal["train", "eval"] = "train",
                 weighting: Optional[Weighting] = None):
        """
        Args:
            bn: where served models get their BN statistics: aggregated (the clients' tracked
                statistics, averaged), sbn (static BN: clients track none, one pass over
                ``sbn_data`` before evaluation), recalibrate (tracked, then re-estimated on the
                server's calibration split) or client (the pooled statistics of the batches
                the clients normalized in the round). None: the method's own default
                (FedAvg's: aggregated; docs/served_statistics.md lists every method's).
            sbn_data: the sBN pass's data: train (the union of the client shards, as HeteroFL's
                code) or calib (the server's calibration split).
            calib_batch_size: batch size of the statistics pass (sbn and recalibrate).
            calib_transform: images of that pass through the training augmentation (train,
                drawn once from a fixed seed) or none (eval).
            weighting: a client's weight in the round's means: samples (its examples, McMahan
                et al.'s n_k / n) or uniform (one per client, the plain mean several authors'
                code takes). None: the method's own default (samples; FedMut's: uniform).
        """
        self.bn, self.sbn_data = bn if bn is not None else self.default_bn, sbn_data
        self.weighting = weighting if weighting is not None else self.default_weighting
        self.calib_batch_size, self.calib_transform = calib_batch_size, calib_transform
