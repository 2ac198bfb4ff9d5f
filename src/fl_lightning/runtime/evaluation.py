"""Accuracy and loss of a model on a dataset, shared across ranks by torchmetrics, and the
per-level evaluation of methods that serve several models."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.runtime.client_data import eval_batches
from fl_lightning.runtime.seeding import shard_for_rank


@torch.no_grad()
def evaluate(fabric, model: nn.Module, dataset, indices: Optional[torch.Tensor], num_classes: int,
             batch_size: int = 512) -> dict:
    """Top-1 accuracy and mean cross-entropy; each rank scores a share of the examples."""
    from torchmetrics import MeanMetric  # deferred: importing torchmetrics takes seconds
    from torchmetrics.classification import MulticlassAccuracy

    if indices is None:
        indices = torch.arange(len(dataset))
    if len(indices) == 0:
        return {}
    accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro").to(fabric.device)
    mean_loss = MeanMetric().to(fabric.device)
    was_training = model.training
    model.eval()
    share = torch.as_tensor(shard_for_rank(indices.tolist(), fabric.global_rank, fabric.world_size), dtype=torch.long)
    with fabric.strategy.precision.forward_context():
        for x, y in eval_batches(dataset, share, batch_size, fabric.device):
            logits = model(x).float()
            accuracy.update(logits, y)
            mean_loss.update(F.cross_entropy(logits, y, reduction="none"))
    model.train(was_training)
    return {"acc": accuracy.compute().item(), "loss": mean_loss.compute().item()}


def evaluate_levels(score: Callable[[int], dict], levels: Iterable[int], served: Sequence[int],
                    name: Callable[[int], str], mean_key: str) -> Dict[str, float]:
    """The per-level evaluation of a method that serves each client one of several models
    (HeteroFL tiers, ScaleFL levels, FEAST variants).

    ``score(k)`` scores level ``k`` (an :func:`evaluate` result); ``served`` is the level each
    client is served. Returns ``acc``, the population accuracy (the mean over clients of the
    accuracy of the level each is served: what selects checkpoints on validation), the mean
    over the scored levels under ``mean_key``, and ``<name(k)>_acc`` of every scored level;
    empty when the split is.
    """
    per_level = {k: score(k) for k in levels}
    if not all(per_level.values()):
        return {}
    population = sum(per_level[int(k)]["acc"] for k in served) / len(served)
    out = {"acc": population, mean_key: sum(m["acc"] for m in per_level.values()) / len(per_level)}
    out.update({f"{name(k)}_acc": m["acc"] for k, m in per_level.items()})
    return out
