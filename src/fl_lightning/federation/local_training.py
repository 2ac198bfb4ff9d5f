"""One client's local training, driven by the loop rather than a Trainer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import lightning as L
import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.federation.client_data import ClientData


@dataclass
class ClientResult:
    client: int
    num_samples: int
    steps: int
    loss: float
    seconds: float


def train_client(fabric, module: L.LightningModule, data: ClientData, cfg: LocalTrainConfig,
                 generator: torch.Generator, client: int = -1) -> ClientResult:
    """Run ``cfg.epochs`` epochs (or ``cfg.steps`` steps) of ``module.training_step``.

    The module's ``configure_optimizers`` builds the optimizer; precision handling (autocast,
    loss scaling) comes from Fabric's precision plugin; ``on_before_optimizer_step`` lets a
    module correct gradients (SCAFFOLD) after clipping, as a Trainer would call it.

    A module with ``automatic_optimization = False`` backpropagates inside ``training_step``
    (several passes per batch, each through ``self.manual_backward``) and returns the loss
    to report; the loop still zeroes, clips and steps once per batch.
    """
    start = time.perf_counter()
    precision = fabric.strategy.precision
    optimizer = module.configure_optimizers()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    module.train()
    manual = not module.automatic_optimization
    if manual:
        module._fabric = fabric  # routes manual_backward through Fabric's precision plugin
    batches = data.steps(cfg.steps, generator) if cfg.steps else (
        b for _ in range(cfg.epochs) for b in data.epoch(generator))
    total = torch.zeros((), device=params[0].device)
    steps = 0
    for steps, batch in enumerate(batches, start=1):
        optimizer.zero_grad(set_to_none=True)
        with precision.forward_context():
            loss = module.training_step(batch, steps - 1)
        if not manual:
            precision.backward(loss, module)
        if cfg.grad_clip is not None:
            precision.unscale_gradients(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        module.on_before_optimizer_step(optimizer)
        precision.optimizer_step(optimizer)
        total += loss.detach()
    mean_loss = (total / max(steps, 1)).item()
    return ClientResult(client, len(data), steps, mean_loss, time.perf_counter() - start)
