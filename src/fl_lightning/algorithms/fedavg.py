"""FedAvg: federated local training, the concrete method most others extend.

Each round (``Algorithm``'s hooks, as FedAvg fills them):

- ``plan``: a uniform sample of ``clients_per_round`` clients, every one training the whole
  model at the round's learning rate (``round_lr``).
- ``fit_cohort``: this rank's clients one after another, its global RNG seeded from (seed,
  round, client): the method builds the client's ``downlink`` (by default the global tensors
  routed into a local model, ``route``), the client's ``Channel`` counts it and hands it to the
  object ``new_client(task, plan)`` makes (``algorithms/client.py``), whose ``fit`` returns an
  ``Uplink`` that the channel counts in turn; ``client_figures`` adds the method's own figures of
  the task (a width, a level, costs). A method that trains its cohort jointly (MergeSFL)
  overrides it.
- ``commit``: the uplink's tensors into the round's weighted means (``weight``: its examples,
  or one per client); ``finish_round`` moves the global model to them (``apply``: through the
  server step when the method has one).
- ``evaluate``: the global model on a server split, with the statistics its
  served-statistics part gives it.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Literal, Optional, Tuple

import torch

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.algorithms.bn_protocol import Protocol, SbnData, StatisticsOptions
from fl_lightning.algorithms.client import Client, ClientRound, LocalClient
from fl_lightning.elastic.routing import Routed, full_region_map, load_routed_state
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.option_types import PositiveInt
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.context import RunContext
from fl_lightning.runtime.evaluation import evaluate
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.round_state import RoundAccumulator
from fl_lightning.runtime.schedule import round_lr
from fl_lightning.runtime.seeding import seed_client

Weighting = Literal["samples", "uniform"]


class FedAvg(Algorithm):
    """Federated averaging (McMahan et al., 2017): dense models, sample-weighted mean.

    Served BN statistics (``bn``): by default the clients' running statistics, averaged with
    everything else, as the original protocol; ``sbn``, ``recalibrate`` and ``client`` serve
    statistics of the population instead (``docs/served_statistics.md``).
    """

    server_step = None
    """The server's step (``runtime/server_optimizer.py``) when the method has one: ``apply``
    moves the global model through it; None: the global model takes the round's aggregate."""

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
        super().__init__(StatisticsOptions(bn if bn is not None else "aggregated", sbn_data, calib_batch_size,
                                           calib_transform), weighting if weighting is not None else "samples")

    def prepare(self, ctx: RunContext) -> None:
        """One reusable worker per rank: clients train one after another, and loading the
        global tensors into it copies values without allocating a model per client. Families
        and methods extend this (``super().prepare(ctx)`` first)."""
        self.worker = ctx.make_model().to(ctx.fabric.device)
        self.worker_regions = full_region_map(self.worker.state_dict())

    def plan(self, round_idx: int) -> RoundPlan:
        """The selector's cohort (uniform sampling without replacement); every client trains the
        whole model."""
        cohort = self.selector.cohort(round_idx)
        return RoundPlan(round_idx, self.round_lr(round_idx), [ClientTask(client) for client in cohort])

    def round_lr(self, round_idx: int) -> float:
        t = self.ctx.train
        return round_lr(t.lr, t.lr_schedule, round_idx, self.ctx.rounds, t.lr_decay)

    def fit_cohort(self, plan: RoundPlan, owned: List[ClientTask]) -> Iterator[Tuple[ClientTask, Uplink]]:
        """This rank's clients one after another, each with its global RNG seeded from
        (seed, round, client): the downlink through the client's channel to the client object,
        its uplink back through the same channel, then the method's figures of the task."""
        for task in owned:
            seed_client(self.ctx.seed, plan.round_idx, task.client)
            channel = Channel()
            downlink = channel.deliver(self.downlink(task, plan))
            uplink = channel.collect(self.new_client(task, plan).fit(downlink))
            uplink.metrics.update(self.client_figures(task, uplink, plan))
            yield task, uplink

    def downlink(self, task: ClientTask, plan: RoundPlan) -> Downlink:
        """What the server sends the client: by default the routed model (``route``)."""
        return Downlink(self.route(task, plan))

    def new_client(self, task: ClientTask, plan: RoundPlan) -> Client:
        """The object that runs the client's round (``algorithms/client.py``), made from the
        client's round and the method's settings, never from the method: by default local
        training with cross-entropy and SGD."""
        return LocalClient(self.client_round(task, plan))

    def client_round(self, task: ClientTask, plan: RoundPlan) -> ClientRound:
        """What the client is given for its round (task, learning rate, training settings, shard)."""
        return ClientRound.of(self.ctx, task, plan)

    def client_figures(self, task: ClientTask, result: Uplink, plan: RoundPlan) -> Dict[str, float]:
        """The method's own per-client figures of a trained client (its width, level, costs),
        logged beside the fit's; none by default."""
        return {}

    def route(self, task: ClientTask, plan: RoundPlan) -> Routed:
        """The global tensors the client trains, copied into the rank's worker."""
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        return self.statistics.route(Routed(self.worker, self.worker_regions))

    def commit(self, acc: RoundAccumulator, task: ClientTask, result: Uplink, plan: RoundPlan) -> None:
        """Write what a finite uplink teaches into the round's accumulator (nothing else):
        by default its model's tensors, weighted by :meth:`weight`."""
        if result.model is not None:
            acc.add(result.model.module.state_dict(), self.weight(result), result.model.regions)

    def weight(self, result: Uplink) -> float:
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

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Metrics of the global model on a server split ('val' or 'test'); ``acc`` is the
        figure that selects checkpoints on 'val'."""
        data = self.ctx.data
        dataset, indices = data.split(split)
        model = self.statistics.served(self.ctx.model)
        return evaluate(self.ctx.fabric, model, dataset, indices, data.bundle.num_classes, batch_size)


__all__ = ["FedAvg", "Weighting"]
