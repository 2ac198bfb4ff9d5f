"""One client's local training, driven by the loop rather than a Trainer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.runtime.client_data import ClientData
from fl_lightning.runtime.gradient_clipping import clip_gradients

if TYPE_CHECKING:
    import lightning as L


@dataclass
class LocalFit:
    """What a pass of local training did."""

    num_samples: int
    steps: int
    loss: float
    """Mean of the module's returned loss over the steps."""
    seconds: float


def train_locally(fabric, module: "L.LightningModule", data: ClientData, cfg: LocalTrainConfig,
                  generator: torch.Generator) -> LocalFit:
    """Run ``cfg.epochs`` epochs (or ``cfg.steps`` steps) of ``module.training_step``.

    Fabric's public API does the precision work: ``fabric.autocast`` around the step,
    ``fabric.backward`` (also behind the module's ``manual_backward``, since the module is
    given ``fabric``), Fabric's gradient clipping (``runtime/gradient_clipping.py``) and the
    step of an optimizer set up by Fabric. ``on_before_optimizer_step`` lets a module correct
    gradients (SCAFFOLD) after clipping, where a Trainer calls it; ``optimizer_zero_grad``
    (gradients set to None unless the module overrides it), ``on_train_start`` and
    ``on_train_end`` are called where a Trainer calls them too.

    A module with ``automatic_optimization = False`` backpropagates inside ``training_step``
    (several passes per batch, each through ``self.manual_backward`` or, FEAST's client, through
    its kept slices with Fabric's loss scaling) and returns the loss to report; this loop still
    zeroes, clips and steps once per batch.
    """
    start = time.perf_counter()
    module.fabric = fabric
    raw_optimizer = module.configure_optimizers()
    optimizer = fabric.setup_optimizers(raw_optimizer)
    module.train()
    manual = not module.automatic_optimization
    batches = data.steps(cfg.steps, generator) if cfg.steps else (
        b for _ in range(cfg.epochs) for b in data.epoch(generator))
    total, steps = None, 0
    module.on_train_start()
    try:
        for steps, batch in enumerate(batches, start=1):
            module.optimizer_zero_grad(0, steps - 1, optimizer)
            with fabric.autocast():
                loss = module.training_step(batch, steps - 1)
            if not manual:
                fabric.backward(loss)
            if cfg.grad_clip is not None:
                clip_gradients(fabric, module, optimizer, cfg.grad_clip)
            module.on_before_optimizer_step(raw_optimizer)
            optimizer.step()
            total = loss.detach() if total is None else total + loss.detach()
    finally:
        module.on_train_end()
    mean_loss = float(total) / steps if steps else 0.0
    module.fabric = None
    return LocalFit(len(data), steps, mean_loss, time.perf_counter() - start)
