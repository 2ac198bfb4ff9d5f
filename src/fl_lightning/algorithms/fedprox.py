"""FedProx (Li et al., 2020): FedAvg with a proximal term on each client's objective."""

from __future__ import annotations

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.option_types import NonNegativeFloat


class FedProx(FedAvg):
    """FedAvg whose clients minimize ``loss + (mu / 2) ||w - w_global||^2``."""

    def __init__(self, mu: NonNegativeFloat = 0.01, **kwargs):
        """
        Args:
            mu: proximal coefficient; 0 gives FedAvg exactly.
            **kwargs: FedAvg's served-statistics options (``bn``, ...).
        """
        super().__init__(**kwargs)
        self.mu = mu

    def client_module(self, routed, task, plan):
        from fl_lightning.modules.proximal import ProximalClient

        t = self.ctx.train
        return ProximalClient(routed.module, plan.lr, t.momentum, t.weight_decay, mu=self.mu)
