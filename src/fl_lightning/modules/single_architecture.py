"""A client that trains one extracted subnet on (optionally mixed) mini-batches.

The client side of SuperFedNAS and DeepFedNAS (``algorithms/supernet/fednas.py``): every mini-batch goes
through the mixer (Mixup / CutMix, FEAST's canonical augmentation for every method) and one
forward-backward pass of the client's single architecture with soft-target cross-entropy.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fl_lightning.modules.mixing import NoMix, soft_cross_entropy
from fl_lightning.modules.supervised import SupervisedClient


class SingleArchitectureClient(SupervisedClient):
    """Plain SGD on one physical subnet.

    Args:
        model: the extracted subnet (``OFAResNet.extract(spec).module``).
        lr, momentum, weight_decay: SGD settings.
        macs: the subnet's per-example forward MACs (the budgets' convention), for
            :meth:`forward_macs`.
        mixer: ``(x, y, batch_idx) -> (x_mixed, targets)``; default no mixing.
        frozen_bn: hold every batch norm at the identity (weight 1, bias 0, statistics 0 and
            1, evaluation mode, not trained): SuperFedNAS's and DeepFedNAS's ``SubnetTrainer``
            without ``--use_bn``.
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, *,
                 macs: int = 0, mixer: Optional[Callable] = None, frozen_bn: bool = False):
        super().__init__(model, lr, momentum, weight_decay)
        self.macs = int(macs)
        self.mixer = mixer if mixer is not None else NoMix()
        self._forward_macs = 0
        self.frozen = [m for m in model.modules() if isinstance(m, _BatchNorm)] if frozen_bn else []
        with torch.no_grad():
            for norm in self.frozen:
                norm.weight.fill_(1.0), norm.bias.fill_(0.0)
                norm.running_mean.fill_(0.0), norm.running_var.fill_(1.0)
                norm.weight.requires_grad_(False), norm.bias.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        for norm in self.frozen:  # frozen batch norms stay in evaluation mode while training
            norm.eval()
        return self

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x, targets = self.mixer(x, y, batch_idx)
        self._forward_macs += int(x.shape[0]) * self.macs
        return soft_cross_entropy(self.model(x), targets)

    def forward_macs(self) -> int:
        """Sum over this module's mini-batches of batch size x the subnet's MACs (FEAST's
        ``C_fwd`` for one variant per batch)."""
        return self._forward_macs
