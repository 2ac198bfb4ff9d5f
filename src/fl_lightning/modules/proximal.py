"""FedProx's local objective: the supervised loss plus (mu/2) ||w - w_global||^2."""

from __future__ import annotations

import torch

from fl_lightning.modules.supervised import SupervisedClient


class ProximalClient(SupervisedClient):
    """A client whose parameters are pulled towards the weights it received (Li et al., 2020)."""

    def __init__(self, model, lr, momentum=0.0, weight_decay=0.0, mu: float = 0.01):
        super().__init__(model, lr, momentum, weight_decay)
        self.mu = mu
        # The anchor is the routed global model as received, fixed for the whole round.
        self.anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else []

    def proximal_term(self) -> torch.Tensor:
        params = list(self.model.parameters())
        if not self.anchor:
            return params[0].new_zeros(())
        return 0.5 * self.mu * sum((p - a).pow(2).sum() for p, a in zip(params, self.anchor))

    def training_step(self, batch, batch_idx):
        loss = self.supervised_loss(batch)
        return loss + self.proximal_term() if self.mu > 0 else loss
