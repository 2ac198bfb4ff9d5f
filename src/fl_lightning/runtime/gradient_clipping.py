"""Gradient clipping by the total 2-norm in a handful of operations.

``Fabric.clip_gradients`` ends in ``torch.nn.utils.clip_grad_norm_``, which moves every
parameter's norm to the first one's device before stacking them: one operation per parameter
and step on the host, even when all are on one device (234 of the main job's step). Here the
same arithmetic (per-tensor norms in one multi-tensor call, their 2-norm, the coefficient
``max_norm / (norm + 1e-6)`` clamped at 1, one multi-tensor scaling) runs when the gradients
share one device and dtype; otherwise, and for strategies that clip their own way (FSDP,
DeepSpeed), Fabric clips.
"""

from __future__ import annotations

import torch
from lightning.fabric.strategies.strategy import Strategy


def clip_gradients(fabric, module: torch.nn.Module, optimizer, max_norm: float) -> None:
    """Scale the gradients of ``optimizer``'s parameters so that their total 2-norm is at most
    ``max_norm`` (no error on a non-finite norm), as ``fabric.clip_gradients`` does."""
    strategy = fabric.strategy
    raw = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper holds the torch optimizer
    if type(strategy).clip_gradients_norm is Strategy.clip_gradients_norm:
        strategy.precision.unscale_gradients(raw)
        grads = [p.grad for p in strategy.precision.main_params(raw) if p.grad is not None]
        if not grads:
            return
        if len({(g.device, g.dtype) for g in grads}) == 1 and all(type(g) is torch.Tensor for g in grads):
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
            return
    fabric.clip_gradients(module, optimizer, max_norm=max_norm, error_if_nonfinite=False)
