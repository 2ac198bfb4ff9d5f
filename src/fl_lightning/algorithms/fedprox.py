"""FedProx (Li et al., 2020): FedAvg with a proximal term on each client's objective."""

from __future__ import annotations

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.option_types import NonNegativeFloat


class ProximalLocalClient(LocalClient):
    """A FedProx client: local training of ``loss + (mu / 2) ||w - w_received||^2``."""

    def __init__(self, round: ClientRound, mu: float):
        super().__init__(round)
        self.mu = mu

    def objective(self, downlink):
        from fl_lightning.modules.proximal import ProximalClient

        r = self.round
        return ProximalClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay, mu=self.mu)


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

    def new_client(self, task, plan):
        return ProximalLocalClient(self.client_round(task, plan), self.mu)
