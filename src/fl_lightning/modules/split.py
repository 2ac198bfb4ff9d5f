"""The split-learning engine every split method trains with (docs/fedsga.md, "The cut").

- :class:`SplitPair`: one client round's client half and server half, each with its optimizer
  set up through Fabric and the server's objective (:func:`make_pair`).
- :func:`train_split`: the one training loop. For every batch of the client's shard (local
  epochs or steps) it calls a *step*; the standard step (:func:`split_step`) is: the client
  forward, the activation across a real ``detach()`` boundary, a *server rule* that updates
  the server half and answers with the gradient at the cut, and the client's backward and step.
- Server rules: :func:`one_step` (SplitFed V1 and V2, FedSGA); ``modules/split_variants.py``
  has MU-SplitFed's unbalanced and zeroth-order updates, MultiSFL's replay and MergeSFL's merged
  cohort step, all on these pieces.

What crosses the cut is counted from the tensors themselves (element size times count), in the
precision the run uses, by the client's :class:`~fl_lightning.runtime.channel.Channel`. Both halves clip through
``fabric.clip_gradients``, as local training does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional

import torch
from torch import nn

from fl_lightning.config import LocalTrainConfig
from fl_lightning.runtime.channel import DOWN, UP, Channel
from fl_lightning.runtime.client_data import ClientData


@dataclass
class SplitFit:
    """What a split training pass did, per client and round."""

    num_samples: int
    steps: int = 0
    loss: float = 0.0
    """Mean server loss over the steps (the task loss plus any server-side term)."""
    seconds: float = 0.0
    client_seconds: float = 0.0
    server_seconds: float = 0.0
    examples: int = 0
    """Examples passed through both halves (over all epochs)."""
    channel: Channel = field(default_factory=Channel)
    """What crossed between the client and the server (at the cut: kind ``cut``)."""
    extras: Dict[str, float] = field(default_factory=dict)

    @property
    def cut_bytes_up(self) -> int:
        return self.channel.total(UP, "cut")

    @property
    def cut_bytes_down(self) -> int:
        return self.channel.total(DOWN, "cut")


ClientForward = Callable[[torch.Tensor], torch.Tensor]
ServerLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SplitPair:
    """The two halves of one client round and what drives them."""

    client_forward: ClientForward
    """The client half on a batch (prompt included, if any)."""
    server_loss: ServerLoss
    """``(received activation, labels) -> loss`` the server half minimizes."""
    client_module: nn.Module
    server_module: nn.Module
    client_optimizer: torch.optim.Optimizer
    server_optimizer: torch.optim.Optimizer
    after_client_backward: Optional[Callable[[], None]] = None
    """Sees the client's gradients before its step (prompt statistics)."""
    client_backward: Optional[Callable] = None
    """``(fabric, z, grad)``: the client's backward from the gradient at the cut (default
    ``fabric.backward(z, grad)``); FedSGA keeps the alignment part of it from the prompt."""

    def clip_client(self, fabric, cfg: LocalTrainConfig) -> None:
        _clip(fabric, self.client_module, self.client_optimizer, cfg)

    def clip_server(self, fabric, cfg: LocalTrainConfig) -> None:
        _clip(fabric, self.server_module, self.server_optimizer, cfg)


def _clip(fabric, module: nn.Module, optimizer: torch.optim.Optimizer, cfg: LocalTrainConfig) -> None:
    """Clip to ``cfg.grad_clip``."""
    if cfg.grad_clip is None or not any(group["params"] for group in optimizer.param_groups):
        return
    fabric.clip_gradients(module, optimizer, max_norm=cfg.grad_clip, error_if_nonfinite=False)


def sgd(params, lr: float, cfg: LocalTrainConfig) -> torch.optim.SGD:
    """The local optimizer of either half: SGD with the run's momentum and weight decay."""
    return torch.optim.SGD(list(params), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def make_pair(fabric, cfg: LocalTrainConfig, *, client_forward: ClientForward, server_loss: ServerLoss,
              client_module: nn.Module, server_module: nn.Module, client_params: Iterable[torch.Tensor],
              server_params: Iterable[torch.Tensor], lr: float, server_lr: float,
              server_momentum: Optional[Dict[int, torch.Tensor]] = None,
              after_client_backward: Optional[Callable[[], None]] = None,
              server_optimizer: Optional[torch.optim.Optimizer] = None,
              client_backward: Optional[Callable] = None, fresh_server_state: bool = False) -> SplitPair:
    """Build both optimizers through Fabric (SGD with the run's momentum and weight decay).

    ``server_momentum`` maps ``id(param)`` to a momentum buffer to start from: a server half
    that persists across clients and rounds (SplitFed V2, FedSGA's shared server) carries it.
    ``server_optimizer``: an optimizer already built for the server half (a cohort that shares
    one server step, MergeSFL); then ``server_params`` is not used.
    ``fresh_server_state``: the server optimizer's state is dropped before every step, which is
    what making it afresh for every batch does.
    """
    client_optimizer = fabric.setup_optimizers(sgd(client_params, lr, cfg))
    if server_optimizer is None:
        server_optimizer = sgd(server_params, server_lr, cfg)
        if fresh_server_state:
            server_optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: optimizer.state.clear())
        for group in server_optimizer.param_groups:
            for p in group["params"]:
                buffer = (server_momentum or {}).get(id(p))
                if buffer is not None:
                    server_optimizer.state[p]["momentum_buffer"] = buffer.clone()
        server_optimizer = fabric.setup_optimizers(server_optimizer)
    return SplitPair(client_forward, server_loss, client_module, server_module, client_optimizer,
                     server_optimizer, after_client_backward, client_backward)


