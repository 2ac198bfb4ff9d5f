"""ScaleFL's client objective: cross-entropy at every exit plus early-exit self-distillation.

For a client model with exits ``z_1 .. z_k`` (shallowest first; ``z_k`` is its final classifier),
as ScaleFL's ``train.py`` / ``KDLoss.loss_fn_kd`` compute it:

    L = sum_j w_j [ CE(z_j, y) + gamma T^2 KL(softmax(z_k / T) || softmax(z_j / T)) ]   (j < k)
        + w_k CE(z_k, y)

- weights ``w_j = j / (k (k + 1) / 2)`` ("depth": deeper exits weigh more, the weights sum to 1)
  or ``w_j = 1`` ("sum": the plain sum over exits);
- the KL term is averaged over every element of the batch-by-class matrix, as PyTorch's
  ``nn.KLDivLoss()`` default reduction ``'mean'`` that the original uses does
  (``reduction="elementwise"``), or over the batch only (``"batchmean"``, the true KL per example);
- the teacher ``z_k`` is not detached in the original, so the KL terms also pull the deepest exit
  towards the shallower ones (``detach_teacher=False``);
- the KL terms are on only when ``kd_active`` (the original switches them on after the first
  quarter of the rounds; the server decides per round).
- with a mixer (FEAST's Mixup / CutMix protocol, not in the original), ``CE`` takes the mixed
  per-class target probabilities; the distillation terms do not involve the labels.

``docs/scalefl.md`` gives the sources and defaults.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.modules.mixing import NoMix, soft_cross_entropy
from fl_lightning.modules.supervised import SupervisedClient

ExitWeights = Literal["depth", "sum"]
KLReduction = Literal["elementwise", "batchmean"]


def exit_weights(num_exits: int, scheme: ExitWeights = "depth") -> list[float]:
    """Weight of each exit's term, shallowest first (see the module docstring)."""
    if num_exits < 1:
        raise ValueError("a client model has at least one exit")
    if scheme == "depth":
        total = num_exits * (num_exits + 1) / 2
        return [j / total for j in range(1, num_exits + 1)]
    if scheme == "sum":
        return [1.0] * num_exits
    raise ValueError(f"unknown exit weighting {scheme!r}; known: depth, sum")


def _kl(student: torch.Tensor, teacher_probs: torch.Tensor, temperature: float, reduction: KLReduction) -> torch.Tensor:
    log_q = F.log_softmax(student.float() / temperature, dim=-1)
    total = F.kl_div(log_q, teacher_probs, reduction="sum")
    # "elementwise" is nn.KLDivLoss's reduction='mean' (which PyTorch plans to redefine), written out
    return total / (teacher_probs.numel() if reduction == "elementwise" else teacher_probs.shape[0])


def scalefl_loss(logits: Sequence[torch.Tensor], targets: torch.Tensor, gamma: float, temperature: float,
                 kd_active: bool = True, weights: ExitWeights = "depth", reduction: KLReduction = "elementwise",
                 detach_teacher: bool = False) -> torch.Tensor:
    """The client objective of one mini-batch from the logits of its exits (shallowest first);
    ``targets`` are class indices or per-class probabilities (mixed batches)."""
    k = len(logits)
    w = exit_weights(k, weights)
    distill = kd_active and gamma > 0 and k > 1
    if distill:  # the teacher's distribution, computed once for every student exit
        teacher = logits[-1].detach() if detach_teacher else logits[-1]
        teacher_probs = F.softmax(teacher.float() / temperature, dim=-1)
    total = logits[0].new_zeros((), dtype=torch.float32)
    for j, z in enumerate(logits):
        term = soft_cross_entropy(z, targets)
        if distill and j < k - 1:
            term = term + gamma * temperature ** 2 * _kl(z, teacher_probs, temperature, reduction)
        total = total + w[j] * term
    return total


class ScaleFLClient(SupervisedClient):
    """Trains a ScaleFL client model (``forward_exits`` returns its exits) with
    :func:`scalefl_loss` and plain SGD."""

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 gamma: float = 0.05, temperature: float = 3.0, kd_active: bool = True,
                 weights: ExitWeights = "depth", reduction: KLReduction = "elementwise",
                 detach_teacher: bool = False, mixer: Optional[Callable] = None):
        super().__init__(model, lr, momentum, weight_decay)
        self.mixer = mixer if mixer is not None else NoMix()
        self.gamma, self.temperature, self.kd_active = float(gamma), float(temperature), bool(kd_active)
        self.weights, self.reduction, self.detach_teacher = weights, reduction, bool(detach_teacher)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, targets = self.mixer(*batch, batch_idx)
        return scalefl_loss(self.model.forward_exits(x), targets, self.gamma, self.temperature, self.kd_active,
                            self.weights, self.reduction, self.detach_teacher)
