"""Split-compatible interface harmonization (FedSGA Sec. 3.4), usable by any split method.

The server pools the received interface (spatial or token average), standardizes each example
over its channels (a per-example layer norm without affine parameters: without a
standardization the pooled maps of a ReLU network share one dominant direction and every
projection lands on the same point; per example, so an example's result never depends on which
others share its batch, whose few classes would otherwise set its statistics), zero-pads it to
the widest candidate's width, appends a learnable embedding of the split depth and projects it
with one two-layer MLP shared by all depths into a unit-norm semantic space. Class prototypes
are the projected class means, aggregated once per round over every client weighted by class
counts and carried across rounds by EMA; within a round they are fixed. The alignment loss is
the cross-entropy of the prototype similarities at temperature ``tau``: the harmonizer aligns and
regularizes, and the server half's own classifier predicts (the paper's Sec. 3.4). With a read-out
head (``head``, an option beyond the paper), the harmonized representation also enters the
server's prediction (:class:`HarmonizedNetwork`; docs/fedsga.md).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def pool_interface(z: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> mean over positions; (B, N, D) tokens -> mean over tokens; (B, D) as is."""
    if z.dim() == 4:
        return z.mean(dim=(2, 3))
    if z.dim() == 3:
        return z.mean(dim=1)
    return z.flatten(1)


def standardized(z: torch.Tensor) -> torch.Tensor:
    """The pooled interface, each example standardized over its channels (float32)."""
    pooled = pool_interface(z).float()
    return F.layer_norm(pooled, pooled.shape[1:])


def averaged_tensors(harmonizer: nn.Module) -> dict:
    """A harmonizer's averaged tensors: parameters and normalization statistics (the
    prototypes have a rule of their own)."""
    return {k: v for k, v in harmonizer.state_dict().items()
            if v.is_floating_point() and k not in ("prototypes", "has_prototype")}


class InterfaceHarmonizer(nn.Module):
    """Depth-aware projector with per-round class prototypes.

    Args:
        widths: pooled interface width at each candidate depth, shallowest first.
        num_classes: number of prototypes.
        projection_dim: width of the shared semantic space.
        hidden: hidden width of the projector MLP.
        depth_dim: width of the learnable split-depth embedding.
        tau: prototype temperature tau_a.
        momentum: prototype EMA coefficient mu (across rounds).
        head: a linear read-out from the semantic space to class logits, added to the server's
            prediction (zero at initialization, so training starts from the backbone's).
        head_bias: the read-out has a bias. It duplicates the classifier's: both get the same
            gradient, so under one optimizer the class prior moves twice as fast.
    """

    def __init__(self, widths: Sequence[int], num_classes: int, projection_dim: int = 128, hidden: int = 256,
                 depth_dim: int = 16, tau: float = 0.5, momentum: float = 0.9, head: bool = False,
                 head_bias: bool = False):
        super().__init__()
        self.widths = list(widths)
        self.in_width = max(self.widths)
        self.tau = tau
        self.momentum = momentum
        self.depth_embedding = nn.Embedding(len(self.widths), depth_dim)
        self.projector = nn.Sequential(nn.Linear(self.in_width + depth_dim, hidden), nn.ReLU(inplace=True),
                                       nn.Linear(hidden, projection_dim))
        self.head = nn.Linear(projection_dim, num_classes, bias=head_bias) if head else None
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            if self.head.bias is not None:
                nn.init.zeros_(self.head.bias)
        self.register_buffer("prototypes", torch.zeros(num_classes, projection_dim))
        self.register_buffer("has_prototype", torch.zeros(num_classes))

    def project(self, z: torch.Tensor, depth: int) -> torch.Tensor:
        """Unit-norm features of the interface ``z`` received from candidate ``depth``; each
        example's features depend on that example alone."""
        pooled = standardized(z)
        if pooled.shape[1] != self.widths[depth]:
            raise ValueError(f"depth {depth} carries width {self.widths[depth]}, got {pooled.shape[1]}")
        padded = F.pad(pooled, (0, self.in_width - pooled.shape[1]))
        embedding = self.depth_embedding.weight[depth].expand(len(padded), -1)
        return F.normalize(self.projector(torch.cat([padded, embedding], dim=1)), dim=1)

    @torch.no_grad()
    def class_sums(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-class sums of ``features`` and class counts (float64), what a batch adds to the
        round's prototype statistics."""
        num_classes = self.prototypes.shape[0]
        counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        sums = torch.zeros(self.prototypes.shape, dtype=torch.float64, device=features.device)
        sums.index_add_(0, labels, features.detach().to(torch.float64))
        return sums, counts

    @torch.no_grad()
    def update_prototypes(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """The round's EMA step: each class seen this round moves to
        ``normalize(mu C_k + (1 - mu) m_k)`` with ``m_k`` its mean projected feature over every
        client's examples of the round (``normalize(m_k)`` at its first round)."""
        seen = counts > 0
        if not seen.any():
            return
        means = (sums[seen] / counts[seen, None]).to(self.prototypes.dtype)
        old = self.prototypes[seen]
        known = self.has_prototype[seen, None] > 0
        blended = torch.where(known, self.momentum * old + (1 - self.momentum) * means, means)
        self.prototypes[seen] = F.normalize(blended, dim=1)
        self.has_prototype[seen] = 1.0

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Prototype similarities over tau; classes without a prototype get -inf."""
        logits = features @ self.prototypes.t().to(features.dtype) / self.tau
        return logits.masked_fill(self.has_prototype[None, :] == 0, float("-inf"))

    def alignment_loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the prototype similarities over the examples whose class has a
        prototype (zero, with a graph, before any has: the first round)."""
        known = self.has_prototype[labels] > 0
        if not known.any():
            return features.sum() * 0.0
        return F.cross_entropy(self.logits(features[known]), labels[known])


class HarmonizedNetwork(nn.Module):
    """The served prediction of a model cut at ``cut`` (candidate ``depth``) with the harmonized
    interface on the prediction path: ``back(z) + head(project(z, depth))`` with ``z = front(x)``."""

    def __init__(self, model: nn.Module, harmonizer: InterfaceHarmonizer, cut: str, depth: int):
        super().__init__()
        self.model, self.harmonizer, self.depth = model, harmonizer, depth
        self.front, self.back = model.split(cut)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.front(x)
        return self.back(z) + self.harmonizer.head(self.harmonizer.project(z, self.depth)).to(z.dtype)
