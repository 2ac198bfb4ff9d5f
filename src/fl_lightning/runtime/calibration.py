"""The server's batch-norm calibration (FEAST Supp. B): the calibration split's images in
fixed-order batches, drawn once per run and identical for every operating point (with
``transform: train`` the training augmentation is drawn once, from a seed stream of its own,
and kept), and any extracted model's BN statistics re-estimated on them. Every method that
scores operating points as FEAST does shares it: FEAST, FIARSE, ScaleFL and the sub-model
study's BN protocols."""

from __future__ import annotations

from typing import List, Optional

import torch

from fl_lightning.errors import ConfigError
from fl_lightning.runtime.client_data import eval_batches
from fl_lightning.runtime.seeding import derive_seed

CALIBRATION_STREAM = 13
"""Seed stream of the calibration images' augmentation draw."""


class ServerCalibration:
    """The calibration batches of one run, built on first use and then reused."""

    def __init__(self, ctx, batch_size: int, transform: str, required_by: Optional[str] = None,
                 otherwise: Optional[str] = None):
        """``required_by``: what passes over the calibration split, for the error when the run
        holds none (``otherwise``: the option that does without it)."""
        self.ctx, self.batch_size, self.transform = ctx, batch_size, transform
        self._batches = None
        if required_by is not None and len(ctx.data.calib) == 0:
            alternative = f" (or {otherwise})" if otherwise else ""
            raise ConfigError("data.calib_size", f"{required_by} on the server's calibration split; set it > 0"
                                                 f"{alternative}")

    def batches(self) -> List[torch.Tensor]:
        if self._batches is None:
            dataset, indices = self.ctx.data.calibration_set(self.transform)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.ctx.seed, CALIBRATION_STREAM))
                self._batches = [x for x, _ in eval_batches(dataset, indices, self.batch_size, self.ctx.fabric.device)]
        return self._batches

    def recalibrate(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with its BN statistics reset and re-estimated on the calibration batches."""
        recalibrate_without_waiting(model, self.batches())
        return model

    def subnet(self, spec) -> torch.nn.Module:
        """The plain subnet of ``spec`` extracted from the global model, on the device, recalibrated."""
        return self.recalibrate(self.ctx.model.extract(spec).module.to(self.ctx.fabric.device))


def recalibrate_without_waiting(model: torch.nn.Module, batches, forward=None) -> int:
    """``elastic.bn.recalibrate_bn`` (the plain average of the per-batch statistics) with the
    average's weight of batch ``k`` given as the momentum ``1 / k``: ``momentum=None`` makes
    every batch-norm layer compute that weight from its ``num_batches_tracked`` buffer, a read
    of a device value per layer and batch; ``1 / k`` is the same float, so the statistics are
    bit for bit those of ``momentum=None``. ``forward(inputs)`` runs the model (several, for a
    group of models sharing the batches); default ``model(inputs)``."""
    from fl_lightning.elastic.bn import batch_norms, recalibrate_bn

    norms = batch_norms(model)
    run = forward if forward is not None else model
    counted = [0]

    def weighted(batch):
        counted[0] += 1
        for bn in norms:
            bn.momentum = 1.0 / counted[0]
        return run(batch[0] if isinstance(batch, (tuple, list)) else batch)

    return recalibrate_bn(model, batches, forward=weighted)
