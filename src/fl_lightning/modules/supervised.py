"""The plain client: cross-entropy on its shard with SGD."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class SupervisedClient(L.LightningModule):
    """Wraps a client's physical model; the federation loop drives ``training_step``.

    ``training_step`` returns the loss to backpropagate; ``configure_optimizers`` builds
    plain SGD. Subclasses add loss terms (FedProx) or gradient corrections (SCAFFOLD) through
    the same hooks a Trainer would call.
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__()
        self.model = model
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def supervised_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.supervised_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)
