"""FedSGA's shallow sufficiency estimation (Sec. 3.3): descriptors, the estimator Gamma_theta,
the calibration label and the split policy Psi. Formulas: docs/fedsga.md."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

NUM_DESCRIPTORS = 3  # semantic alignment, temporal stability, prompt-state variation


def temporal_stability(pooled: torch.Tensor, previous: Optional[torch.Tensor]) -> float:
    """Mean cosine similarity of the probe batch's pooled interface with the previous fit's."""
    if previous is None:
        return 0.0
    return float(F.cosine_similarity(pooled.float(), previous.float(), dim=1).mean())


def prompt_variation(before: list, after: list, grad_norms: torch.Tensor, tau: float, eps: float = 1e-12) -> float:
    """``sum_j w_j delta_j``: each token's relative change over the fit, weighted by
    ``softmax(log g / tau)`` of its mean gradient norm (tokens the loss leans on weigh most)."""
    delta = torch.stack([(a.double() - b.double()).norm() / (a.double().norm() + b.double().norm() + eps)
                         for b, a in zip(before, after)])
    weights = torch.softmax(torch.log(grad_norms.double() + eps) / tau, dim=0)
    # Each delta is at most 1 (triangle inequality) and the weights sum to 1, but rounding can
    # land the sum an ulp outside [0, 1] (a zero-initialised token gives delta exactly 1).
    return min(max(float((weights * delta).sum()), 0.0), 1.0)


def sufficiency_labels(loss_p1: torch.Tensor, loss_ref: torch.Tensor, beta: float) -> torch.Tensor:
    """Per client, the shallowest split suffices when ``L(p1) <= (1 + beta) L(p_ref)``."""
    return loss_p1 <= (1.0 + beta) * loss_ref


@torch.no_grad()
def held_out_losses(probes: "DepthProbes", depth: int, rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each client's probe loss at ``depth``: the mean cross-entropy of the depth's probe over
    the client's rows ``[client, example, width]`` with labels ``[client, example]``."""
    logits = probes.logits(rows.flatten(0, 1), depth)
    return F.cross_entropy(logits, labels.flatten(), reduction="none").view(labels.shape).mean(dim=1)


def handcrafted_score(descriptor: torch.Tensor) -> float:
    """Estimator-free sufficiency score (the "w/o Suff. Est." ablation): the descriptors
    rescaled to [0, 1] (alignment, stability, one minus variation) and averaged."""
    a, s, v = (float(x) for x in descriptor)
    return (a + (s + 1.0) / 2.0 + (1.0 - v)) / 3.0


def split_index(r: float, num_candidates: int, rho: float, deepest_affordable: Optional[int] = None) -> int:
    """Psi: ``clamp(round((1 - r + rho)(K - 1)), 0, K - 1)``, capped at the deepest affordable.

    Monotone: a larger sufficiency probability never gives a deeper split; a larger ``rho``
    never gives a shallower one.
    """
    k = int(torch.floor(torch.tensor((1.0 - r + rho) * (num_candidates - 1) + 0.5, dtype=torch.float64)))
    k = min(max(k, 0), num_candidates - 1)
    if deepest_affordable is not None:
        k = min(k, deepest_affordable)
    return k


class SufficiencyEstimator(nn.Module):
    """Gamma_theta: descriptors -> probability that the shallowest split suffices (two-layer MLP)."""

    def __init__(self, hidden: int = 16, inputs: int = NUM_DESCRIPTORS):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.register_buffer("trained", torch.zeros(()))

    def forward(self, descriptors: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(descriptors).squeeze(-1))

    @torch.no_grad()
    def probability(self, descriptor: torch.Tensor) -> float:
        return float(self(descriptor.float()[None])[0])

    def fit(self, descriptors: torch.Tensor, labels: torch.Tensor, steps: int = 100, lr: float = 0.01) -> dict:
        """Full-batch binary cross-entropy with Adam; returns the fit's BCE and accuracy."""
        x, y = descriptors.float(), labels.float()
        optimizer = torch.optim.Adam(self.net.parameters(), lr=lr)
        with torch.enable_grad():
            for _ in range(steps):
                optimizer.zero_grad()
                loss = F.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y)
                loss.backward()
                optimizer.step()
        self.trained.fill_(1.0)
        with torch.no_grad():
            logits = self.net(x).squeeze(-1)
            return {"bce": float(F.binary_cross_entropy_with_logits(logits, y)),
                    "accuracy": float(((logits > 0).float() == y).float().mean())}


class DepthProbes(nn.Module):
    """The sufficiency probe: a linear classifier per probed depth on the standardized pooled
    interface (``harmonizer.standardized``), giving the probe loss L(p) of the calibration
    label and the alignment descriptor.

    Every round the server refits each probe on the first half of every committed client's
    probe-batch interfaces at that depth (the received model's, computed by the client),
    warm-started from the last round's, so a depth's probe is trained as often as any other's
    whatever share of the clients the split policy sends there; the second half, never fitted,
    gives the calibration's losses. Until its first fit a probe reads as the uniform guess.

    Args:
        widths: depth index -> pooled interface width, for each probed depth.
        num_classes: classes of the task.
    """

    def __init__(self, widths: dict, num_classes: int):
        super().__init__()
        self.depths = sorted(widths)
        self.heads = nn.ModuleDict({str(d): nn.Linear(widths[d], num_classes) for d in self.depths})
        self.register_buffer("trained", torch.zeros(()))

    def logits(self, features: torch.Tensor, depth: int) -> torch.Tensor:
        return self.heads[str(depth)](features.float())

    @torch.no_grad()
    def loss(self, features: torch.Tensor, labels: torch.Tensor, depth: int) -> float:
        """Cross-entropy of the depth's probe (log C before the first fit)."""
        if not self.trained.item():
            return math.log(self.heads[str(depth)].out_features)
        return float(F.cross_entropy(self.logits(features, depth), labels))

    @torch.no_grad()
    def true_class_probability(self, features: torch.Tensor, labels: torch.Tensor, depth: int) -> float:
        """Mean probability the depth's probe gives each example's own class (1/C before the first fit)."""
        if not self.trained.item():
            return 1.0 / self.heads[str(depth)].out_features
        return float(self.logits(features, depth).softmax(dim=1).gather(1, labels[:, None]).mean())

    def fit(self, features: dict, labels: torch.Tensor, steps: int = 50, lr: float = 0.01) -> dict:
        """Full-batch cross-entropy with Adam on each depth's features (depth -> [n, width]);
        returns each probe's training loss."""
        out = {}
        with torch.enable_grad():
            for depth in self.depths:
                head = self.heads[str(depth)]
                optimizer = torch.optim.Adam(head.parameters(), lr=lr)
                x = features[depth].float()
                for _ in range(steps):
                    optimizer.zero_grad()
                    F.cross_entropy(head(x), labels).backward()
                    optimizer.step()
                with torch.no_grad():
                    out[f"probe{depth}_loss"] = float(F.cross_entropy(head(x), labels))
        self.trained.fill_(1.0)
        return out
