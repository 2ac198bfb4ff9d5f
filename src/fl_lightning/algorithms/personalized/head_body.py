"""The body/head split shared by FedBABU, FedGH and FedAS.

- :func:`find_classifier`: the model's final classifier (the "head" of FedBABU, the "header" of
  FedGH, the personalized part of FedAS), found generically: the last ``nn.Linear`` among the
  modules the model names in ``head_modules()``; a model that names none (the ViT, the LSTM)
  falls back to its last ``nn.Linear`` with ``num_classes`` outputs.
- :func:`forward_features`: the representation entering that classifier, read by a forward
  pre-hook, so it is pooled (and normalized) exactly as the model's own ``forward_head`` does.
- :func:`class_prototypes`: per-class mean representations of a client's shard.
- :func:`batch_statistics`: the model as local training runs it (batch norm on batch
  statistics) without touching its running statistics, for the methods' own passes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, List, Tuple

import torch
from torch import nn

from fl_lightning.elastic.bn import batch_statistics  # noqa: F401  (the head/body methods' BN mode)
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.client_data import eval_batches


def find_classifier(model: nn.Module) -> Tuple[str, nn.Linear]:
    """``(module name, module)`` of the model's final linear classifier."""
    try:
        heads = model.head_modules()
    except (NotImplementedError, AttributeError):
        heads = None
    if heads is not None:
        linears = [m for head in heads.values() for m in head.modules() if isinstance(m, nn.Linear)]
    else:
        classes = getattr(model, "num_classes", None)
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == classes]
    if not linears:
        raise ConfigError("model", f"{type(model).__name__} has no linear classifier to treat as the head")
    classifier = linears[-1]
    name = next(n for n, m in model.named_modules() if m is classifier)
    return name, classifier


def head_keys(model: nn.Module) -> List[str]:
    """State-dict keys of the classifier (its weight and bias)."""
    name, classifier = find_classifier(model)
    return [f"{name}.{key}" for key in classifier.state_dict()]


class FeatureTap:
    """Records the input of ``classifier`` during a forward pass (a context manager)."""

    def __init__(self, classifier: nn.Module):
        self.classifier = classifier
        self.value = None

    def __enter__(self) -> "FeatureTap":
        self.handle = self.classifier.register_forward_pre_hook(self._hook)
        return self

    def _hook(self, module, args) -> None:
        self.value = args[0]

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def forward_features(model: nn.Module, classifier: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(representation entering the classifier, logits)`` of one batch."""
    with FeatureTap(classifier) as tap:
        logits = model(x)
    return tap.value, logits



@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in evaluation mode (running statistics), its modes restored on exit."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


Batch = Tuple[torch.Tensor, torch.Tensor]


def without_single_rows(batches: Iterable[Batch]) -> Iterator[Batch]:
    """The batches, a one-row batch joined to the one before: batch norm on batch statistics
    needs two rows (a shard of one row stays one batch)."""
    held = None
    for x, y in batches:
        if held is not None and len(y) == 1:
            held = (torch.cat([held[0], x]), torch.cat([held[1], y]))
            continue
        if held is not None:
            yield held
        held = (x, y)
    if held is not None:
        yield held


@torch.no_grad()
def class_prototypes(model: nn.Module, classifier: nn.Module, dataset, indices: torch.Tensor, num_classes: int,
                     batch_size: int, device=None, batch_stats: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(means [C, D], counts [C])``: the exact per-class mean representation over the
    examples ``indices`` of ``dataset`` (float32, fixed order); classes absent from the shard
    have count 0 and a zero mean (never 0/0). Evaluation mode, or with ``batch_stats`` batch
    norm on each batch's statistics (:func:`batch_statistics`; a one-row last batch joins the
    one before)."""
    mode = batch_statistics if batch_stats else evaluation_mode
    sums, counts = None, torch.zeros(num_classes, dtype=torch.float64, device=device)
    with mode(model):
        for x, y in without_single_rows(eval_batches(dataset, indices, batch_size, device)):
            features, _ = forward_features(model, classifier, x)
            features = features.reshape(-1, features.shape[-1]).double()
            y = y.reshape(-1)
            if sums is None:
                sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=features.device)
            sums.index_add_(0, y, features)
            counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
    if sums is None:
        dim = classifier.in_features
        return torch.zeros(num_classes, dim, device=device), counts.float()
    means = sums / counts.clamp(min=1).unsqueeze(1)
    return means.float(), counts.float()
