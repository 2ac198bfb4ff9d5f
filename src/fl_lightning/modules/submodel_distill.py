"""FjORD's clients (Horvath et al., 2021).

- :class:`OrderedDropoutDistillClient` (``sample: round``): the client's full local width learns
  from the labels, a smaller nested width inside the same local model learns from the labels and
  from the full width's detached predictions.
- :class:`OrderedDropoutClient` (``sample: step``): FjORD's Algorithm 1: a width drawn at every
  local step inside the client's ``p_max`` model, optionally with FjORD's self-distillation from
  the ``p_max`` width into the drawn one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import numpy as np
import torch.nn.functional as F

from fl_lightning.elastic.bn import batch_norms
from fl_lightning.elastic.specs import WidthSpec
from fl_lightning.modules.inplace_distillation import kd_loss, soft_targets
from fl_lightning.modules.supervised import SupervisedClient


@contextmanager
def statistics_of_own_width(model, active, own):
    """A pass at ``active`` inside a local model whose width is ``own``: below ``own``, batch
    norm normalizes with the batch's statistics but leaves the running statistics alone, so
    they stay those of the client's own width (FjORD's statistics per width, kept by its
    ``ODBatchNorm2d``); at ``own`` they update as usual."""
    norms = batch_norms(model) if active != own else []  # the tracking ones (none under static BN)
    for norm in norms:
        norm.track_running_stats = False
    try:
        yield
    finally:
        for norm in norms:
            norm.track_running_stats = True


class OrderedDropoutDistillClient(SupervisedClient):
    """``CE(full) + CE(low) + weight * KD(low || sg(full))`` with one backward per batch.

    ``model`` is an elastic local model (``extract(spec, elastic=True)``), ``high`` its largest
    spec and ``low`` a nested smaller one; the model is left at ``high`` after each step.
    """

    def __init__(self, model, lr, momentum, weight_decay, high, low, weight: float = 1.0):
        super().__init__(model, lr, momentum, weight_decay)
        self.high, self.low, self.weight = high, low, weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.model.set_active(self.high)
        full = self.model(x)
        loss = F.cross_entropy(full, y)
        if self.low != self.high:
            self.model.set_active(self.low)
            with statistics_of_own_width(self.model, self.low, self.high):
                small = self.model(x)
            loss = loss + F.cross_entropy(small, y) + self.weight * kd_loss(small, soft_targets(full))
            self.model.set_active(self.high)
        return loss


class OrderedDropoutClient(SupervisedClient):
    """One step per batch at a width drawn uniformly from ``widths`` (ordered dropout).

    ``model`` is the client's elastic ``p_max`` model (``extract(spec, elastic=True)``), ``high``
    its largest spec; each step draws ``p`` from ``widths`` with ``rng`` (recorded in
    :attr:`drawn`) and trains ``WidthSpec.uniform(p, stages)``, the leading ``ceil(p C)``
    channels of every stage. With ``alpha`` (self-distillation) the step's loss is
    ``CE(high) + (1 - alpha) CE(p) + alpha KD(p || sg(high))``, the drawn width's pass made even
    when it is ``high`` (as FjORD's code does; its distillation gradient is then zero). The
    model is left at ``high`` after each step.
    """

    def __init__(self, model, lr, momentum, weight_decay, high, widths: Sequence[float], stages: int,
                 rng: np.random.Generator, alpha: Optional[float] = None):
        super().__init__(model, lr, momentum, weight_decay)
        self.high, self.widths, self.stages = high, [float(w) for w in widths], stages
        self.rng, self.alpha = rng, alpha
        self.drawn: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        p = self.widths[int(self.rng.integers(len(self.widths)))]
        self.drawn.append(p)
        spec = WidthSpec.uniform(p, self.stages)
        loss = None
        if self.alpha is not None:
            self.model.set_active(self.high)
            full = self.model(x)
            loss = F.cross_entropy(full, y)
        self.model.set_active(spec)
        with statistics_of_own_width(self.model, spec, self.high):
            small = self.model(x)
        self.model.set_active(self.high)
        if self.alpha is None:
            return F.cross_entropy(small, y)
        if self.alpha > 0:
            loss = loss + self.alpha * kd_loss(small, soft_targets(full))
        if self.alpha < 1:
            loss = loss + (1.0 - self.alpha) * F.cross_entropy(small, y)
        return loss
