"""Where an evaluated sub-model's batch-norm statistics come from.

Three protocols (``docs/heterofl_supernet.md``):

- ``aggregated``: the running statistics the clients tracked, averaged position-wise with the
  weights (the sub-model study's evaluation).
- ``sbn``: HeteroFL's static batch norm. Clients normalize with batch statistics and track
  nothing, so no statistics are sent or aggregated (:func:`without_statistics`); before
  evaluation every served model gets its statistics from one pass over data. The authors' code
  passes the whole training set (``sbn_data: train``: the union of the client shards here);
  ``sbn_data: calib`` uses the server's calibration split instead.
- ``recalibrate``: FEAST's protocol (Supp. E.1): running statistics are tracked and aggregated
  as usual, and every evaluated operating point is reset and re-estimated on the server's
  calibration split, with FEAST's own images, order and augmentation draw.

Every pass averages per-batch statistics (``momentum=None``), as both the authors' BN layers
and :func:`fl_lightning.elastic.bn.recalibrate_bn` do.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

import torch
from torch import nn

from fl_lightning.elastic.bn import recalibrate_bn, statistics_keys, use_batch_statistics
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.calibration import ServerCalibration
from fl_lightning.runtime.client_data import eval_batches
from fl_lightning.runtime.seeding import derive_seed

SBN_STREAM = 14  # seed stream of the sBN pass over the client data: its order and augmentation draw


def without_statistics(routed: Routed) -> Routed:
    """The routed model training with batch statistics only, its BN statistics neither sent
    nor returned (the aggregate keeps the global values, which no protocol reads)."""
    dropped = statistics_keys(routed.module)
    use_batch_statistics(routed.module)
    return Routed(routed.module, {k: v for k, v in routed.regions.items() if k not in dropped})


def _inputs(batch):
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def estimate_statistics(models: Sequence[nn.Module], batches: Iterable) -> int:
    """Reset and re-estimate every model's BN statistics on the same batches, in one pass
    (each model sees every batch once; the models do not interact)."""
    group = nn.ModuleList(models)
    return recalibrate_bn(group, batches, forward=lambda batch: [m(_inputs(batch)) for m in models])


class ServedStatistics:
    """Builds the served models of a list of specs with BN statistics per ``protocol``.

    Args:
        ctx: the run context (global model, data, seed, device).
        protocol: aggregated, sbn or recalibrate (above).
        sbn_data: the data of the sBN pass: train (the union of the client shards, as the
            authors' code) or calib (the server's calibration split, then the same images as
            ``recalibrate``).
        batch_size: batch size of the statistics pass.
        transform: train (the training augmentation, drawn once from a fixed seed) or eval.
    """

    def __init__(self, ctx, protocol: str, sbn_data: str, batch_size: int, transform: str):
        self.ctx, self.protocol, self.sbn_data = ctx, protocol, sbn_data
        needs_calib = protocol == "recalibrate" or (protocol == "sbn" and sbn_data == "calib")
        self.calibration = ServerCalibration(ctx, batch_size, transform,
                                             required_by=f"BN protocol {protocol} passes" if needs_calib else None)

    def models(self, specs: Sequence) -> List[nn.Module]:
        """The plain extracted model of every spec, on the device, statistics per protocol."""
        device = self.ctx.fabric.device
        models = [self.ctx.model.extract(spec).module.to(device) for spec in specs]
        if self.protocol == "recalibrate" or (self.protocol == "sbn" and self.sbn_data == "calib"):
            estimate_statistics(models, self.calibration.batches())
        elif self.protocol == "sbn":
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
