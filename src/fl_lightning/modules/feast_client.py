"""FEAST's local multi-variant co-training (FEAST Sec. 3.4, Supp. D, Algorithm 2 lines 3-15).

On each mini-batch a client trains its local maximum ``a_max_i`` on the (mixed) labels, then
the global minimum ``a_min`` and one random intermediate of its affordable set as students of
``a_max_i``'s detached predictions, backpropagating each loss, and the federation loop clips
the accumulated gradient and takes one optimizer step. See ``docs/feast_client.md``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import Strategy
from torch import nn

from fl_lightning.elastic.layers.persistent_slices import PersistentSlices
from fl_lightning.modules.inplace_distillation import (SUPERVISED, OperatingPoint, Pass, SandwichPlan,
                                                       SandwichSampler, StepResult, check_passes,
                                                       sandwich_step)
from fl_lightning.modules.mixing import NoMix
from fl_lightning.modules.supervised import SupervisedClient


def _min_only(plan: SandwichPlan) -> list[Pass]:
    return [Pass(plan.smallest, SUPERVISED)]


def _max_only(plan: SandwichPlan) -> list[Pass]:
    return [Pass(plan.largest, SUPERVISED)]


def _endpoints(distill: bool) -> Callable[[SandwichPlan], list[Pass]]:
    def passes(plan: SandwichPlan) -> list[Pass]:
        return SandwichPlan(plan.largest, plan.smallest).passes(distill)
    return passes


def _full(plan: SandwichPlan) -> list[Pass]:
    return plan.passes(distill=True)


# Training rules of FEAST's component analysis (Table 2), as passes per mini-batch.
RULES: dict[str, Callable[[SandwichPlan], list[Pass]]] = {
    "min_only": _min_only,               # global minimum only, supervised
    "max_only": _max_only,               # local maximum only, supervised
    "min_max": _endpoints(distill=False),  # both endpoints, supervised, no KD
    "min_max_kd": _endpoints(distill=True),  # local maximum teaches the global minimum
    "full": _full,                       # ... plus one random intermediate (FEAST)
}


def _backward_is_autograd(fabric) -> bool:
    """Whether ``fabric.backward(loss)`` is autograd on the loss, scaled by a gradient scaler
    at most: the strategy's backward and the precision plugin's ``pre_backward``, ``backward``
    and ``post_backward`` are Fabric's own."""
    if fabric is None:
        return True
    precision = type(fabric.strategy.precision)
    return (type(fabric.strategy).backward is Strategy.backward
            and precision.pre_backward is Precision.pre_backward
            and precision.post_backward is Precision.post_backward
            and precision.backward in (Precision.backward, MixedPrecision.backward))


def _gradient_scaler(fabric):
    """The gradient scaler Fabric's backward multiplies the loss by (float16 mixed precision),
    or None."""
    precision = fabric.strategy.precision if fabric is not None else None
    if precision is not None and type(precision).backward is MixedPrecision.backward:
        return precision.scaler
    return None


