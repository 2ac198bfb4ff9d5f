"""Split training passes of the split-FL baselines (docs/sfl_baselines.md).

Each is a variant of :func:`fl_lightning.modules.split.train_split`: the activation crosses a
real ``detach()`` boundary, the server half and the client half each step their own optimizer,
and the bytes that cross are counted from the tensors themselves.

- :func:`merged_step` (MergeSFL): one lock-stepped iteration of a whole cohort. The server
  half takes one step on the concatenation of every client's activations and each client gets
  back its slice of the gradient.
- :func:`train_unbalanced` (MU-SplitFed): per client batch the server half takes ``tau`` steps
  on the same activations while the client half takes one; first-order or zeroth-order.
- :func:`train_split_replay` (MultiSFL): the server half trains on the client's activations
  together with replayed activations of assistant devices, computed by a frozen snapshot of the
  client half.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Sequence

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.modules.split import (ClientForward, ServerLoss, SplitFit, apply_gradient, clip,
                                        send_activation, tensor_bytes)
from fl_lightning.runtime.client_data import ClientData

FeedbackAt = Literal["start", "last_step", "end"]
Estimator = Literal["fo", "zo"]
SCALAR_BYTES = 4  # one float32 loss difference sent down per zeroth-order client step


# -- MergeSFL ---------------------------------------------------------------------------------
@dataclass
class MergedStep:
    """What one lock-stepped iteration did, per client (in cohort order)."""

    loss: float
    """The server loss on the merged batch."""
    sizes: List[int]
    """Each client's rows in the merged batch."""
    bytes_up: List[int]
    """Each client's activations and labels."""
    bytes_down: List[int]
    """Each client's gradient slice."""
    client_seconds: List[float]
    server_seconds: float


def merged_step(fabric, forwards: Sequence[ClientForward], server_loss: ServerLoss,
                client_optimizers: Sequence[torch.optim.Optimizer], server_optimizer: torch.optim.Optimizer,
                batches: Sequence[tuple], cfg: LocalTrainConfig,
                client_params: Sequence[Sequence[torch.Tensor]] = (), server_params: Sequence[torch.Tensor] = (),
                rescale: bool = True) -> MergedStep:
    """One MergeSFL iteration: every client's forward on its batch, one server step on the
    concatenation (in cohort order), each client's backward on its slice of the gradient.

    The server loss is the mean over the merged batch of ``B = sum_i b_i`` rows, so the slice of
    client i is ``(1/B) d l_j / d z_j`` for its rows; ``rescale`` multiplies it by ``B / b_i``,
    which makes it the gradient of the mean loss over the client's own rows (MergeSFL's gradient
    dispatch). ``client_params[i]`` are clipped to ``cfg.grad_clip`` before client i steps.
    """
    client_params = [list(p) for p in client_params] or [[] for _ in forwards]
    server_params = list(server_params)
    for optimizer in client_optimizers:
        optimizer.zero_grad(set_to_none=True)
    server_optimizer.zero_grad(set_to_none=True)
    zs, ys, seconds = [], [], []
    for forward, (x, y) in zip(forwards, batches):
        t0 = time.perf_counter()
        with fabric.autocast():
            zs.append(forward(x))
        ys.append(y)
        seconds.append(time.perf_counter() - t0)
    sizes = [len(y) for y in ys]
    t0 = time.perf_counter()
    merged = torch.cat([z.detach() for z in zs]).requires_grad_()
    labels = torch.cat(ys)
    with fabric.autocast():
        loss = server_loss(merged, labels)
    fabric.backward(loss)
    clip(server_params, cfg)
    server_optimizer.step()
    server_seconds = time.perf_counter() - t0
    total = sum(sizes)
    bytes_up, bytes_down = [], []
    start = 0
    for i, (z, y, n) in enumerate(zip(zs, ys, sizes)):
        t0 = time.perf_counter()
        piece = merged.grad[start:start + n]
        if rescale:
            piece = piece * (total / n)
        start += n
        bytes_up.append(tensor_bytes(z.detach()) + tensor_bytes(y))
        bytes_down.append(tensor_bytes(piece))
        z.backward(piece)
        clip(client_params[i], cfg)
        client_optimizers[i].step()
        seconds[i] += time.perf_counter() - t0
    return MergedStep(float(loss.detach()), sizes, bytes_up, bytes_down, seconds, server_seconds)


# -- MU-SplitFed ------------------------------------------------------------------------------
def _directions(params: Sequence[torch.Tensor], generator: torch.Generator) -> List[torch.Tensor]:
    """One standard-normal direction per tensor (drawn on the CPU generator, then moved)."""
    return [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device, p.dtype) for p in params]


@torch.no_grad()
def _set(params: Sequence[torch.Tensor], base: Sequence[torch.Tensor], directions: Sequence[torch.Tensor],
         scale: float) -> None:
    for p, b, u in zip(params, base, directions):
        p.copy_(b + scale * u)


