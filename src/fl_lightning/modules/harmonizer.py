"""Split-compatible interface harmonization (FedSGA Sec. 3.4), usable by any split method.

The server pools the received interface (spatial or token average), standardizes each channel
with batch-norm statistics of its depth (without them the pooled maps of a ReLU network share one
dominant direction and every projection lands on the same point), zero-pads it to the widest
candidate's width, appends a learnable embedding of the split depth and projects it
with one two-layer MLP shared by all depths into a unit-norm semantic space. Class
prototypes follow the projected class means by EMA, and the alignment loss is the
cross-entropy of the prototype similarities at temperature ``tau``. With a prediction head
(``head``), the harmonized representation also enters the server's prediction
(:class:`HarmonizedNetwork`; docs/fedsga.md).
"""

from __future__ import annotations

import math
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


class InterfaceHarmonizer(nn.Module):
    """Depth-aware projector with EMA class prototypes.

    Args:
        widths: pooled interface width at each candidate depth, shallowest first.
        num_classes: number of prototypes.
        projection_dim: width of the shared semantic space.
        hidden: hidden width of the projector MLP.
        depth_dim: width of the learnable split-depth embedding.
        tau: prototype temperature tau_a.
        momentum: prototype EMA coefficient mu.
        head: a linear map from the semantic space to class logits, added to the server's
            prediction (zero at initialization, so training starts from the backbone's).
    """

    def __init__(self, widths: Sequence[int], num_classes: int, projection_dim: int = 128, hidden: int = 256,
                 depth_dim: int = 16, tau: float = 0.5, momentum: float = 0.9, head: bool = False):
        super().__init__()
        self.widths = list(widths)
        self.in_width = max(self.widths)
        self.tau = tau
        self.momentum = momentum
        self.norms = nn.ModuleList(nn.BatchNorm1d(w, affine=False) for w in self.widths)
        self.depth_embedding = nn.Embedding(len(self.widths), depth_dim)
        self.projector = nn.Sequential(nn.Linear(self.in_width + depth_dim, hidden), nn.ReLU(inplace=True),
                                       nn.Linear(hidden, projection_dim))
        self.head = nn.Linear(projection_dim, num_classes) if head else None
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.register_buffer("prototypes", torch.zeros(num_classes, projection_dim))
        self.register_buffer("has_prototype", torch.zeros(num_classes))

    def project(self, z: torch.Tensor, depth: int) -> torch.Tensor:
        """Unit-norm features of the interface ``z`` received from candidate ``depth``."""
        pooled = pool_interface(z).float()
        if pooled.shape[1] != self.widths[depth]:
            raise ValueError(f"depth {depth} carries width {self.widths[depth]}, got {pooled.shape[1]}")
        norm = self.norms[depth]
        if norm.training and len(pooled) == 1:  # one row has no batch statistics: use the running ones
            pooled = F.batch_norm(pooled, norm.running_mean, norm.running_var, training=False, eps=norm.eps)
        else:
            pooled = norm(pooled)
        padded = F.pad(pooled, (0, self.in_width - pooled.shape[1]))
        embedding = self.depth_embedding.weight[depth].expand(len(padded), -1)
        return F.normalize(self.projector(torch.cat([padded, embedding], dim=1)), dim=1)

    @torch.no_grad()
    def update_prototypes(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """EMA step of the classes present in the batch; returns the batch's class counts."""
        num_classes = self.prototypes.shape[0]
        counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
        sums = torch.zeros_like(self.prototypes).index_add_(0, labels, features.to(self.prototypes.dtype))
        present = counts > 0
        means = sums[present] / counts[present, None]
        old = self.prototypes[present]
        seen = self.has_prototype[present, None] > 0
        blended = torch.where(seen, self.momentum * old + (1 - self.momentum) * means, means)
        self.prototypes[present] = F.normalize(blended, dim=1)
        self.has_prototype[present] = 1.0
        return counts

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Prototype similarities over tau; classes without a prototype get -inf."""
        logits = features @ self.prototypes.t().to(features.dtype) / self.tau
        return logits.masked_fill(self.has_prototype[None, :] == 0, float("-inf"))

    def alignment_loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the prototype similarities (every label has a prototype once the
        batch has updated them)."""
        return F.cross_entropy(self.logits(features), labels)

    def forward(self, z: torch.Tensor, labels: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Project, update the prototypes with the batch, return (alignment loss, class counts)."""
        features = self.project(z, depth)
        counts = self.update_prototypes(features.detach(), labels)
        return self.alignment_loss(features, labels), counts

    @torch.no_grad()
    def read(self, z: torch.Tensor, depth: int) -> torch.Tensor:
        """Prototype logits of ``z`` read without changing the harmonizer (running statistics)."""
        was_training = self.training
        self.eval()
        try:
            return self.logits(self.project(z, depth))
        finally:
            self.train(was_training)

    @torch.no_grad()
    def probe_loss(self, z: torch.Tensor, labels: torch.Tensor, depth: int) -> float:
        """Cross-entropy of the prototype classifier on the interface ``z`` from ``depth``
        (FedSGA's probe loss); the classes without a prototype are left out of the softmax,
        and examples of such a class are not scored."""
        logits = self.read(z, depth)
        known = self.has_prototype[labels] > 0
        if not known.any():
            return math.log(self.prototypes.shape[0])  # no prototype yet: the uniform guess
        return float(F.cross_entropy(logits[known], labels[known]))

    @torch.no_grad()
    def true_class_probability(self, z: torch.Tensor, labels: torch.Tensor, depth: int) -> torch.Tensor:
        """Mean softmax probability of each example's own class (the alignment descriptor)."""
        logits = self.read(z, depth)
        if torch.isinf(logits).all():
            return logits.new_zeros(())
        return logits.softmax(dim=1).gather(1, labels[:, None]).mean()


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
