"""Where a served model's batch-norm statistics come from: one part for every method family.

A model that is scored or served normalizes with running statistics, and those must describe
the population it is scored on. Four protocols (``docs/served_statistics.md``):

- ``aggregated``: the running statistics the clients (and a split method's server half)
  tracked with momentum, averaged position-wise with the examples as weights. FedAvg's
  original protocol; kept for comparison. Under heterogeneity it is wrong twice over: a
  narrow sub-model computes its leading channels from fewer inputs (their statistics are not
  the full width's), and a momentum average mostly remembers the last batches, i.e. one
  client's few classes.
- ``sbn``: HeteroFL's static batch norm. Clients normalize with batch statistics and track
  nothing, so no statistics are sent or aggregated; before evaluation every served model gets
  its statistics from one pass over data: the union of the client shards in a seeded order
  (``sbn_data: train``, the authors' code) or the server's calibration split (``calib``).
- ``recalibrate``: FEAST's protocol (Supp. E.1): statistics are tracked and aggregated as
  usual, and every served model is reset and re-estimated on the server's calibration split.
- ``client``: the pooled statistics of every batch the clients normalized in the round:
  each client's model pools its own batches (:class:`fl_lightning.elastic.bn.BatchMoments`),
  the round's accumulator pools the clients by their examples through second moments (the law
  of total variance: ``SparseAccumulator(pooled_variances=True)``), so no data leaves a client
  and no server data is needed.

Every estimation pass averages per-batch statistics (``momentum=None``), as both the authors'
BN layers and :func:`fl_lightning.elastic.bn.recalibrate_bn` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Literal, Sequence

import torch
from torch import nn

from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.elastic.bn import batch_moments, batch_norms, statistics_keys, use_batch_statistics
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.calibration import ServerCalibration, recalibrate_without_waiting
from fl_lightning.runtime.client_data import eval_batches
from fl_lightning.runtime.seeding import derive_seed

Protocol = Literal["aggregated", "sbn", "recalibrate", "client"]
SbnData = Literal["train", "calib"]
SBN_STREAM = 14  # seed stream of the sBN pass over the client data: its order and augmentation draw


@dataclass(frozen=True)
class StatisticsOptions:
    """A method's served-statistics choice, as its constructor resolves the ``bn`` options (the
    part :class:`ServedStatistics` is built from at set-up)."""

    protocol: Protocol = "aggregated"
    sbn_data: SbnData = "train"
    batch_size: int = CALIB_BATCH_SIZE
    """Batch size of the statistics pass (sbn and recalibrate)."""
    transform: Literal["train", "eval"] = "train"
    """Images of that pass through the training augmentation (train) or none (eval)."""


def without_statistics(routed: Routed) -> Routed:
    """The routed model training with batch statistics only, its BN statistics neither sent
    nor returned (the aggregate keeps the global values, which no protocol reads)."""
    use_batch_statistics(routed.module)
    return drop_statistics(routed)


def drop_statistics(routed: Routed) -> Routed:
    """``routed`` without its BN statistics' regions: they neither cross nor enter the aggregate."""
    dropped = statistics_keys(routed.module)
    return Routed(routed.module, {k: v for k, v in routed.regions.items() if k not in dropped})


def estimate_statistics(models: Sequence[nn.Module], batches: Iterable) -> int:
    """Reset and re-estimate every model's BN statistics on the same batches, in one pass
    (each model sees every batch once; the models do not interact), reading no device value
    per layer and batch (``runtime/calibration.py``)."""
    return recalibrate_without_waiting(nn.ModuleList(models), batches, forward=lambda x: [m(x) for m in models])


