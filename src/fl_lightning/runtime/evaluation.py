"""Evaluation, a phase of the round loop (and of ``fl_lightning evaluate``).

- :func:`evaluate`: accuracy and loss of one model on a dataset, shared across ranks by
  torchmetrics (the server-side scoring of a global model).
- :func:`evaluate_levels`: the per-level evaluation of methods that serve several models.
- :class:`ClientModels` and :func:`score_client_models`: client-side scoring, for methods whose
  clients keep models of their own (personalized methods): each client's model on that client's
  test shard, or on the whole split.
- :class:`EvaluationPhase`: one split's figures, server-side and client-side together.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.data.base import ArrayDataset
from fl_lightning.runtime.client_data import eval_batches
from fl_lightning.runtime.collectives import all_reduce_sum
from fl_lightning.runtime.seeding import shard_for_rank

KEEP_AT_MOST = 2 * 2**30
"""Bytes of one transformed split kept on a device; a larger split is transformed on every pass."""

_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""dataset -> {(device, indices): (inputs, targets)}: each split transformed once, for as long
as its dataset lives."""


def split_batches(dataset, indices: torch.Tensor, batch_size: int,
                  device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed-order batches of a split that is scored again and again (validation, test, the
    clients' test shards): transformed once, kept on ``device``, and then served as views, the
    same tensors ``eval_batches`` yields. An in-memory split without a transform on the CPU is
    indexed as before (nothing to keep); one over :data:`KEEP_AT_MOST` streams as before."""
    indices = torch.as_tensor(indices, dtype=torch.long)
    plain = isinstance(dataset, ArrayDataset) and dataset.transform is None
    if (plain and device.type == "cpu") or _split_bytes(dataset, len(indices)) > KEEP_AT_MOST:
        yield from eval_batches(dataset, indices, batch_size, device)
        return
    kept = _KEPT.setdefault(dataset, {})
    key = (str(device), indices.numpy().tobytes())
    if key not in kept:
        batches = list(eval_batches(dataset, indices, batch_size, device))
        kept[key] = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])) if batches else None
    if kept[key] is None:
        return
    inputs, targets = kept[key]
    for start in range(0, len(targets), batch_size):
        yield inputs[start:start + batch_size], targets[start:start + batch_size]


def _split_bytes(dataset, count: int) -> int:
    """Bytes of ``count`` transformed examples of ``dataset`` (float32 of the stored shape where
    the data is in memory; an image of 3 x 224 x 224 otherwise)."""
    stored = getattr(dataset, "data", None)
    per_example = stored[0].numel() if isinstance(stored, torch.Tensor) and len(stored) else 3 * 224 * 224
    return 4 * per_example * count


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
        for x, y in split_batches(dataset, share, batch_size, fabric.device):
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


@dataclass
class ClientModels:
    """The models clients serve themselves, as a method hands them to the evaluation phase.

    ``load(client)`` returns the module holding that client's model (it may reuse one module).
    ``prefix`` names the figures: "" makes them the method's ``acc``/``loss`` (the global model's
    move to ``global_acc``/``global_loss``); another prefix adds them beside the global model's.
    ``fingerprint``: figures already computed for the same split and fingerprint are reused
    (for models costly to make, such as FedBABU's fine-tuned ones); None: always scored.
    """

    clients: Sequence[int]
    load: Callable[[int], nn.Module]
    prefix: str = ""
    fingerprint: Optional[tuple] = None


@torch.no_grad()
def _sums(fabric, model: nn.Module, dataset, indices: torch.Tensor, batch_size: int) -> tuple:
    """``(correct, summed cross-entropy, examples)`` of ``model`` on ``indices``, on this rank alone."""
    was_training = model.training
    model.eval()
    # float64 sums on the device, read once: the float32 batch sums added as before, no wait per batch
    sums = torch.zeros(2, dtype=torch.float64, device=fabric.device)
    n = 0
    with fabric.strategy.precision.forward_context():
        for x, y in split_batches(dataset, indices, batch_size, fabric.device):
            logits = model(x).float()
            sums += torch.stack([(logits.argmax(1) == y).sum().double(),
                                 F.cross_entropy(logits, y, reduction="sum").double()])
            n += len(y)
    model.train(was_training)
    correct, loss = sums.tolist()
    return correct, loss, n


def score_client_models(fabric, models: ClientModels, dataset, shards: Callable[[int], torch.Tensor],
                        batch_size: int) -> Dict[str, float]:
    """Mean over clients of each client model's accuracy and mean loss on ``shards(client)``.

    Each rank scores a contiguous share of the clients (no torchmetrics collectives: ranks score
    different models); the sums cross ranks in one float64 all-reduce, so the figures do not
    depend on the rank count. A client with an empty shard is left out of the mean; ``clients``
    counts those scored.
    """
    acc_sum, loss_sum, scored = 0.0, 0.0, 0
    for client in shard_for_rank(list(models.clients), fabric.global_rank, fabric.world_size):
        indices = shards(client)
        if len(indices) == 0:
            continue
        correct, loss, n = _sums(fabric, models.load(client), dataset, indices, batch_size)
        acc_sum, loss_sum, scored = acc_sum + correct / n, loss_sum + loss / n, scored + 1
    as_tensor = lambda v: torch.tensor(float(v), dtype=torch.float64, device=fabric.device)  # noqa: E731
    sums = all_reduce_sum(fabric, {"acc": as_tensor(acc_sum), "loss": as_tensor(loss_sum), "n": as_tensor(scored)})
    count = int(sums["n"])
    if count == 0:
        return {}
    return {"acc": float(sums["acc"]) / count, "loss": float(sums["loss"]) / count, "clients": float(count)}


class EvaluationPhase:
    """One split's figures: the method's server-side evaluation (``algorithm.evaluate``) and, for
    a method that returns :class:`ClientModels` for the split, the clients' own models scored on
    their test shards (``client_test="own"``) or on the whole split (``"global"``)."""

    def __init__(self, fabric, algorithm, data, batch_size: int, client_test: str = "own"):
        self.fabric, self.algorithm, self.data = fabric, algorithm, data
        self.batch_size, self.client_test = batch_size, client_test
        self._reused: Dict[tuple, Dict[str, float]] = {}

    def __call__(self, split: str) -> Dict[str, float]:
        metrics = self.algorithm.evaluate(split, self.batch_size)
        models: Optional[ClientModels] = self.algorithm.client_models(split)
        if models is None:
            return metrics
        if not models.prefix:
            metrics = {**metrics, **{f"global_{k}": v for k, v in metrics.items()}}
        key = None if models.fingerprint is None else (split, self.client_test, models.fingerprint)
        if key is None or key not in self._reused:
            scores = self._score(split, models)
            if key is not None:
                self._reused = {key: scores}  # only the latest: the same model is rescored, not older ones
        else:
            scores = self._reused[key]
        return {**metrics, **{f"{models.prefix}{k}": v for k, v in scores.items()}}

    def _score(self, split: str, models: ClientModels) -> Dict[str, float]:
        if self.client_test == "own":
            dataset, shards = self.data.client_shards(split)
            return score_client_models(self.fabric, models, dataset, lambda c: shards[c], self.batch_size)
        dataset, indices = self.data.split(split)
        whole = torch.arange(len(dataset)) if indices is None else indices
        return score_client_models(self.fabric, models, dataset, lambda c: whole, self.batch_size)
