"""Mixed-label batch augmentation (Mixup / CutMix through timm) and the soft-target loss.

A mixer maps a mini-batch ``(x, y)`` to ``(x_mixed, targets)``. With Mixup or CutMix the
targets are per-class probabilities ``lam * onehot(y_a) + (1 - lam) * onehot(y_b)``, so that
:func:`soft_cross_entropy` on them is exactly ``lam CE(z, y_a) + (1 - lam) CE(z, y_b)``
(FEAST Eq. 20). :class:`NoMix` passes the batch through with its class indices, which
:func:`soft_cross_entropy` also accepts (ablations, BN calibration, evaluation).

Randomness: timm draws ``lam`` and the CutMix box from NumPy's *global* generator. Each call
here runs timm under a NumPy state seeded from a torch generator (the mixer's own, or torch's
global generator, which the federation loop seeds per (seed, round, client)), then restores
NumPy's previous state, so mixing is reproducible per client and leaves NumPy untouched.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from timm.data import Mixup

SCHEDULES = ("random", "alternate", "mixup", "cutmix")
"""A baseline's ``mix_schedule`` choices: none (the original method) or one of the schedules."""


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum_c t_c log softmax(z)_c``.

    ``targets`` are per-class probabilities (same shape as ``logits``) or class indices (then
    this is plain cross-entropy). Computed in at least float32 so half-precision logits lose
    nothing (float64 stays float64).
    """
    logits = at_least_float32(logits)
    if not targets.is_floating_point():
        return F.cross_entropy(logits, targets)
    if targets.dtype != logits.dtype:
        targets = targets.to(logits.dtype)
    return -(targets * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` promoted to float32 if it is of lower precision; itself otherwise (no
    operation dispatched for a tensor that is float32 already)."""
    if tensor.dtype in (torch.float32, torch.float64):  # checked on the host: promote_types is an operator
        return tensor
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class NoMix:
    """The identity mixer: ``(x, y) -> (x, y)`` with class-index targets."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor, batch_idx: int = 0):
        return x, y


@contextlib.contextmanager
def _numpy_seeded(seed: int):
    """Run a block under NumPy's global generator seeded with ``seed``, then restore it."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


class AlternatingMixer:
    """Mixup and CutMix on whole mini-batches, one of the two per batch (timm ``Mixup``).

    Args:
        num_classes: width of the soft targets.
        mixup_alpha: Beta(a, a) parameter of Mixup (FEAST: 0.4).
        cutmix_alpha: Beta(a, a) parameter of CutMix (FEAST: 1.0).
        schedule: which of the two a batch gets:
            ``"random"`` (default): CutMix with probability 1/2, else Mixup, drawn per batch
            (timm's ``switch_prob=0.5``). This is what the ``alternating`` mode of the
            authors' DeepFedNAS code does, from which FEAST's training setup derives;
            ``"alternate"``: Mixup on even ``batch_idx``, CutMix on odd ones (deterministic);
            ``"mixup"`` / ``"cutmix"``: one of them only.
        generator: torch generator the per-batch NumPy seeds are drawn from; None draws them
            from torch's global generator.

    Every batch is mixed (timm ``prob=1``), in timm's ``batch`` mode (one ``lam`` per batch,
    example ``i`` paired with example ``n-1-i`` of the already shuffled batch), without label
    smoothing, and with CutMix's ``lam`` corrected to the clipped box area. The input is not
    modified in place.

    Odd batches: timm pairs examples two by two and refuses odd sizes. The first ``n - 1``
    examples are mixed and the last one is passed through with its one-hot target, so no
    example is dropped or duplicated and the batch size (hence the loss weighting and the MAC
    accounting) is unchanged. A batch of one is not mixed at all.
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.4, cutmix_alpha: float = 1.0,
                 schedule: str = "random", generator: Optional[torch.Generator] = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        needs_mixup = schedule in ("random", "alternate", "mixup")
        needs_cutmix = schedule in ("random", "alternate", "cutmix")
        if (needs_mixup and mixup_alpha <= 0) or (needs_cutmix and cutmix_alpha <= 0):
            raise ValueError(f"schedule {schedule!r} needs mixup_alpha > 0 and/or cutmix_alpha > 0 "
                             f"as it uses them, got {mixup_alpha}, {cutmix_alpha}")
        self.num_classes = int(num_classes)
        self.schedule = schedule
        self.generator = generator
        common = dict(prob=1.0, mode="batch", correct_lam=True, label_smoothing=0.0,
                      num_classes=self.num_classes)
        self._mixers = {
            "mixup": Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=0.0, **common) if needs_mixup else None,
            "cutmix": Mixup(mixup_alpha=0.0, cutmix_alpha=cutmix_alpha, **common) if needs_cutmix else None,
        }
        if schedule == "random":
            self._mixers["random"] = Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                                           switch_prob=0.5, **common)

    def kind(self, batch_idx: int) -> str:
        """Which timm mixer batch ``batch_idx`` goes through (``random`` decides inside)."""
        if self.schedule == "alternate":
            return "mixup" if batch_idx % 2 == 0 else "cutmix"
        return self.schedule

    def _seed(self) -> int:
        return int(torch.randint(2**31 - 1, (1,), generator=self.generator))

    def __call__(self, x: torch.Tensor, y: torch.Tensor, batch_idx: int = 0):
        """``(x_mixed, soft_targets)`` for one mini-batch; ``soft_targets`` is (n, classes)."""
        n = x.shape[0]
        even = n - n % 2
        seed = self._seed()  # drawn for every batch, so later batches do not depend on sizes
        targets = F.one_hot(y.long(), self.num_classes).to(torch.float32)
        if even == 0:
            return x, targets
        mixer = self._mixers[self.kind(batch_idx)]
        with _numpy_seeded(seed):
            # timm mixes in place: hand it a copy so the caller's batch stays intact.
            mixed, mixed_targets = mixer(x[:even].clone(), y[:even])
        if even == n:
            return mixed, mixed_targets.to(torch.float32)
        return (torch.cat([mixed, x[even:]]),
                torch.cat([mixed_targets.to(torch.float32), targets[even:]]))


def mixing_checks(schedule: str, mixup_alpha: float, cutmix_alpha: float) -> list:
    """``(key, ok, problem)`` checks that a baseline's ``mix_schedule`` has the Beta parameters it
    draws from."""
    return [
        ("mixup_alpha", mixup_alpha > 0 or schedule in ("none", "cutmix"), f"must be > 0 for mix_schedule {schedule}"),
        ("cutmix_alpha", cutmix_alpha > 0 or schedule in ("none", "mixup"), f"must be > 0 for mix_schedule {schedule}"),
    ]


def client_mixer(num_classes: int, schedule: str, mixup_alpha: float, cutmix_alpha: float,
                 seed: int) -> Optional[AlternatingMixer]:
    """One client's mixer for one round, its draws from ``seed`` (None with schedule none)."""
    if schedule == "none":
        return None
    return AlternatingMixer(num_classes, mixup_alpha, cutmix_alpha, schedule=schedule,
                            generator=torch.Generator().manual_seed(seed))
