"""A client that trains a dense model through threshold masks (FIARSE's local update).

Every forward replaces each maskable parameter ``w`` by ``w * 1{|w| >= tau}`` with the
round's thresholds (``fl_lightning.elastic.magnitude_masks.threshold_mask``), through
``torch.func.functional_call``: the module keeps its dense tensors, the optimizer steps them,
and the mask's backward decides which gradient reaches them. Batch norms and every other
parameter train as usual.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn
from torch.func import functional_call

from fl_lightning.elastic.magnitude_masks import Gradient, shrink_bound, threshold_mask
from fl_lightning.modules.mixing import NoMix, soft_cross_entropy
from fl_lightning.modules.supervised import SupervisedClient


class ThresholdMaskedClient(SupervisedClient):
    """Cross-entropy on the masked model, SGD on the dense one.

    Args:
        model: the client's dense model (the server's weights, all of them).
        lr, momentum, weight_decay: plain SGD on every parameter.
        thresholds: parameter name of ``model`` -> the round's threshold (0-dim tensor);
            names not listed are used unmasked.
        gradient: ``masked`` or ``surrogate`` (``elastic/magnitude_masks.py``).
        mixer: ``(x, y, batch_idx) -> (x, targets)`` (Mixup / CutMix); None trains on the batch.
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float, weight_decay: float,
                 thresholds: Mapping[str, torch.Tensor], gradient: Gradient = "masked",
                 mixer: Optional[Callable] = None):
        super().__init__(model, lr, momentum, weight_decay)
        params = dict(model.named_parameters())
        missing = [k for k in thresholds if k not in params]
        if missing:
            raise ValueError(f"thresholds name no parameter of the model: {missing[:3]}")
        self.thresholds = {k: t.detach().to(params[k].device, params[k].dtype) for k, t in thresholds.items()}
        # the thresholds are fixed for the client's round: read them to the host once, not every step
        self.bounds = {k: shrink_bound(t, params[k].dtype) for k, t in self.thresholds.items()}
        self.gradient = gradient
        self.mixer = mixer if mixer is not None else NoMix()

    def masked_parameters(self) -> dict:
        params = dict(self.model.named_parameters())
        return {k: threshold_mask(params[k], tau, self.gradient, self.bounds[k]) for k, tau in self.thresholds.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, self.masked_parameters(), (x,), strict=False)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x, targets = self.mixer(x, y, batch_idx)
        return soft_cross_entropy(self(x), targets)

    def supervised_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return soft_cross_entropy(self(x), y)
