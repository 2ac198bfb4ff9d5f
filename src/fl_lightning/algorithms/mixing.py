"""Mixup / CutMix on a client's batches as a method's option, the part several methods compose
(HeteroFL and FIARSE as FEAST trains its baselines, ``modules/mixing.py`` does the mixing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mixing:
    """What a client reads of the method's mixing options: the ``schedule`` (none, alternate,
    random, mixup, cutmix) and each Beta parameter."""

    schedule: str = "none"
    mixup_alpha: float = 0.4
    cutmix_alpha: float = 1.0

    def mixer(self, num_classes: int, seed: int):
        """The client's mixer for one round, its draws from ``seed`` (None with schedule none)."""
        from fl_lightning.modules.mixing import client_mixer

        return client_mixer(num_classes, self.schedule, self.mixup_alpha, self.cutmix_alpha, seed)
