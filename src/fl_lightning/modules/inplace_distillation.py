"""In-place distillation over the operating points of one weight-shared network.

The sandwich rule of slimmable networks (Yu and Huang 2019; Yu et al. 2020): on every
mini-batch train the largest operating point on the labels, the smallest and some random
ones in between on the labels plus the largest one's detached predictions, accumulate the
gradients of all passes and take one optimizer step.

The pieces are independent of what an operating point is: an :class:`OperatingPoint` carries
an opaque ``key`` (an ``OFASpec``, a width multiplier, an exit index) and a per-example
``cost`` used for ordering and compute accounting, and :func:`sandwich_step` activates a point
through a callable. FEAST (``feast_client``) uses them with a client's affordable variants;
FjORD's distillation and ScaleFL's exit distillation can plug in their own points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from fl_lightning.modules.mixing import at_least_float32, soft_cross_entropy

TEACHER, SUPERVISED, STUDENT = "teacher", "supervised", "student"
ROLES = (TEACHER, SUPERVISED, STUDENT)


# ------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------

def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T``; the logits themselves at ``T = 1`` (no division dispatched)."""
    return logits / temperature if temperature != 1.0 else logits


def soft_targets(teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``softmax(sg(z) / T)``: the teacher's distribution, cut from the graph (FEAST Eq. 22),
    in at least float32 (half-precision logits are promoted; float64 ones stay float64)."""
    logits = at_least_float32(teacher_logits.detach())
    return torch.softmax(_tempered(logits, temperature), dim=-1)


def kd_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``-sum_c p_c log softmax(z / T)_c``, mean over the batch (FEAST Eq. 21 at ``T = 1``).

    For ``T != 1`` the loss is multiplied by ``T^2`` (Hinton et al.) so its gradient keeps
    the same scale as the supervised term's.
    """
    loss = soft_cross_entropy(_tempered(student_logits, temperature), teacher_probs)
    return loss * (temperature * temperature) if temperature != 1.0 else loss


def student_loss(sup: torch.Tensor, kd: torch.Tensor, rho: float) -> torch.Tensor:
    """``(1 - rho) L_sup + rho L_KD`` (FEAST Eq. 23)."""
    return (1.0 - rho) * sup + rho * kd


# ------------------------------------------------------------------------------------------
# Which operating points a mini-batch trains
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OperatingPoint:
    """One trainable configuration: ``key`` is what the activation callable understands,
    ``cost`` its per-example cost (MACs) used for ordering and accounting."""

    key: Any
    cost: float


@dataclass(frozen=True)
class Pass:
    """One forward/backward pass of a step.

    ``role``: ``teacher`` (supervised loss; its detached distribution supervises later
    students), ``supervised`` (supervised loss only) or ``student`` (supervised plus KD loss
    against the most recent teacher).
    """

    point: OperatingPoint
    role: str

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class SandwichPlan:
    """The operating points drawn for one mini-batch.

    ``largest`` is the teacher, ``smallest`` the lower endpoint; they are the same point in
    the degenerate one-point case. ``intermediates`` were drawn strictly between them in cost.
    """

    largest: OperatingPoint
    smallest: OperatingPoint
    intermediates: tuple[OperatingPoint, ...] = ()

    @property
    def degenerate(self) -> bool:
        return self.largest == self.smallest

    def passes(self, distill: bool = True) -> list[Pass]:
        """Largest first, then smallest, then the intermediates.

        With ``distill`` the smaller points are students of the largest; without, every point
        is trained on the labels alone. A degenerate plan is one supervised pass.
        """
        if self.degenerate:
            return [Pass(self.smallest, SUPERVISED)]
        below = [self.smallest, *self.intermediates]
        if not distill:
            return [Pass(p, SUPERVISED) for p in [self.largest, *below]]
        return [Pass(self.largest, TEACHER)] + [Pass(p, STUDENT) for p in below]


class SandwichSampler:
    """Draws a :class:`SandwichPlan` per mini-batch from an affordable set of points.

    Args:
        points: the operating points, in any order; they are sorted by cost (stably, so among
            equal costs the order given decides, and the *last* of the most expensive is the
            largest).
        smallest: key of the lower endpoint (FEAST: the cache-wide minimum ``a_min``, which
            every client can afford); default the cheapest point. No point may cost less.
        num_random: intermediates per mini-batch, each drawn uniformly (with replacement)
            from the points whose cost lies *strictly* between the endpoints' costs (FEAST
            Eqs. 18-19 with ``num_random=1``). When there are none, no intermediate is drawn.
    """

    def __init__(self, points: Sequence[OperatingPoint], smallest: Any = None, num_random: int = 1):
        points = sorted(points, key=lambda p: p.cost)
        if not points:
            raise ValueError("SandwichSampler needs at least one operating point")
        if num_random < 0:
            raise ValueError(f"num_random must be >= 0, got {num_random}")
        self.points = points
        self.largest = points[-1]
        if smallest is None:
            self.smallest = points[0]
        else:
            matches = [p for p in points if p.key == smallest]
            if not matches:
                raise ValueError(f"the smallest point {smallest!r} is not among the points")
            self.smallest = matches[0]
            if points[0].cost < self.smallest.cost:
                raise ValueError(f"{points[0].key!r} costs less than the smallest point {smallest!r}")
        lo, hi = self.smallest.cost, self.largest.cost
        self.pool = [p for p in points if lo < p.cost < hi]
        self.num_random = int(num_random)

    def sample(self, generator: Optional[torch.Generator] = None) -> SandwichPlan:
        """This mini-batch's plan; the generator is used only when intermediates are drawn."""
        if self.largest == self.smallest or not self.pool or self.num_random == 0:
            return SandwichPlan(self.largest, self.smallest)
        picks = torch.randint(len(self.pool), (self.num_random,), generator=generator).tolist()
        return SandwichPlan(self.largest, self.smallest, tuple(self.pool[i] for i in picks))


# ------------------------------------------------------------------------------------------
# Running the passes
# ------------------------------------------------------------------------------------------

@dataclass
class PassResult:
    point: OperatingPoint
    role: str
    loss: torch.Tensor  # detached


@dataclass
class StepResult:
    """What one step trained: ``loss`` is the detached sum of the pass losses (FEAST Eq. 24),
    ``cost`` is ``batch size x sum of the points' costs`` (one term of FEAST Eq. 26)."""

    loss: torch.Tensor
    passes: list[PassResult]
    batch_size: int
    cost: float


def check_passes(passes: Sequence[Pass]) -> None:
    """A student needs a teacher pass before it; there must be at least one pass."""
    if not passes:
        raise ValueError("a step needs at least one pass")
    seen_teacher = False
    for p in passes:
        if p.role == STUDENT and not seen_teacher:
            raise ValueError(f"student pass {p.point.key!r} comes before any teacher pass")
        seen_teacher |= p.role == TEACHER


def sandwich_step(passes: Sequence[Pass], x: torch.Tensor, targets: torch.Tensor,
                  activate: Callable[[Any], None], forward: Callable[[torch.Tensor], torch.Tensor],
                  backward: Callable[[torch.Tensor], None], rho: float = 0.5, temperature: float = 1.0,
                  sup_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = soft_cross_entropy,
                  ) -> StepResult:
    """Run ``passes`` in order on the same ``(x, targets)``, backpropagating each at once.

    For each pass: ``activate(point.key)``, ``logits = forward(x)``, the pass's loss, then
    ``backward(loss)`` (in a client module its own backward: through the kept slices, or
    ``manual_backward``, either with the precision plugin's loss scaling;
    ``torch.Tensor.backward`` elsewhere). Gradients therefore accumulate
    over the passes and each graph is freed before the next forward. The caller zeroes the
    gradients before and clips/steps after, once per mini-batch.

    The teacher's distribution is detached (:func:`soft_targets`), so no gradient of a
    student's KD term reaches the teacher's forward; the teacher is trained by its own
    supervised loss only. The active point is left at the last pass's; re-activate after.
    """
    check_passes(passes)
    teacher_probs: Optional[torch.Tensor] = None
    total = x.new_zeros((), dtype=torch.float32)
    results = []
    for p in passes:
        activate(p.point.key)
        logits = forward(x)
        loss = sup_loss(logits, targets)
        if p.role == STUDENT:
            loss = student_loss(loss, kd_loss(logits, teacher_probs, temperature), rho)
        elif p.role == TEACHER:
            teacher_probs = soft_targets(logits, temperature)
        backward(loss)
        loss = loss.detach()
        total = total + (loss if loss.dtype == total.dtype else loss.to(total.dtype))
        results.append(PassResult(p.point, p.role, loss))
    n = int(x.shape[0])
    return StepResult(total, results, n, n * sum(p.point.cost for p in passes))
