"""Accuracy and loss of a model on a dataset, shared across ranks by torchmetrics."""

from __future__ import annotations

from typing import Optional

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