@torch.no_grad()
def _zo_grad(params: Sequence[torch.Tensor], directions: Sequence[torch.Tensor], difference: torch.Tensor,
             smoothing: float) -> None:
    """``p.grad = (f(+) - f(-)) / (2 lambda) u``: the two-point zeroth-order estimate."""
    coefficient = difference / (2 * smoothing)
    for p, u in zip(params, directions):
        p.grad = (coefficient * u).to(p.dtype)


def train_unbalanced(fabric, client_forward: ClientForward, server_loss: ServerLoss,
                     client_optimizer: torch.optim.Optimizer, server_optimizer: torch.optim.Optimizer,
                     data: ClientData, cfg: LocalTrainConfig, generator: torch.Generator, tau: int,
                     feedback_at: FeedbackAt = "end", client_params: Sequence[torch.Tensor] = (),
                     server_params: Sequence[torch.Tensor] = (), estimator: Estimator = "fo",
                     smoothing: float = 1e-3, zo_generator: Optional[torch.Generator] = None) -> SplitFit:
    """MU-SplitFed's unbalanced update: per client batch, ``tau`` server steps on the received
    activations and one client step.

    ``feedback_at`` is the server state the client's feedback is computed with: ``start`` (the
    state it received the batch in, before its ``tau`` steps; ``tau = 1`` is then SplitFed),
    ``last_step`` (the gradient of its ``tau``-th step) or ``end`` (the state after its ``tau``
    steps: one more server forward and backward, no step).

    ``estimator``: ``fo`` sends the gradient at the cut down (first order); ``zo`` is the
    original's two-point zeroth-order estimator on both halves (Gaussian directions from
    ``zo_generator``, smoothing ``lambda``): each server step perturbs the server half by
    ``+-lambda u`` on the unperturbed activations, and the client sends its activations under
    ``+-lambda v`` and receives one scalar, the loss difference at the ``feedback_at`` state.
    ``client_params`` / ``server_params`` are the tensors each side trains (and perturbs).
    """
    if estimator == "zo" and zo_generator is None:
        raise ValueError("the zeroth-order estimator needs zo_generator")
    start = time.perf_counter()
    client_params, server_params = list(client_params), list(server_params)
    batches = data.steps(cfg.steps, generator) if cfg.steps else (
        b for _ in range(cfg.epochs) for b in data.epoch(generator))
    fit = SplitFit(len(data), 0, 0.0, 0.0)
    fit.extras["server_steps"] = 0
    total = None
    step = _zo_batch if estimator == "zo" else _fo_batch
    for x, y in batches:
        loss = step(fabric, client_forward, server_loss, client_optimizer, server_optimizer, x, y, cfg, tau,
                    feedback_at, client_params, server_params, smoothing, zo_generator, fit)
        fit.steps += 1
        fit.examples += len(y)
        fit.extras["server_steps"] += tau
        total = loss if total is None else total + loss
    fit.loss = float(total) / fit.steps if fit.steps else 0.0
    fit.seconds = time.perf_counter() - start
    return fit


def _fo_batch(fabric, client_forward, server_loss, client_optimizer, server_optimizer, x, y, cfg, tau,
              feedback_at, client_params, server_params, smoothing, zo_generator, fit) -> torch.Tensor:
    client_optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    z, sent = send_activation(fabric, client_forward, x, y, fit)
    t1 = time.perf_counter()
    feedback, first_loss = None, None
    for k in range(tau):
        server_optimizer.zero_grad(set_to_none=True)
        sent.grad = None
        with fabric.autocast():
            loss = server_loss(sent, y)
        fabric.backward(loss)
        if first_loss is None:
            first_loss = loss.detach()
        if (feedback_at == "start" and k == 0) or (feedback_at == "last_step" and k == tau - 1):
            feedback = sent.grad.detach().clone()
        clip(server_params, cfg)
        server_optimizer.step()
    if feedback_at == "end":
        with fabric.autocast():
            loss = server_loss(sent, y)
        feedback, = torch.autograd.grad(loss, sent)
    server_optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    apply_gradient(z, feedback, fit, client_optimizer, client_params, cfg)
    t3 = time.perf_counter()
    fit.client_seconds += (t1 - t0) + (t3 - t2)
    fit.server_seconds += t2 - t1
    return first_loss