def momentum_buffers(optimizer: torch.optim.Optimizer) -> Dict[int, torch.Tensor]:
    """``id(param) -> momentum buffer`` of every parameter that has one."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            buffer = optimizer.state.get(p, {}).get("momentum_buffer")
            if buffer is not None:
                out[id(p)] = buffer.detach().clone()
    return out


# -- the pieces of a step -------------------------------------------------------------------------
def send_activation(fabric, pair: SplitPair, x: torch.Tensor, y: torch.Tensor, fit: SplitFit):
    """The client half's forward and what the server receives: ``(z, z.detach().requires_grad_())``,
    the activation and the labels counted as bytes up."""
    with fabric.autocast():
        z = pair.client_forward(x)
    sent = z.detach().requires_grad_()
    fit.channel.up("cut", sent, y)
    return z, sent


def apply_feedback(fabric, pair: SplitPair, z: torch.Tensor, grad: torch.Tensor, fit: SplitFit,
                   cfg: LocalTrainConfig) -> None:
    """The gradient at the cut, counted as bytes down, through the client half, then its step."""
    fit.channel.down("cut", grad)
    if pair.client_backward is not None:
        pair.client_backward(fabric, z, grad)
    else:
        fabric.backward(z, grad)
    pair.clip_client(fabric, cfg)
    if pair.after_client_backward is not None:
        pair.after_client_backward()
    pair.client_optimizer.step()


ServerRule = Callable[..., tuple]
"""``rule(fabric, pair, sent, y, cfg, index, fit) -> (loss, gradient at the cut)``: how the
server half learns from one received batch (``index``: the batch's position in the client
round; ``fit``: the client round's figures and channel, for what else the rule sends)."""


def one_step(fabric, pair: SplitPair, sent: torch.Tensor, y: torch.Tensor, cfg: LocalTrainConfig,
             index: int, fit: SplitFit) -> tuple:
    """One server step on the received batch; the feedback is the gradient at the cut."""
    with fabric.autocast():
        loss = pair.server_loss(sent, y)
    fabric.backward(loss)
    pair.clip_server(fabric, cfg)
    pair.server_optimizer.step()
    return loss.detach(), sent.grad


def split_step(pair: SplitPair, rule: ServerRule = one_step) -> Callable:
    """The standard step: client forward, the server ``rule``, client backward and step."""

    def step(fabric, index: int, x: torch.Tensor, y: torch.Tensor, fit: SplitFit, cfg: LocalTrainConfig):
        pair.client_optimizer.zero_grad(set_to_none=True)
        pair.server_optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        z, sent = send_activation(fabric, pair, x, y, fit)
        t1 = time.perf_counter()
        loss, grad = rule(fabric, pair, sent, y, cfg, index, fit)
        t2 = time.perf_counter()
        apply_feedback(fabric, pair, z, grad, fit, cfg)
        fit.client_seconds += (t1 - t0) + (time.perf_counter() - t2)
        fit.server_seconds += t2 - t1
        return loss
    return step


def train_split(fabric, step: Callable, data: ClientData, cfg: LocalTrainConfig, generator: torch.Generator,
                fit: Optional[SplitFit] = None) -> SplitFit:
    """``cfg.epochs`` epochs (or ``cfg.steps`` steps) of ``step`` over one client's shard.

    ``step(fabric, index, x, y, fit, cfg) -> loss`` trains both halves on one batch and adds
    its traffic and time to ``fit``; this loop counts steps and examples and averages the loss.
    """
    start = time.perf_counter()
    fit = fit if fit is not None else SplitFit(len(data))
    batches = data.steps(cfg.steps, generator) if cfg.steps else (
        b for _ in range(cfg.epochs) for b in data.epoch(generator))
    total = None
    for index, (x, y) in enumerate(batches):
        loss = step(fabric, index, x, y, fit, cfg)
        fit.steps += 1
        fit.examples += len(y)
        total = loss if total is None else total + loss
    fit.loss = float(total) / fit.steps if fit.steps else 0.0
    fit.seconds = time.perf_counter() - start
    return fit
