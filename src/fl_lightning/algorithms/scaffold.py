"""SCAFFOLD (Karimireddy et al., 2020) with option II control variates."""

from __future__ import annotations

import torch

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveFloat
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.server_optimizer import ServerOptimizer


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

    def check(self, train):
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

    def client_module(self, routed, task, plan):
        from fl_lightning.modules.control_variates import ControlVariateClient

        c_i = self.store.get(task.client)
        correction = [self.c[name] - c_i[name] for name in self.param_names]
        return ControlVariateClient(routed.module, plan.lr, correction, weight_decay=self.ctx.train.weight_decay)

    def commit(self, acc, task, result, plan):
        from fl_lightning.modules.control_variates import option_ii_update

        super().commit(acc, task, result, plan)
        if result.steps == 0:
            return
        c_i = self.store.get(task.client)
        local = dict(result.module.model.named_parameters())
        names = self.param_names
        new_c_i = option_ii_update([c_i[n] for n in names], [self.c[n] for n in names],
                                   [self.global_state[n] for n in names],
                                   [local[n].detach() for n in names], result.steps, plan.lr)
        for name, value in zip(names, new_c_i):
            acc.add_sum(f"delta_c/{name}", value - c_i[name])
        acc.keep("control", task.client, dict(zip(names, new_c_i)))

    def finish_round(self, acc, plan):
        self.apply(acc.result())
        with torch.no_grad():
            for name in self.param_names:
                update = acc[f"delta_c/{name}"] / self.ctx.num_clients
                self.c[name].add_(update.to(self.c[name].dtype))
        return {}