@torch.no_grad()
def _zo_batch(fabric, client_forward, server_loss, client_optimizer, server_optimizer, x, y, cfg, tau,
              feedback_at, client_params, server_params, smoothing, zo_generator, fit) -> torch.Tensor:
    t0 = time.perf_counter()
    base_client = [p.detach().clone() for p in client_params]
    v = _directions(client_params, zo_generator)
    with fabric.autocast():
        h = client_forward(x)
        _set(client_params, base_client, v, smoothing)
        h_plus = client_forward(x)
        _set(client_params, base_client, v, -smoothing)
        h_minus = client_forward(x)
    _set(client_params, base_client, v, 0.0)
    t1 = time.perf_counter()
    fit.cut_bytes_up += tensor_bytes(h) + tensor_bytes(h_plus) + tensor_bytes(h_minus) + tensor_bytes(y)

    def client_difference():
        with fabric.autocast():
            return (server_loss(h_plus, y) - server_loss(h_minus, y)).float()

    difference, first_loss = None, None
    base_server = [p.detach().clone() for p in server_params]
    for k in range(tau):
        if (feedback_at == "start" and k == 0) or (feedback_at == "last_step" and k == tau - 1):
            difference = client_difference()  # at the state the k-th step starts from
        u = _directions(server_params, zo_generator)
        _set(server_params, base_server, u, smoothing)
        with fabric.autocast():
            loss_plus = server_loss(h, y).float()
        _set(server_params, base_server, u, -smoothing)
        with fabric.autocast():
            loss_minus = server_loss(h, y).float()
        _set(server_params, base_server, u, 0.0)
        if first_loss is None:
            first_loss = (loss_plus + loss_minus) / 2
        server_optimizer.zero_grad(set_to_none=True)
        _zo_grad(server_params, u, loss_plus - loss_minus, smoothing)
        clip(server_params, cfg)
        server_optimizer.step()
        base_server = [p.detach().clone() for p in server_params]
    if feedback_at == "end":
        difference = client_difference()
    server_optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    fit.cut_bytes_down += SCALAR_BYTES
    client_optimizer.zero_grad(set_to_none=True)
    _zo_grad(client_params, v, difference, smoothing)
    clip(client_params, cfg)
    client_optimizer.step()
    fit.client_seconds += (t1 - t0) + (time.perf_counter() - t2)
    fit.server_seconds += t2 - t1
    return first_loss


# -- MultiSFL ---------------------------------------------------------------------------------
@dataclass
class ReplayFit(SplitFit):
    replay_bytes_up: int = 0
    """Assistant devices' activations and labels sent to the server."""
    snapshots: int = 0
    """Times the client half was sent to the assistant devices (once per local epoch)."""
    replay_examples: int = 0


def train_split_replay(fabric, client_forward: ClientForward, helper_forward: ClientForward,
                       refresh_helper: Callable[[], None], server_loss: ServerLoss,
                       client_optimizer: torch.optim.Optimizer, server_optimizer: torch.optim.Optimizer,
                       data: ClientData, helper_data: Optional[ClientData], cfg: LocalTrainConfig,
                       generator: torch.Generator, helper_generator: torch.Generator,
                       client_params: Sequence[torch.Tensor] = (),
                       server_params: Sequence[torch.Tensor] = ()) -> ReplayFit:
    """Split training with MultiSFL's knowledge replay.

    At the start of every local epoch (every ``data.batches_per_epoch()`` batches) the client
    half is snapshotted for the assistant devices (``refresh_helper``) and their replay examples
    are reshuffled into chunks (``helper_data``'s batch size); the j-th client batch of the epoch
    is joined by the j-th chunk while chunks last. The helpers' activations come from the frozen
    snapshot (no gradient goes back to them). The server half runs on the client part and the
    replay part separately (batch norm sees each part's statistics) and minimizes the mean loss
    over both, ``(n_c L_c + n_r L_r) / (n_c + n_r)``; the client gets the gradient of that loss
    at its own activations.
    """
    start = time.perf_counter()
    client_params, server_params = list(client_params), list(server_params)
    per_epoch = data.batches_per_epoch()
    total_steps = cfg.steps if cfg.steps else cfg.epochs * per_epoch
    fit = ReplayFit(len(data), 0, 0.0, 0.0)
    chunks: list = []
    total = None
    for j, (x, y) in enumerate(data.steps(total_steps, generator)):
        position = j % per_epoch
        if position == 0 and helper_data is not None:
            refresh_helper()
            chunks = list(helper_data.epoch(helper_generator))
            if len(chunks) > 1 and len(chunks[-1][1]) == 1:  # no one-row part: it joins the one before
                (ax, ay), (bx, by) = chunks[-2], chunks[-1]
                chunks[-2:] = [(torch.cat([ax, bx]), torch.cat([ay, by]))]
            fit.snapshots += 1
        client_optimizer.zero_grad(set_to_none=True)
        server_optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        z, sent = send_activation(fabric, client_forward, x, y, fit)
        t1 = time.perf_counter()
        parts = [(sent, y)]
        if position < len(chunks):
            hx, hy = chunks[position]
            with torch.no_grad(), fabric.autocast():
                replayed = helper_forward(hx)
            parts.append((replayed.detach(), hy))
            fit.replay_bytes_up += tensor_bytes(replayed) + tensor_bytes(hy)
            fit.replay_examples += len(hy)
        rows = sum(len(part_y) for _, part_y in parts)
        with fabric.autocast():
            loss = sum(len(part_y) * server_loss(part, part_y) for part, part_y in parts) / rows
        fabric.backward(loss)
        clip(server_params, cfg)
        server_optimizer.step()
        t2 = time.perf_counter()
        apply_gradient(z, sent.grad, fit, client_optimizer, client_params, cfg)
        t3 = time.perf_counter()
        fit.client_seconds += (t1 - t0) + (t3 - t2)
        fit.server_seconds += t2 - t1
        fit.steps += 1
        fit.examples += len(y)
        total = loss.detach() if total is None else total + loss.detach()
    fit.loss = float(total) / fit.steps if fit.steps else 0.0
    fit.seconds = time.perf_counter() - start
    return fit
