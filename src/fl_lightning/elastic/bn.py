"""Batch-norm statistics: reset and recalibrate (Once-for-All's ``set_running_statistics``).

Weight-shared widths disagree on activation statistics, so running statistics collected while
training one mixture of widths fit none of them well. Before evaluating an operating point,
reset the statistics and re-estimate them on a few server-held batches in that configuration.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batch_norms(model: nn.Module) -> list[_BatchNorm]:
    """Every batch-norm layer that tracks running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def statistics_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every batch norm's running statistics (mean, variance, batch count)."""
    keys = set()
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            prefix = f"{name}." if name else ""
            keys.update(prefix + key for key, value in module._buffers.items() if value is not None)
    return keys


def use_batch_statistics(model: nn.Module) -> None:
    """Batch norms stop tracking running statistics: in training they normalize with the
    batch's statistics and leave their buffers untouched (HeteroFL's static BN while training)."""
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False


def _default_forward(model: nn.Module) -> Callable[[Any], Any]:
    def forward(batch):
        # Accept (inputs, targets) pairs as data loaders yield them.
        return model(batch[0] if isinstance(batch, (tuple, list)) else batch)
    return forward


@torch.no_grad()
def recalibrate_bn(model: nn.Module, batches: Iterable[Any],
                   forward: Optional[Callable[[Any], Any]] = None) -> int:
    """Re-estimate running statistics from ``batches``; returns the number of batches used.

    Statistics are reset, then each batch is forwarded with only the batch-norm layers in
    training mode (dropout and the like stay off, so the result depends on the batches and
    their order only) and ``momentum=None``, so the running statistics are the plain average
    of the per-batch statistics. Modes and momenta are restored afterwards; no trainable
    parameter changes. ``forward(batch)`` defaults to ``model(batch)`` (or ``model(batch[0])``
    for tuples), so set the operating point (e.g. ``model.set_active(spec)``) beforehand.
    """
    batches = iter(batches)
    first = next(batches, None)
    if first is None:
        raise ValueError("recalibrate_bn needs at least one batch")
    forward = forward or _default_forward(model)
    norms = batch_norms(model)
    modes = {m: m.training for m in model.modules()}
    momenta = {bn: bn.momentum for bn in norms}
    count = 0
    try:
        model.eval()
        for bn in norms:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        for batch in itertools.chain([first], batches):
            forward(batch)
            count += 1
    finally:
        for module, mode in modes.items():
            module.training = mode
        for bn, momentum in momenta.items():
            bn.momentum = momentum
    return count


@contextmanager
def batch_statistics(model: nn.Module) -> Iterator[nn.Module]:
    """The model as local training runs it, minus its side effects: batch norm normalizes by
    each batch's own statistics and leaves its running statistics untouched; every other
    module is in evaluation mode (no dropout). Modes are restored on exit.

    Why: after the few local steps of a small shard, running statistics are far from the
    data's, and an evaluation-mode batch-norm network is then effectively unnormalized
    (features up to 100 times the training-mode ones were measured on the narrow ResNet-18)."""
    modes = {m: m.training for m in model.modules()}
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    tracking = {m: m.track_running_stats for m in norms}
    try:
        model.eval()
        for norm in norms:
            norm.train()
            norm.track_running_stats = False  # batch statistics, no running-statistics update
        yield model
    finally:
        for module, mode in modes.items():
            module.training = mode
        for norm, track in tracking.items():
            norm.track_running_stats = track


class BatchMoments:
    """Pools the statistics of every batch a model's batch norms normalize in training.

    Forward hooks on each tracking batch norm add the batch's per-channel sums of ``x`` and
    ``x^2`` (float64) to a running total and overwrite the running buffers with the pooled
    mean and (biased) variance of every value seen since :meth:`reset`: the statistics of the
    whole population of training activations, not a momentum average dominated by the last
    batches. A layer that normalizes a leading slice of its channels (an elastic width) pools
    into that slice only. Install once per module with :func:`batch_moments`.
    """

    def __init__(self, model: nn.Module):
        self.sums: dict = {}
        self.handles = [bn.register_forward_hook(self._hook) for bn in batch_norms(model)]

    def reset(self) -> None:
        self.sums = {}

    @torch.no_grad()
    def _hook(self, bn: _BatchNorm, args, output) -> None:
        if not bn.training:
            return
        x = args[0].detach().to(torch.float64)
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.shape[1]
        total, square, count = self.sums.get(bn, (0.0, 0.0, 0))
        total, square, count = total + x.sum(dims), square + x.square().sum(dims), count + n
        self.sums[bn] = (total, square, count)
        channels = x.shape[1]
        mean = total / count
        # through .data: the batch-norm call that just ran saved these buffers for its backward
        bn.running_mean.data[:channels].copy_(mean)
        bn.running_var.data[:channels].copy_((square / count - mean.square()).clamp_min(0.0))


def batch_moments(model: nn.Module) -> BatchMoments:
    """The model's :class:`BatchMoments`, installed on first use and reset on every call."""
    tracker = model.__dict__.get("_batch_moments")
    if tracker is None:
        tracker = BatchMoments(model)
        model.__dict__["_batch_moments"] = tracker
    tracker.reset()
    return tracker


def variance_keys(state) -> list[tuple[str, str]]:
    """(running-mean key, running-variance key) of every batch norm in a state dict."""
    return [(key[:-len("running_var")] + "running_mean", key) for key in state if key.endswith("running_var")]

