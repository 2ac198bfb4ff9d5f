"""Server-update rules of the split-FL baselines on the engine of ``modules/split.py``
(docs/sfl_baselines.md).

- :func:`merged_step` (MergeSFL): one lock-stepped iteration of a whole cohort. The server
  half takes one step on the concatenation of every client's activations and each client gets
  back its slice of the gradient.
- :func:`unbalanced` (MU-SplitFed, first order): per client batch the server half takes
  ``tau`` steps on the same activations while the client half takes one;
  :func:`zeroth_order_step` is the original's two-point zeroth-order variant of the same step.
- :class:`Replay` (MultiSFL): the server half trains on the client's activations together with
  replayed activations of assistant devices, computed by a frozen snapshot of the client half.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Sequence

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.modules.split import SplitFit, SplitPair, ServerLoss, apply_feedback
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.client_data import ClientData

FeedbackAt = Literal["start", "last_step", "end"]


# -- MergeSFL ---------------------------------------------------------------------------------
@dataclass
class MergedStep:
    """What one lock-stepped iteration did, per client (in cohort order)."""

    loss: float
    """The server loss on the merged batch."""
    sizes: List[int]
    """Each client's rows in the merged batch."""
    client_seconds: List[float]
    server_seconds: float


def merged_step(fabric, pairs: Sequence[SplitPair], server_loss: ServerLoss, server_optimizer: torch.optim.Optimizer,
                server_module: torch.nn.Module, batches: Sequence[tuple], fits: Sequence[SplitFit],
                cfg: LocalTrainConfig, rescale: bool = True) -> MergedStep:
    """One MergeSFL iteration: every client's forward on its batch, one server step on the
    concatenation (in cohort order), each client's backward on its slice of the gradient.

    The server loss is the mean over the merged batch of ``B = sum_i b_i`` rows, so the slice of
    client i is ``(1/B) d l_j / d z_j`` for its rows; ``rescale`` multiplies it by ``B / b_i``,
    which makes it the gradient of the mean loss over the client's own rows (MergeSFL's gradient
    dispatch). Each client's traffic goes to its own ``fits[i]``.
    """
    for pair in pairs:
        pair.client_optimizer.zero_grad(set_to_none=True)
    server_optimizer.zero_grad(set_to_none=True)
    zs, ys, seconds = [], [], []
    for pair, (x, y) in zip(pairs, batches):
        t0 = time.perf_counter()
        with fabric.autocast():
            zs.append(pair.client_forward(x))
        ys.append(y)
        seconds.append(time.perf_counter() - t0)
    sizes = [len(y) for y in ys]
    t0 = time.perf_counter()
    merged = torch.cat([z.detach() for z in zs]).requires_grad_()
    labels = torch.cat(ys)
    with fabric.autocast():
        loss = server_loss(merged, labels)
    fabric.backward(loss)
    if cfg.grad_clip is not None:
        fabric.clip_gradients(server_module, server_optimizer, max_norm=cfg.grad_clip, error_if_nonfinite=False)
    server_optimizer.step()
    server_seconds = time.perf_counter() - t0
    total = sum(sizes)
    start = 0
    for i, (pair, z, y, n) in enumerate(zip(pairs, zs, ys, sizes)):
        t0 = time.perf_counter()
        piece = merged.grad[start:start + n]
        if rescale:
            piece = piece * (total / n)
        start += n
        fits[i].channel.up("cut", z.detach(), y)
        apply_feedback(fabric, pair, z, piece, fits[i], cfg)
        seconds[i] += time.perf_counter() - t0
    return MergedStep(float(loss.detach()), sizes, seconds, server_seconds)


# -- MU-SplitFed ------------------------------------------------------------------------------
def unbalanced(tau: int, feedback_at: FeedbackAt = "end") -> Callable:
    """MU-SplitFed's server rule: ``tau`` server steps per received batch.

    ``feedback_at`` is the server state the client's feedback is computed with: ``start`` (the
    state it received the batch in, before its ``tau`` steps; ``tau = 1`` is then SplitFed),
    ``last_step`` (the gradient of its ``tau``-th step) or ``end`` (the state after its ``tau``
    steps: one more server forward and backward, no step). The loss reported is the first step's.
    """

    def rule(fabric, pair: SplitPair, sent, y, cfg, index, fit: SplitFit):
        feedback, first_loss = None, None
        for k in range(tau):
            pair.server_optimizer.zero_grad(set_to_none=True)
            sent.grad = None
            with fabric.autocast():
                loss = pair.server_loss(sent, y)
            fabric.backward(loss)
            if first_loss is None:
                first_loss = loss.detach()
            if (feedback_at == "start" and k == 0) or (feedback_at == "last_step" and k == tau - 1):
                feedback = sent.grad.detach().clone()
            pair.clip_server(fabric, cfg)
            pair.server_optimizer.step()
        if feedback_at == "end":
            with fabric.autocast():
                loss = pair.server_loss(sent, y)
            feedback, = torch.autograd.grad(loss, sent)
        pair.server_optimizer.zero_grad(set_to_none=True)
        return first_loss, feedback
    return rule


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


