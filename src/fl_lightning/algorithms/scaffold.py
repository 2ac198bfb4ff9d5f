"""SCAFFOLD (Karimireddy et al., 2020) with option II control variates."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.client import LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.link import Downlink
from fl_lightning.option_types import PositiveFloat
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.server_optimizer import ServerOptimizer


class ScaffoldClient(LocalClient):
    """A SCAFFOLD client: steps corrected by ``c - c_i`` (``c`` received, ``c_i`` its own), then
    option II, ``c_i+ = c_i - c + (x - y) / (K lr)``; up go the trained model and ``delta c_i``,
    and it keeps ``c_i+``."""

    def objective(self, downlink: Downlink):
        from fl_lightning.modules.control_variates import ControlVariateClient

        model = downlink.model.module
        self.names = [name for name, _ in model.named_parameters()]
        self.received = [p.detach().clone() for p in model.parameters()]  # x, the round's global model
        c, c_i = downlink.tensors, downlink.held
        correction = [c[f"c/{n}"] - c_i[n] for n in self.names]
        return ControlVariateClient(model, self.round.lr, correction, weight_decay=self.round.train.weight_decay)

    def uplink(self, downlink, module, fit):
        from fl_lightning.modules.control_variates import option_ii_update

        if fit.steps == 0:
            return self.result(downlink, fit, model=downlink.model)
        c, c_i = downlink.tensors, downlink.held
        trained = [p.detach() for p in module.model.parameters()]
        new_c_i = option_ii_update([c_i[n] for n in self.names], [c[f"c/{n}"] for n in self.names],
                                   self.received, trained, fit.steps, self.round.lr)
        return self.result(downlink, fit, model=downlink.model,
                           tensors={f"delta_c/{n}": v - c_i[n] for n, v in zip(self.names, new_c_i)},
                           held=dict(zip(self.names, new_c_i)))


class Scaffold(FedAvg):
    """Clients correct their local drift with ``c - c_i``; the server keeps ``c`` and each ``c_i``.

    Local steps are vanilla SGD (the paper's analysis); a configuration with momentum is
    refused. The model update is the mean of the returned models (sample-weighted by default),
    moved by ``server_lr``; ``c <- c + (1/N) sum_{i in S} (c_i+ - c_i)``.
    """

    def __init__(self, server_lr: PositiveFloat = 1.0, **kwargs):
        """
        Args:
            server_lr: global step size eta_g applied to the aggregated model change.
            **kwargs: FedAvg's options (``bn``, ``weighting``: samples by default, uniform for the
                paper's ``x + eta_g / |S| sum dy_i`` and PFLlib's).
        """
        super().__init__(**kwargs)
        self.server_lr = server_lr

    def check(self, train, population=None):
        if train.momentum != 0:
            raise ConfigError("train.momentum", "SCAFFOLD uses vanilla local SGD (option II); set it to 0")

    def prepare(self, ctx):
        super().prepare(ctx)
        self.param_names = [name for name, _ in ctx.model.named_parameters()]
        params = dict(ctx.model.named_parameters())
        self.c = {name: torch.zeros_like(params[name]) for name in self.param_names}
        self.keep(KeptTensors("c/", self.c))
        # the model moves by server_lr along the averaged change: a server SGD step
        self.server_step = self.keep(ServerOptimizer("sgd", lr=self.server_lr).build(self.global_state,
                                                                                     self.param_names))
        self.store = self.keep(ClientStateStore(lambda: {name: torch.zeros_like(v) for name, v in self.c.items()}))

    def new_accumulator(self, plan):
        """Besides the model: the sum of the clients' control-variate changes (float64, like the
        model accumulators, so the sum does not depend on how clients are spread over ranks),
        and the clients' new control variates."""
        acc = super().new_accumulator(plan)
        for name, value in self.c.items():
            acc.declare(f"delta_c/{name}", torch.zeros_like(value))
        acc.register("control", self.store)
        return acc

    def downlink(self, task, plan):
        """The routed model, the server control variate ``c`` (counted), and the client's own
        ``c_i`` (held by the client)."""
        down = super().downlink(task, plan)
        down.tensors = {f"c/{name}": value for name, value in self.c.items()}
        down.held = self.store.get(task.client)
        return down

    def new_client(self, task, plan):
        return ScaffoldClient(self.client_round(task, plan))

    def commit(self, acc, task, result, plan):
        """The model into the mean; the client's ``delta c_i`` into the sum that moves ``c``, and
        its new ``c_i`` into the store (a client that took no step changes neither)."""
        super().commit(acc, task, result, plan)
        if not result.held:
            return
        for name in self.param_names:
            acc.add_sum(f"delta_c/{name}", result.tensors[f"delta_c/{name}"])
        acc.keep("control", task.client, result.held)

    def finish_round(self, acc, plan):
        self.apply(acc.result())
        with torch.no_grad():
            for name in self.param_names:
                update = acc[f"delta_c/{name}"] / self.ctx.num_clients
                self.c[name].add_(update.to(self.c[name].dtype))
        return {}
