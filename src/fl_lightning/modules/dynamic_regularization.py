"""FedDyn's local objective (Acar et al., 2021, Algorithm 1):
``L_k(theta) - <grad_k, theta> + (alpha / 2) ||theta - theta_received||^2``, with ``grad_k`` the
client's estimate of its own loss gradient at its previous local optimum."""

from __future__ import annotations

from typing import Sequence

import torch

from fl_lightning.modules.supervised import SupervisedClient


class DynamicRegularizedClient(SupervisedClient):
    """A client pulled towards the model it received and tilted by its gradient estimate.

    ``anchor``: the received parameters (fixed for the round); ``grad``: ``grad_k``, one tensor
    per parameter in ``model.parameters()`` order. ``penalty``: squared (the paper's
    ``(alpha / 2) ||theta - anchor||^2``) or norm (``(alpha / 2) ||theta - anchor||``, the norm
    of the whole parameter vector without the square, as PFLlib's ``clientDyn`` writes it).
    """

    def __init__(self, model, lr, momentum, weight_decay, alpha: float, anchor: Sequence[torch.Tensor],
                 grad: Sequence[torch.Tensor], penalty: str = "squared"):
        super().__init__(model, lr, momentum, weight_decay)
        self.alpha, self.anchor, self.grad, self.penalty = alpha, list(anchor), list(grad), penalty

    def regularizer(self) -> torch.Tensor:
        params = list(self.model.parameters())
        linear = sum((g * p).sum() for g, p in zip(self.grad, params))
        if self.penalty == "squared":
            pull = sum((p - a).pow(2).sum() for p, a in zip(params, self.anchor))
        else:  # the norm of the whole vector, as a norm of per-tensor norms: its gradient at 0 is 0, not NaN
            pull = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p - a)
                                                         for p, a in zip(params, self.anchor)]))
        return 0.5 * self.alpha * pull - linear

    def training_step(self, batch, batch_idx):
        return self.supervised_loss(batch) + self.regularizer()
