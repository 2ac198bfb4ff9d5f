"""FedDyn (Acar et al., ICLR 2021): federated learning with dynamic regularization."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional

import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg, Weighting
from fl_lightning.option_types import PositiveFloat
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.link import Downlink

Penalty = Literal["squared", "norm"]


class FedDynClient(LocalClient):
    """A FedDyn client: local training of ``L_k(theta) - <grad_k, theta> + (alpha / 2)
    ||theta - theta_received||^2`` with its own ``grad_k`` (held, zero before its first round),
    then ``grad_k <- grad_k - alpha (theta_k - theta_received)``, which it keeps; the trained model
    goes up."""

    def __init__(self, round: ClientRound, alpha: float, penalty: Penalty):
        super().__init__(round)
        self.alpha, self.penalty = alpha, penalty

    def objective(self, downlink: Downlink):
        from fl_lightning.modules.dynamic_regularization import DynamicRegularizedClient

        model, train = downlink.model.module, self.round.train
        self.names = [name for name, _ in model.named_parameters()]
        self.received = [p.detach().clone() for p in model.parameters()]
        grad = [downlink.held[name] for name in self.names]
        return DynamicRegularizedClient(model, self.round.lr, train.momentum, train.weight_decay, self.alpha,
                                        self.received, grad, self.penalty)

    def uplink(self, downlink, module, fit):
        trained = [p.detach() for p in module.model.parameters()]
        grad = {name: downlink.held[name] - self.alpha * (t - r)
                for name, t, r in zip(self.names, trained, self.received)}
        return self.result(downlink, fit, model=downlink.model, held=grad)


class FedDyn(FedAvg):
    """Dynamic regularization (Acar et al., 2021).

    Each client minimizes its loss tilted by its gradient estimate ``grad_k`` and pulled towards
    the received model (:class:`FedDynClient`). The server keeps ``h``, one tensor per parameter:
    ``h <- h - (alpha / m) sum_{k in P_t} (theta_k - theta)`` over the round's clients (``m``
    clients in all), and moves to ``theta <- mean_{k in P_t} theta_k - h / alpha`` (buffers, such
    as batch-norm statistics, take the mean). The mean is the paper's plain one over the round's
    clients (``weighting: uniform``, the default here; ``samples`` weighs by examples).
    Details and the reference check: docs/fl_baselines.md.
    """

    def __init__(self, alpha: PositiveFloat = 0.01, penalty: Penalty = "squared",
                 weighting: Optional[Weighting] = None, **kwargs):
        """
        Args:
            alpha: the regularization weight alpha (the paper's values: 0.1, 0.01, 0.001).
            penalty: squared (the paper's ``(alpha / 2) ||theta - theta_received||^2``) or norm
                (the same without the square, as PFLlib's ``clientDyn``).
            weighting: the mean over the round's clients: uniform (the paper's; the default when
                None) or samples.
            **kwargs: FedAvg's served-statistics options (``bn``, ...).
        """
        super().__init__(weighting=weighting if weighting is not None else "uniform", **kwargs)
        self.alpha, self.penalty = alpha, penalty

    def prepare(self, ctx) -> None:
        super().prepare(ctx)
        self.param_names: List[str] = [name for name, _ in ctx.model.named_parameters()]
        params = dict(ctx.model.named_parameters())
        self.h = {name: torch.zeros_like(params[name]) for name in self.param_names}
        self.keep(KeptTensors("h/", self.h))
        self.store = self.keep(ClientStateStore(lambda: {name: torch.zeros_like(v) for name, v in self.h.items()}))

    def downlink(self, task, plan) -> Downlink:
        """The routed model, and the client's own gradient estimate (held by the client)."""
        down = super().downlink(task, plan)
        down.held = self.store.get(task.client)
        return down

    def new_client(self, task, plan) -> FedDynClient:
        return FedDynClient(self.client_round(task, plan), self.alpha, self.penalty)

    def new_accumulator(self, plan):
        """Besides the model: the sum of the clients' model changes (float64), and their new
        gradient estimates."""
        acc = super().new_accumulator(plan)
        for name, value in self.h.items():
            acc.declare(f"change/{name}", torch.zeros_like(value))
        acc.register("grads", self.store)
        return acc

    def commit(self, acc, task, result, plan) -> None:
        super().commit(acc, task, result, plan)
        local = dict(result.model.module.named_parameters())
        for name in self.param_names:
            acc.add_sum(f"change/{name}", local[name].detach() - self.global_state[name])
        acc.keep("grads", task.client, result.held)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        new_state = acc.result()
        m = self.ctx.num_clients
        with torch.no_grad():
            for name, h in self.h.items():
                h.sub_((self.alpha / m) * acc[f"change/{name}"].to(h.dtype))
                new_state[name] = new_state[name].to(h.dtype) - h / self.alpha
        self.apply(new_state)
        return {}


__all__ = ["FedDyn", "FedDynClient"]