def _trained(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def zeroth_order_step(pair: SplitPair, tau: int, feedback_at: FeedbackAt, smoothing: float,
                      generator: torch.Generator) -> Callable:
    """MU-SplitFed's original two-point zeroth-order estimator on both halves, as a step of
    :func:`fl_lightning.modules.split.train_split` (Gaussian directions from ``generator``,
    smoothing ``lambda``): each of the ``tau`` server steps perturbs the server half by
    ``+-lambda u`` on the unperturbed activations, and the client sends its activations under
    ``+-lambda v`` and receives one scalar, the loss difference at the ``feedback_at`` state."""
    client_params, server_params = _trained(pair.client_optimizer), _trained(pair.server_optimizer)

    @torch.no_grad()
    def step(fabric, index, x, y, fit: SplitFit, cfg: LocalTrainConfig):
        t0 = time.perf_counter()
        base_client = [p.detach().clone() for p in client_params]
        v = _directions(client_params, generator)
        with fabric.autocast():
            h = pair.client_forward(x)
            _set(client_params, base_client, v, smoothing)
            h_plus = pair.client_forward(x)
            _set(client_params, base_client, v, -smoothing)
            h_minus = pair.client_forward(x)
        _set(client_params, base_client, v, 0.0)
        t1 = time.perf_counter()
        fit.channel.up("cut", h, h_plus, h_minus, y)

        def client_difference():
            with fabric.autocast():
                return (pair.server_loss(h_plus, y) - pair.server_loss(h_minus, y)).float()

        difference, first_loss = None, None
        base_server = [p.detach().clone() for p in server_params]
        for k in range(tau):
            if (feedback_at == "start" and k == 0) or (feedback_at == "last_step" and k == tau - 1):
                difference = client_difference()  # at the state the k-th step starts from
            u = _directions(server_params, generator)
            _set(server_params, base_server, u, smoothing)
            with fabric.autocast():
                loss_plus = pair.server_loss(h, y).float()
            _set(server_params, base_server, u, -smoothing)
            with fabric.autocast():
                loss_minus = pair.server_loss(h, y).float()
            _set(server_params, base_server, u, 0.0)
            if first_loss is None:
                first_loss = (loss_plus + loss_minus) / 2
            pair.server_optimizer.zero_grad(set_to_none=True)
            _zo_grad(server_params, u, loss_plus - loss_minus, smoothing)
            pair.clip_server(fabric, cfg)
            pair.server_optimizer.step()
            base_server = [p.detach().clone() for p in server_params]
        if feedback_at == "end":
            difference = client_difference()
        pair.server_optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        fit.channel.down("cut", difference)  # one float32 loss difference
        pair.client_optimizer.zero_grad(set_to_none=True)
        _zo_grad(client_params, v, difference, smoothing)
        pair.clip_client(fabric, cfg)
        pair.client_optimizer.step()
        fit.client_seconds += (t1 - t0) + (time.perf_counter() - t2)
        fit.server_seconds += t2 - t1
        return first_loss
    return step


# -- MultiSFL ---------------------------------------------------------------------------------
class Replay:
    """MultiSFL's knowledge replay as a server rule.

    At the start of every local epoch (every ``per_epoch`` batches) the client half is
    snapshotted for the assistant devices (``refresh_helper``) and their replay examples are
    reshuffled into chunks (``helper_data``'s batch size); the j-th client batch of the epoch
    is joined by the j-th chunk while chunks last. The helpers' activations come from the frozen
    snapshot (no gradient goes back to them). The server half runs on the client part and the
    replay part separately (batch norm sees each part's statistics) and minimizes the mean loss
    over both, ``(n_c L_c + n_r L_r) / (n_c + n_r)``; the client gets the gradient of that loss
    at its own activations.
    """

    def __init__(self, helper_forward: Callable, refresh_helper: Callable[[], None],
                 helper_data: Optional[ClientData], helper_generator: torch.Generator, per_epoch: int,
                 channel: Channel):
        self.helper_forward, self.refresh_helper = helper_forward, refresh_helper
        self.helper_data, self.helper_generator, self.per_epoch = helper_data, helper_generator, per_epoch
        self.chunks: list = []
        self.channel = channel
        """The assistant devices' link: their activations and labels go up as ``replay``."""
        self.examples = 0

    def __call__(self, fabric, pair: SplitPair, sent, y, cfg, index, fit: SplitFit):
        position = index % self.per_epoch
        if position == 0 and self.helper_data is not None:
            self.refresh_helper()
            chunks = list(self.helper_data.epoch(self.helper_generator))
            if len(chunks) > 1 and len(chunks[-1][1]) == 1:  # no one-row part: it joins the one before
                (ax, ay), (bx, by) = chunks[-2], chunks[-1]
                chunks[-2:] = [(torch.cat([ax, bx]), torch.cat([ay, by]))]
            self.chunks = chunks
        parts = [(sent, y)]
        if position < len(self.chunks):
            hx, hy = self.chunks[position]
            with torch.no_grad(), fabric.autocast():
                replayed = self.helper_forward(hx)
            parts.append((replayed.detach(), hy))
            self.channel.up("replay", replayed, hy)
            self.examples += len(hy)
        rows = sum(len(part_y) for _, part_y in parts)
        with fabric.autocast():
            loss = sum(len(part_y) * pair.server_loss(part, part_y) for part, part_y in parts) / rows
        fabric.backward(loss)
        pair.clip_server(fabric, cfg)
        pair.server_optimizer.step()
        return loss.detach(), sent.grad
