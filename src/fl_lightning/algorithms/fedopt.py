"""FedOpt (Reddi et al., 2021): FedAvg whose server applies the averaged update through an
optimiser: FedAvgM (sgd with momentum), FedAdagrad, FedAdam, FedYogi."""

from __future__ import annotations

from fl_lightning.algorithms.base import FedAvg
from fl_lightning.runtime.server_optimizer import ServerOptimizer


class FedOpt(FedAvg):
    """Clients train as in FedAvg; the server steps its optimiser on ``x - avg``.

    ``server: {name: adam, lr: 0.01}`` is FedAdam, ``{name: sgd, momentum: 0.9}`` FedAvgM;
    the default (sgd, rate 1, no momentum) is FedAvg to the bit.
    """

    def __init__(self, server: ServerOptimizer = ServerOptimizer(), **kwargs):
        """
        Args:
            server: the server optimiser and its settings (Reddi et al., 2021, Algorithm 2).
            **kwargs: FedAvg's served-statistics options (``bn``, ...).
        """
        super().__init__(**kwargs)
        self.server = server

    def check(self, train):
        self.server.check("algorithm.server")

    def prepare(self, ctx):
        super().prepare(ctx)
        self.server_step = self.server.build(self.global_state, [name for name, _ in ctx.model.named_parameters()])

    def finish_round(self, acc, plan):
        self.server_step.apply(acc.result())
        return {}

    def state_dict(self):
        return self.server_step.state_dict()

    def load_state_dict(self, state):
        self.server_step.load_state_dict(state)
