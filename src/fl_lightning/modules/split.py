"""One client's split training pass: the client half and the server half, each with its optimizer.

The activation crosses a real boundary: the server sees ``z.detach().requires_grad_()`` and
sends back its gradient, which the client feeds to ``z.backward``. What crosses is counted
from the tensors themselves (element size times count), in the precision the run uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.runtime.client_data import ClientData


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class SplitFit:
    """What a split training pass did, per client and round."""

    num_samples: int
    steps: int
    loss: float
    """Mean server loss over the steps (the task loss plus any server-side term)."""
    seconds: float
    client_seconds: float = 0.0
    server_seconds: float = 0.0
    cut_bytes_up: int = 0
    """Activations and labels sent to the server."""
    cut_bytes_down: int = 0
    """Gradients at the cut sent back."""
    examples: int = 0
    """Examples passed through both halves (over all epochs)."""
    extras: Dict[str, float] = field(default_factory=dict)


ClientForward = Callable[[torch.Tensor], torch.Tensor]
ServerLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def clip(params, cfg: LocalTrainConfig) -> None:
    """Clip one half's gradients to ``cfg.grad_clip`` when it is set."""
    if cfg.grad_clip is not None and params:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)


def send_activation(fabric, client_forward: ClientForward, x: torch.Tensor, y: torch.Tensor, fit: SplitFit):
    """The client half's forward and what the server receives: ``(z, z.detach().requires_grad_())``,
    the activation and the labels counted as bytes up."""
    with fabric.autocast():
        z = client_forward(x)
    sent = z.detach().requires_grad_()
    fit.cut_bytes_up += tensor_bytes(sent) + tensor_bytes(y)
    return z, sent


def apply_gradient(z: torch.Tensor, grad: torch.Tensor, fit: SplitFit, client_optimizer: torch.optim.Optimizer,
                   client_params, cfg: LocalTrainConfig, after_backward: Optional[Callable[[], None]] = None) -> None:
    """The gradient at the cut, counted as bytes down, through the client half, then its step."""
    fit.cut_bytes_down += tensor_bytes(grad)
    z.backward(grad)
    clip(client_params, cfg)
    if after_backward is not None:
        after_backward()
    client_optimizer.step()


def train_split(fabric, client_forward: ClientForward, server_loss: ServerLoss,
                client_optimizer: torch.optim.Optimizer, server_optimizer: torch.optim.Optimizer,
                data: ClientData, cfg: LocalTrainConfig, generator: torch.Generator,
                client_params: Iterable[torch.Tensor] = (), server_params: Iterable[torch.Tensor] = (),
                after_client_backward: Optional[Callable[[], None]] = None) -> SplitFit:
    """``cfg.epochs`` epochs (or ``cfg.steps`` steps) of split training on one client's shard.

    ``client_forward(x)`` is the client half (prompt included, if any); ``server_loss(zs, y)``
    runs the server half from the received activation and returns the loss it minimizes.
    Both optimizers are stepped once per batch; ``client_params`` / ``server_params`` are
    clipped to ``cfg.grad_clip`` when it is set. ``after_client_backward`` sees the client's
    gradients before its step (prompt statistics).
    """
    start = time.perf_counter()
    client_params, server_params = list(client_params), list(server_params)
    batches = data.steps(cfg.steps, generator) if cfg.steps else (
        b for _ in range(cfg.epochs) for b in data.epoch(generator))
    fit = SplitFit(len(data), 0, 0.0, 0.0)
    total = None
    for x, y in batches:
        client_optimizer.zero_grad(set_to_none=True)
        server_optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        z, sent = send_activation(fabric, client_forward, x, y, fit)
        t1 = time.perf_counter()
        with fabric.autocast():
            loss = server_loss(sent, y)
        fabric.backward(loss)
        clip(server_params, cfg)
        server_optimizer.step()
        t2 = time.perf_counter()
        apply_gradient(z, sent.grad, fit, client_optimizer, client_params, cfg, after_client_backward)
        t3 = time.perf_counter()
        fit.client_seconds += (t1 - t0) + (t3 - t2)
        fit.server_seconds += t2 - t1
        fit.steps += 1
        fit.examples += len(y)
        total = loss.detach() if total is None else total + loss.detach()
    fit.loss = float(total) / fit.steps if fit.steps else 0.0
    fit.seconds = time.perf_counter() - start
    return fit


def sgd(params, lr: float, cfg: LocalTrainConfig) -> torch.optim.SGD:
    """The local optimizer of either half: SGD with the run's momentum and weight decay."""
    return torch.optim.SGD(list(params), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
