"""SCAFFOLD's corrected local step: y <- y - lr (g(y) + c - c_i) (Karimireddy et al., 2020)."""

from __future__ import annotations

from typing import Sequence

import torch

from fl_lightning.modules.supervised import SupervisedClient


class ControlVariateClient(SupervisedClient):
    """Adds the drift correction ``c - c_i`` to every gradient before the optimizer step.

    ``correction`` holds one tensor per parameter (in ``model.parameters()`` order), computed
    once per round as ``c - c_i``.
    """

    def __init__(self, model, lr, correction: Sequence[torch.Tensor], weight_decay=0.0):
        super().__init__(model, lr, momentum=0.0, weight_decay=weight_decay)
        self.correction = list(correction)

    def on_before_optimizer_step(self, optimizer) -> None:
        for p, c in zip(self.model.parameters(), self.correction):
            if p.grad is not None:
                p.grad.add_(c)


def option_ii_update(c_i: Sequence[torch.Tensor], c: Sequence[torch.Tensor], x: Sequence[torch.Tensor],
                     y: Sequence[torch.Tensor], steps: int, lr: float) -> list[torch.Tensor]:
    """SCAFFOLD option II: ``c_i+ = c_i - c + (x - y) / (K lr)`` for K local steps at rate lr."""
    scale = 1.0 / (steps * lr)
    return [ci - cg + (xg - yl) * scale for ci, cg, xg, yl in zip(c_i, c, x, y)]
