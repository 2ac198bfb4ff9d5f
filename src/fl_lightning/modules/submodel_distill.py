"""FjORD's self-distillation: the client's full local width learns from the labels, a smaller
nested width inside the same local model learns from the labels and from the full width's
detached predictions (Horvath et al., 2021, Sec. 3.3)."""

from __future__ import annotations

import torch.nn.functional as F

from fl_lightning.modules.inplace_distillation import kd_loss, soft_targets
from fl_lightning.modules.supervised import SupervisedClient


class OrderedDropoutDistillClient(SupervisedClient):
    """``CE(full) + CE(low) + weight * KD(low || sg(full))`` with one backward per batch.

    ``model`` is an elastic local model (``extract(spec, elastic=True)``), ``high`` its largest
    spec and ``low`` a nested smaller one; the model is left at ``high`` after each step.
    """

    def __init__(self, model, lr, momentum, weight_decay, high, low, weight: float = 1.0):
        super().__init__(model, lr, momentum, weight_decay)
        self.high, self.low, self.weight = high, low, weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.model.set_active(self.high)
        full = self.model(x)
        loss = F.cross_entropy(full, y)
        if self.low != self.high:
            self.model.set_active(self.low)
            small = self.model(x)
            loss = loss + F.cross_entropy(small, y) + self.weight * kd_loss(small, soft_targets(full))
            self.model.set_active(self.high)
        return loss