class ServedStatistics:
    """One method's served-statistics protocol: what its clients track and send, how the server
    pools it, and the statistics of every model it serves.

    Args:
        ctx: the run context (global model, data, seed, device).
        protocol: aggregated, sbn, recalibrate or client (above).
        sbn_data: the data of the sBN pass: train (the union of the client shards, as the
            authors' code) or calib (the server's calibration split, then the same images as
            ``recalibrate``).
        batch_size: batch size of the statistics pass.
        transform: train (the training augmentation, drawn once from a fixed seed) or eval.
    """

    def __init__(self, ctx, protocol: Protocol, sbn_data: SbnData, batch_size: int, transform: str):
        self.ctx, self.protocol, self.sbn_data = ctx, protocol, sbn_data
        self.estimated = protocol == "recalibrate" or protocol == "sbn"
        needs_calib = protocol == "recalibrate" or (protocol == "sbn" and sbn_data == "calib")
        self.calibration = ServerCalibration(ctx, batch_size, transform,
                                             required_by=f"BN protocol {protocol} passes" if needs_calib else None)
        self._served = None  # (key, models) of the last estimate

    # -- the client side ------------------------------------------------------------------------
    def prepare(self, module: nn.Module) -> None:
        """Set up a model a client (or a server half) is about to train: sbn tracks nothing;
        client pools the statistics of the batches from here on."""
        if self.protocol == "sbn":
            use_batch_statistics(module)
        elif self.protocol == "client":
            batch_moments(module)

    def exchanged(self, routed: Routed) -> Routed:
        """What of a routed model crosses the channel and enters the aggregate: under sbn,
        everything but the BN statistics."""
        return drop_statistics(routed) if self.protocol == "sbn" else routed

    def route(self, routed: Routed) -> Routed:
        """:meth:`prepare` then :meth:`exchanged`: a client's routed model under the protocol."""
        self.prepare(routed.module)
        return self.exchanged(routed)

    # -- the server side ------------------------------------------------------------------------
    @property
    def pooled_variances(self) -> bool:
        """Whether the round's accumulator pools variances as populations (client)."""
        return self.protocol == "client"

    def served(self, model: nn.Module) -> nn.Module:
        """The model to score for a global ``model``: a full-width copy with estimated
        statistics under sbn and recalibrate, the model itself otherwise."""
        if not self.estimated or not batch_norms(model):
            return model
        return self.models([model.max_spec()])[0]

    def models(self, specs: Sequence) -> List[nn.Module]:
        """The plain extracted model of every spec, on the device, statistics per protocol.
        Kept until the global model changes: an evaluation scores 'val' and 'test' on the same
        served models, and the statistics pass is deterministic, so it runs once."""
        key = (repr(list(specs)), self.model_version())
        if self._served is not None and self._served[0] == key:
            return self._served[1]
        device = self.ctx.fabric.device
        models = self.estimate([self.ctx.model.extract(spec).module.to(device) for spec in specs])
        self._served = (key, models)
        return models

    def model_version(self) -> tuple:
        """Changes whenever a tensor of the global model is written: every in-place write bumps
        a tensor's version counter, which the detached views of ``state_dict`` share."""
        return tuple(t._version for t in self.ctx.model.state_dict().values())

    def estimate(self, models: List[nn.Module]) -> List[nn.Module]:
        """``models`` (served networks over copies of the global model) with their BN statistics
        estimated in one pass per the protocol; unchanged under aggregated and client."""
        if not self.estimated or not any(batch_norms(m) for m in models):
            return models
        if self.protocol == "recalibrate" or self.sbn_data == "calib":
            estimate_statistics(models, self.calibration.batches())
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.ctx.seed, SBN_STREAM))
                estimate_statistics(models, self.client_batches())
        return models

    def client_batches(self):
        """The union of the client shards in one seeded order (drawn under the caller's seed),
        through the chosen transform; streamed, not kept."""
        data = self.ctx.data
        dataset = data.bundle.train if self.calibration.transform == "train" else data.bundle.train_eval
        indices = torch.cat([torch.as_tensor(c, dtype=torch.long) for c in data.clients])
        order = indices[torch.randperm(len(indices))]
        return eval_batches(dataset, order, self.calibration.batch_size, self.ctx.fabric.device)
