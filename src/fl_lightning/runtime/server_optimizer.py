"""The server optimiser: a round's aggregate applied to the global model as one step of an
optimiser on the pseudo-gradient ``x - avg`` (Reddi et al., 2021, "Adaptive Federated
Optimization", Algorithm 2), so that FedAvgM, SCAFFOLD's server rate, FedAdagrad, FedAdam and
FedYogi are a choice of optimiser rather than methods of their own.

Parameters take the step; buffers (batch-norm statistics, counters) take the average. SGD
with rate 1 and no momentum copies the average (FedAvg to the bit). ``sgd``, ``adagrad`` and
``adam`` are ``torch.optim``'s (Adam with its bias correction, ``eps`` added to the corrected
root); ``yogi`` follows Reddi et al.'s Algorithm 2 (no bias correction), which torch lacks.
Every rank holds the same global model and takes the same step, so results stay
rank-independent; the optimiser's moments are server state and go into the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Literal, Tuple

import torch

from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveFloat, number_type

Decay = number_type(float, ge=0, lt=1)  # a momentum or moment decay

OptimizerName = Literal["sgd", "adagrad", "adam", "yogi"]
PREFIX = "server_opt/"  # where the optimiser's state sits in an algorithm's checkpointed state


class Yogi(torch.optim.Optimizer):
    """Yogi (Zaheer et al., 2018) as FedYogi's server step: ``m <- b1 m + (1 - b1) g``,
    ``v <- v - (1 - b2) g^2 sign(v - g^2)``, ``x <- x - lr m / (sqrt(v) + eps)``, with
    ``v`` starting at ``initial_accumulator`` (Reddi et al.: at least ``tau^2``)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, betas: Tuple[float, float], eps: float,
                 initial_accumulator: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "initial_accumulator": initial_accumulator})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.full_like(p, group["initial_accumulator"])
                g2 = p.grad * p.grad
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                v = state["exp_avg_sq"]
                v.sub_(torch.sign(v - g2) * g2, alpha=1 - b2)
                p.addcdiv_(state["exp_avg"], v.sqrt().add_(group["eps"]), value=-group["lr"])


@dataclass
class ServerOptimizer:
    """How the server applies the averaged update (Reddi et al., 2021, Algorithm 2)."""

    name: OptimizerName = "sgd"
    """sgd (FedAvg, FedAvgM with momentum), adagrad, adam or yogi."""
    lr: PositiveFloat = 1.0
    """Server learning rate eta (1 with sgd and no momentum: the plain average)."""
    momentum: Decay = 0.0
    """sgd's server momentum (FedAvgM's beta)."""
    betas: Tuple[Decay, Decay] = (0.9, 0.99)
    """adam's and yogi's moment decays (Reddi et al.: 0.9, 0.99)."""
    eps: PositiveFloat = 1e-3
    """The adaptivity tau added to the root (Reddi et al.: 1e-3)."""

    def check(self, key: str) -> None:
        """Refuse settings the optimiser does not define (``key``: where the config holds it; each
        setting's range is its type's)."""
        if self.momentum and self.name != "sgd":
            raise ConfigError(f"{key}.momentum", f"applies to sgd only (name: {self.name})")

    @property
    def averages(self) -> bool:
        """True when the step is the plain average (the global model takes it as it is)."""
        return self.name == "sgd" and self.lr == 1.0 and self.momentum == 0.0

    def build(self, global_state: Dict[str, torch.Tensor], parameters: Iterable[str]) -> "ServerStep":
        return ServerStep(self, global_state, list(parameters))


class ServerStep:
    """The optimiser bound to the global model's parameter tensors."""

    def __init__(self, config: ServerOptimizer, global_state: Dict[str, torch.Tensor], parameters: list):
        self.config, self.global_state, self.parameters = config, global_state, parameters
        # the plain average needs no step: the parameters take it as the buffers do
        self.stepped = frozenset() if config.averages else frozenset(parameters)
        tensors = [global_state[name] for name in parameters]
        c = config
        if c.name == "sgd":
            self.optimizer = torch.optim.SGD(tensors, lr=c.lr, momentum=c.momentum)
        elif c.name == "adagrad":  # Reddi et al. start the accumulator at tau^2
            self.optimizer = torch.optim.Adagrad(tensors, lr=c.lr, eps=c.eps, initial_accumulator_value=c.eps ** 2)
        elif c.name == "adam":
            self.optimizer = torch.optim.Adam(tensors, lr=c.lr, betas=c.betas, eps=c.eps)
        else:
            self.optimizer = Yogi(tensors, lr=c.lr, betas=c.betas, eps=c.eps, initial_accumulator=c.eps ** 2)

    @torch.no_grad()
    def apply(self, new_state: Dict[str, torch.Tensor]) -> None:
        """Move the global model to the round's aggregate ``new_state`` (key -> average)."""
        for key, average in new_state.items():
            x = self.global_state[key]
            if key in self.stepped:
                x.grad = x - average.to(x.dtype)
            else:
                x.copy_(average)
        if self.stepped:
            self.optimizer.step()
            for name in self.parameters:
                self.global_state[name].grad = None

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The optimiser's per-parameter state as named tensors (for the checkpoint)."""
        state = self.optimizer.state_dict()["state"]
        return {f"{PREFIX}{self.parameters[i]}/{k}": v for i, entry in state.items() for k, v in entry.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        index = {name: i for i, name in enumerate(self.parameters)}
        per_param: Dict[int, Dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            if key.startswith(PREFIX):
                name, _, field = key[len(PREFIX):].rpartition("/")
                per_param.setdefault(index[name], {})[field] = value.clone()
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})