class FeastClient(SupervisedClient):
    """A FEAST client on its routed reduced supernet.

    Args:
        model: the routed module (``route_envelope(global, A_i).module``); it must offer
            ``set_active(spec)`` for every spec of ``variants``.
        lr, momentum, weight_decay: SGD settings (``configure_optimizers``).
        variants: the affordable set ``A_i`` as ``(spec, MACs)`` pairs (or
            :class:`OperatingPoint`s keyed by spec); sorted here by MACs.
        global_min: ``a_min``, the cache-wide smallest variant (it must be in ``variants``
            and no variant may cost less); default the cheapest variant.
        rho_kd: KD weight of the students' loss (Eq. 23; FEAST 0.5).
        temperature: KD temperature (FEAST 1, i.e. no scaling).
        mixer: ``(x, y, batch_idx) -> (x_mixed, targets)``, e.g.
            :class:`~fl_lightning.modules.mixing.AlternatingMixer` (FEAST's setting); default
            no mixing.
        generator: draws the random intermediate of each mini-batch; the caller seeds it per
            (seed, round, client). None uses torch's global generator.
        rule: ``full`` (FEAST) or an ablation of Table 2: ``min_only``, ``max_only``,
            ``min_max``, ``min_max_kd`` (see :data:`RULES`).

    ``training_step`` backpropagates every pass itself (``automatic_optimization = False``)
    and returns the detached sum of the pass losses; after it the model's active variant is
    the local maximum. :meth:`forward_macs` is the round's ``C_fwd`` (Eq. 26).
    """

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, *,
                 variants: Sequence[Any], global_min: Any = None, rho_kd: float = 0.5,
                 temperature: float = 1.0, mixer: Optional[Callable] = None,
                 generator: Optional[torch.Generator] = None, rule: str = "full"):
        super().__init__(model, lr, momentum, weight_decay)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {sorted(RULES)}, got {rule!r}")
        if not 0.0 <= rho_kd <= 1.0:
            raise ValueError(f"rho_kd must be in [0, 1], got {rho_kd}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.automatic_optimization = False
        check = getattr(model, "check_spec", lambda spec: spec)
        points = [self._point(v, check) for v in variants]
        if global_min is not None:
            global_min = check(global_min)
        # Only the full rule draws intermediates, so ablations leave the generator unused.
        self.sampler = SandwichSampler(points, smallest=global_min, num_random=1 if rule == "full" else 0)
        self.rule = rule
        self.rho_kd = float(rho_kd)
        self.temperature = float(temperature)
        self.mixer = mixer if mixer is not None else NoMix()
        self.generator = generator
        self.schedule: list[Tuple[int, tuple]] = []  # (batch size, trained specs) per step
        self.last_step: Optional[StepResult] = None
        self._forward_macs = 0
        self._slices: Optional[PersistentSlices] = None
        self._scaler = None  # Fabric's gradient scaler while slices are kept (float16)

    @staticmethod
    def _point(variant: Any, check: Callable) -> OperatingPoint:
        if isinstance(variant, OperatingPoint):
            return OperatingPoint(check(variant.key), variant.cost)
        spec, macs = variant
        return OperatingPoint(check(spec), macs)

    # -- the plan of one mini-batch ----------------------------------------------------------
    @property
    def largest(self) -> Any:
        """``a_max_i``: the most expensive affordable variant."""
        return self.sampler.largest.key

    @property
    def smallest(self) -> Any:
        """``a_min``: the global minimum."""
        return self.sampler.smallest.key

    @property
    def intermediates(self) -> list:
        """``A_int_i``: variants strictly between the endpoints in MACs (Eq. 18)."""
        return [p.key for p in self.sampler.pool]

    def plan_passes(self) -> list[Pass]:
        """This mini-batch's passes under the rule (draws the intermediate, if any)."""
        passes = RULES[self.rule](self.sampler.sample(self.generator))
        check_passes(passes)
        return passes

    # -- training ----------------------------------------------------------------------------
    def _backward(self, loss: torch.Tensor) -> None:
        if self._slices is not None:  # kept slices: the loss as Fabric's backward would take it
            self._slices.backward(self._scaled(loss))
        elif self._fabric is not None or self._trainer is not None:  # Fabric's or a Trainer's backward
            self.manual_backward(loss)
        else:  # the module on its own
            loss.backward()

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times Fabric's gradient scaler where float16 training keeps one (Fabric's
        optimizer step unscales)."""
        return self._scaler.scale(loss) if self._scaler is not None else loss

    # Local training keeps the passes' weight slices as leaves across steps and backpropagates
    # each pass through them (elastic/layers/persistent_slices.py): the gradients are zeroed in
    # place, not dropped. Where the backward is more than autograd on the (scaled) loss (a
    # Trainer's hooks, a strategy or precision plugin of its own), it slices afresh.
    def on_train_start(self) -> None:
        if self._trainer is None and _backward_is_autograd(self._fabric):
            self._slices = PersistentSlices(self.model)
            self._scaler = _gradient_scaler(self._fabric)

    def on_train_end(self) -> None:
        if self._slices is not None:
            self._slices.close()
            self._slices = None
            self._scaler = None

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        optimizer.zero_grad(set_to_none=self._slices is None)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x, targets = self.mixer(x, y, batch_idx)  # one mixed batch for every pass (Supp. D)
        passes = self.plan_passes()
        step = self._slices.step() if self._slices is not None else contextlib.nullcontext()
        try:
            with step:
                result = sandwich_step(passes, x, targets, activate=self.model.set_active, forward=self.model,
                                       backward=self._backward, rho=self.rho_kd, temperature=self.temperature)
        finally:
            self.model.set_active(self.largest)
        self.last_step = result
        self.schedule.append((result.batch_size, tuple(p.point.key for p in passes)))
        self._forward_macs += result.cost
        return result.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD over every parameter in one multi-tensor update (``foreach``): a few operations
        per step instead of four per parameter; the same arithmetic, tensor by tensor (on a GPU
        it is SGD's default already)."""
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay, foreach=True)

    def trained_variants(self) -> set:
        """The variants some step trained (their positions are the trained mass, FEAST's
        ``_count_mass``)."""
        return {spec for _, specs in self.schedule for spec in specs}

    # -- compute accounting (Supp. D, Eq. 26) -----------------------------------------------
    def forward_macs(self):
        """``C_fwd``: sum over this module's mini-batches of batch size x the MACs of every
        variant trained on it. The forward-plus-backward proxy is ``3 x`` this (kappa_fb)."""
        return self._forward_macs
