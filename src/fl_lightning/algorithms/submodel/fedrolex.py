"""FedRolex (Alam et al., NeurIPS 2022): HeteroFL's capped widths over a window that rolls.

Every client trains at its cap ``p_max`` (the sub-model study's caps, as :class:`HeteroFL`),
but instead of the leading ``ceil(p C)`` channels of a layer with ``C`` channels it trains the
window ``(start + j) mod C``, ``j < ceil(p C)``, and the server moves the window by one channel
each round (``docs/fedrolex.md``). As the authors' ``ResnetServerRoll.split_model``
(``resnet_server.py``, lines 99-111): the start in round ``r`` (counted from 0) is
``(-r) mod C`` (``torch.roll(arange(C), r)[:n]``), with one round counter for every layer,
reduced modulo each layer's own channel count, so a layer's output window is the next layer's
input window; the classifier keeps every class and rolls its input side only. Aggregation is
coordinate-wise over the clients that trained each position (``dense = False``).
"""

from __future__ import annotations

from typing import Dict

from fl_lightning.algorithms.submodel.base import SubmodelAlgorithm, SubmodelClient
from fl_lightning.errors import ConfigError


class FedRolex(SubmodelAlgorithm):
    """FedRolex: every client at its cap, on a rolling window of every layer's channels.

    Served statistics by ``bn`` (default sbn: HeteroFL's static BN, which the authors' code keeps
    in training; their evaluation normalizes each test batch by its own statistics, which no
    protocol here does, ``docs/fedrolex.md``). Models whose regions have no rolling form (the
    Shakespeare ``CharLSTM``) are refused under ``model``.
    """

    def __init__(self, scaler: bool = False, **kwargs):
        """
        Args:
            scaler: HeteroFL's Scaler (the authors' runs set it): a width-p client divides
                every conv output by p in training. Needs bn sbn or recalibrate.
            **kwargs: ``SubmodelAlgorithm``'s options (tiers, tier_probs, caps, bn, weighting:
                samples by default, uniform for the paper's selective averaging and the
                authors' plain mean, ...).
        """
        super().__init__(**kwargs)
        self.scaler = scaler

    def check(self, train, population=None) -> None:
        if self.scaler and self.bn in ("aggregated", "client"):
            # tracked statistics would see conv outputs divided by p, evaluation undivided ones
            raise ConfigError("algorithm.scaler", f"needs bn sbn or recalibrate (tracked statistics would be of "
                                                  f"scaled activations), got bn {self.bn}")
        super().check(train, population)

    def prepare(self, ctx) -> None:
        super().prepare(ctx)
        model = ctx.model
        for cap in sorted(set(self.caps.tolist())):  # every width a client will hold
            try:
                model.regions(self.spec_of(cap), kind="rolling", offset=1)
            except ValueError as error:
                raise ConfigError("model", f"FedRolex needs rolling width windows, which {type(model).__name__} "
                                           f"does not have ({error})") from None

    def spec_of(self, width: float):
        from fl_lightning.elastic.specs import WidthSpec

        return WidthSpec.uniform(width, self.stages)

    # -- the plan ---------------------------------------------------------------------------
    def widths_for(self, round_idx, cohort) -> Dict[int, float]:
        return {c: float(self.caps[c]) for c in cohort}

    @staticmethod
    def window_offset(round_idx: int) -> int:
        """The window's start in round ``round_idx`` before reduction modulo each layer's
        channels: the authors' ``torch.roll`` by the round count moves it back one channel a round."""
        return -int(round_idx)

    def route(self, task, plan):
        offset = self.window_offset(plan.round_idx)
        return self.statistics.route(self.ctx.model.extract(task.spec, kind="rolling", offset=offset))

    # -- one client -------------------------------------------------------------------------
    def new_client(self, task, plan):
        return SubmodelClient(self.client_round(task, plan), self.scaler)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)
        figures["window_offset"] = float(self.window_offset(plan.round_idx))
        return figures


__all__ = ["FedRolex"]
