"""FjORD (Horvath et al., 2021): a tier per round, or ordered dropout per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional

import numpy as np

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.submodel.base import ALLOCATION, SubmodelAlgorithm, allocation_rng
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat
from fl_lightning.runtime.seeding import derive_seed


@dataclass(frozen=True)
class FjORDSettings:
    """FjORD's options as a client reads them."""

    sample: str
    distill: bool
    distill_weight: float
    distill_alpha: float
    smallest: float
    """The smallest tier (the width ``sample: round`` distils into)."""
    stages: int


class FjORDClient(LocalClient):
    """A FjORD client: its tier for the round, or ordered dropout over ``allowed`` widths per
    step inside its cap's sub-model (its draws from the (seed, round, client) stream), with
    self-distillation when asked; with per-step widths it reports their mean (``p_steps``)."""

    def __init__(self, round: ClientRound, settings: FjORDSettings, allowed: List[float]):
        super().__init__(round)
        self.settings, self.allowed = settings, allowed

    def objective(self, downlink):
        from fl_lightning.elastic.specs import WidthSpec

        r, s, task = self.round, self.settings, self.task
        model, train = downlink.model.module, r.train
        if s.sample == "step":
            from fl_lightning.modules.submodel_distill import OrderedDropoutClient

            rng = np.random.default_rng(derive_seed(r.seed, ALLOCATION, r.round_idx, r.client))
            return OrderedDropoutClient(model, r.lr, train.momentum, train.weight_decay, task.spec, self.allowed,
                                        s.stages, rng, s.distill_alpha if s.distill else None)
        if not s.distill:
            return super().objective(downlink)
        from fl_lightning.modules.submodel_distill import OrderedDropoutDistillClient

        low = WidthSpec.uniform(min(s.smallest, task.choice.p), s.stages)
        return OrderedDropoutDistillClient(model, r.lr, train.momentum, train.weight_decay, task.spec, low,
                                           s.distill_weight)

    def uplink(self, downlink, module, fit):
        drawn = getattr(module, "drawn", None)
        figures = {"p_steps": float(np.mean(drawn))} if self.settings.sample == "step" and drawn else {}
        return self.result(downlink, fit, model=downlink.model, figures=figures)


class FjORD(SubmodelAlgorithm):
    """FjORD (Horvath et al., 2021), in one of two forms (``sample``):

    - ``round`` (default): as compared in the HAS-FL paper (Sec. 4.1): each round each client's
      tier is redrawn uniformly from the tiers no larger than its cap, and the client trains that
      width for its whole local update (and returns it). With ``distill`` the client also trains
      the smallest tier inside its local model and distils the local model's outputs into it (the
      project's adaptation of FjORD's self-distillation to one width per round; off by default,
      as in the paper's comparison).
    - ``step``: FjORD's own Algorithm 1: the client receives its ``p_max`` sub-model (its cap), at
      every local step draws ``p`` uniformly from the tiers no larger than its cap and trains
      the width-``p`` subnet of that model (ordered dropout), and returns the ``p_max`` sub-model,
      so each coordinate is averaged over the clients whose cap covers it. With ``distill``, each
      step also trains the ``p_max`` width on the labels and the width-``p`` subnet on
      ``(1 - distill_alpha) CE + distill_alpha KD`` against the ``p_max`` outputs (FjORD's
      self-distillation; ``distill_alpha = 1`` is the authors' Flower baseline).
    """

    def __init__(self, distill: bool = False, distill_weight: NonNegativeFloat = 1.0,
                 sample: Literal["round", "step"] = "round", distill_alpha: ClosedUnitInterval = 1.0,
                 bn: Optional[Literal["per_width", "sbn", "recalibrate", "client", "aggregated"]] = None, **kwargs):
        """
        Args:
            bn: where the served (full-width) model gets its BN statistics: per_width (the
                default when None; the Flower baseline by FjORD's authors: statistics are kept per width, so the served
                width's are averaged over the clients that trained at it, its cap with ``sample:
                step``; the others' are not sent), or one of the sub-model study's protocols
                (sbn, recalibrate, client, aggregated: ``SubmodelAlgorithm``).
            distill: add FjORD's self-distillation (elastic local model, in-place distillation).
            distill_weight: weight of the distillation term (``sample: round``).
            sample: when a client's width is drawn: round (once per round, the HAS-FL paper's
                FjORD) or step (at every local step inside the client's ``p_max`` model, FjORD's
                Algorithm 1).
            distill_alpha: with ``sample: step`` and ``distill``, the weight of the distillation
                term in the sampled width's loss (the label term gets ``1 - distill_alpha``).
        """
        super().__init__(bn=bn if bn is not None else "per_width", **kwargs)
        self.distill = distill
        self.distill_weight = float(distill_weight)
        self.sample = sample
        self.distill_alpha = float(distill_alpha)

    def allowed(self, client: int) -> List[float]:
        """The tiers a client may train: those no larger than its cap (the cap if none is)."""
        cap = float(self.caps[client])
        return [t for t in self.tiers if t <= cap + 1e-12] or [cap]

    def widths_for(self, round_idx, cohort):
        if self.sample == "step":  # the sub-model sent is the cap's; widths are drawn per step
            return {c: float(self.caps[c]) for c in cohort}
        rng = allocation_rng(self.ctx.seed, round_idx)
        out = {}
        for c in cohort:  # one draw per client, in cohort order: the same on every rank
            allowed = self.allowed(c)
            out[c] = float(allowed[int(rng.integers(len(allowed)))])
        return out

    def route(self, task, plan):
        return self.statistics.route(self.ctx.model.extract(task.spec, elastic=self.distill or self.sample == "step"))

    def commit(self, acc, task, result, plan):
        """Under ``per_width``, a client that did not train the served width keeps its BN
        statistics out of the aggregate (they describe another width)."""
        if self.bn == "per_width" and task.choice.p < 1.0 - 1e-9 and result.model is not None:
            from fl_lightning.algorithms.bn_protocol import drop_statistics

            model = drop_statistics(result.model)
            acc.add(model.module.state_dict(), self.weight(result), model.regions)
            return
        super().commit(acc, task, result, plan)

    def new_client(self, task, plan):
        settings = FjORDSettings(self.sample, self.distill, self.distill_weight, self.distill_alpha, min(self.tiers),
                                 self.stages)
        return FjORDClient(self.client_round(task, plan), settings, self.allowed(task.client))
