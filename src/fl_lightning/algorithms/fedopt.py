"""FedOpt (Reddi et al., 2021): FedAvg whose server applies the averaged update through an
optimiser: FedAvgM (sgd with momentum), FedAdagrad, FedAdam, FedYogi."""

from __future__ import annotations

from fl_lightning.algorithms.fedavg import FedAvg
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

    def check(self, train, population=None):
        self.server.check("algorithm.server")

    def prepare(self, ctx):
        """The server step is a part of the base: ``apply`` moves the global model through it
        and the checkpoint keeps its moments."""
        super().prepare(ctx)
        self.server_step = self.keep(self.server.build(self.global_state,
                                                       [name for name, _ in ctx.model.named_parameters()]))
