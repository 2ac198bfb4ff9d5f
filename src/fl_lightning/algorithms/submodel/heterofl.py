"""HeteroFL (Diao et al., 2021) as a sub-model policy, and as FEAST's supernet baseline
(``docs/heterofl_supernet.md``)."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional

from fl_lightning.algorithms.client import ClientRound
from fl_lightning.algorithms.mixing import Mixing
from fl_lightning.algorithms.submodel.base import MIXING_STREAM, TIER_PROBS, TIERS, SubmodelAlgorithm, SubmodelClient
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import NonNegativeFloat, UnitFraction
from fl_lightning.runtime.kept_state import KeptModule
from fl_lightning.runtime.seeding import derive_seed


class HeteroFLClient(SubmodelClient):
    """A HeteroFL client: its slice, the Scaler when asked, and Mixup / CutMix on its batches
    when a mixing schedule is set (its draws from the (seed, round, client) stream); ``macs``: its
    sub-model's forward MACs, for its figures."""

    def __init__(self, round: ClientRound, scaler: bool, mixing: Mixing, macs: float):
        super().__init__(round, scaler)
        self.mixing, self.macs = mixing, macs

    def objective(self, downlink):
        if self.mixing.schedule == "none":
            return super().objective(downlink)
        from fl_lightning.modules.single_architecture import SingleArchitectureClient

        r = self.round
        self.attach_scaler(downlink.model.module)
        mixer = self.mixing.mixer(r.num_classes, derive_seed(r.seed, MIXING_STREAM, r.round_idx, r.client))
        return SingleArchitectureClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay,
                                        macs=self.macs, mixer=mixer)


class HeteroFL(SubmodelAlgorithm):
    """HeteroFL (Diao et al., 2021) with coordinate-wise averaging: every client at its cap.

    The defaults are the sub-model study's (caps drawn per seed, the global model evaluated)
    with the authors' static batch norm (``bn: sbn``: clients track no statistics; the served
    model's come from one pass over the union of the client shards, as HeteroFL's ``stats``).
    FEAST's supernet baseline (``docs/heterofl_supernet.md``) sets ``assign: budget``: the cap is the largest of HeteroFL's five tiers that the client's MAC
    budget affords (the smallest as a counted fallback), and evaluation scores every tier and
    the population under largest-affordable serving. Either way ``bn`` chooses where evaluated
    models get their BN statistics, ``scaler`` adds HeteroFL's Scaler to client training and
    ``mix_schedule`` FEAST's Mixup / CutMix.
    """

    def __init__(self, assign: Literal["caps", "budget"] = "caps", tiers: Optional[List[UnitFraction]] = None,
                 tier_probs: Optional[List[NonNegativeFloat]] = None, scaler: bool = False,
                 mix_schedule: Literal["none", "alternate", "random", "mixup", "cutmix"] = "none",
                 mixup_alpha: NonNegativeFloat = 0.4, cutmix_alpha: NonNegativeFloat = 1.0, **kwargs):
        """
        Args:
            assign: caps (each client's cap drawn from ``tiers`` with ``tier_probs``, or
                ``caps``: the sub-model study) or budget (the largest tier whose served MACs fit
                the client's ``partition.budgets`` budget; the smallest tier when none does).
            tiers: width tiers; default (0.25, 0.5, 0.75, 1) with caps, HeteroFL's
                (1/16, 1/8, 1/4, 1/2, 1) with budget (distinct, smallest first).
            tier_probs: probability of each tier with caps; default favours small devices.
                Unused (and refused) with budget.
            scaler: HeteroFL's Scaler: a width-p client divides every conv output by p in
                training (identity at evaluation). Needs bn sbn or recalibrate.
            mix_schedule: Mixup / CutMix on client batches: none (HeteroFL), alternate
                (FEAST's protocol for every method), random, mixup or cutmix.
            mixup_alpha: Mixup's Beta parameter.
            cutmix_alpha: CutMix's Beta parameter.
        """
        from fl_lightning.algorithms.submodel.heterofl_tiers import HETEROFL_TIERS

        self.assign = assign
        self.tier_probs_given = tier_probs
        if tiers is None:
            tiers = HETEROFL_TIERS if assign == "budget" else TIERS
        if tier_probs is None:  # unused with budget: a placeholder the shared checks accept
            tier_probs = [1.0] * len(tiers) if assign == "budget" else TIER_PROBS
        super().__init__(tiers=tiers, tier_probs=tier_probs, **kwargs)
        self.scaler = scaler
        self.mix_schedule, self.mixup_alpha, self.cutmix_alpha = mix_schedule, mixup_alpha, cutmix_alpha
        self.assignment = None

    def check(self, train, population=None) -> None:
        from fl_lightning.modules.mixing import mixing_checks

        budget = self.assign == "budget"
        checks = [
            # tracked statistics would see conv outputs divided by p, evaluation undivided ones
            ("scaler", not (self.scaler and self.bn in ("aggregated", "client")),
             "needs bn sbn or recalibrate (tracked statistics would be of scaled activations)"),
            *mixing_checks(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha),
            ("tier_probs", not (budget and self.tier_probs_given is not None),
             "is unused with assign budget (tiers follow the MAC budgets); remove it"),
            ("caps", not (budget and self.caps_given is not None),
             "is unused with assign budget (tiers follow the MAC budgets); remove it"),
            ("tiers", not budget or all(a < b for a, b in zip(self.tiers, self.tiers[1:])),
             "must be distinct widths, smallest first, with assign budget"),
        ]
        given = {"tier_probs": self.tier_probs_given, "caps": self.caps_given}
        for key, ok, problem in checks:
            if not ok:
                raise ConfigError(f"algorithm.{key}", f"{problem}, got {given.get(key, getattr(self, key, None))!r}")
        super().check(train, population)

    def prepare(self, ctx) -> None:
        from fl_lightning.algorithms.submodel.heterofl_tiers import TierAssignment

        super().prepare(ctx)
        self.tier_specs = [self.spec_of(t) for t in self.tiers]
        if self.assign == "budget":
            if ctx.budgets is None:
                raise ConfigError("partition.budgets", "assign budget needs client MAC budgets")
            self.assignment = TierAssignment.by_budget(ctx.model, self.tier_specs, self.tiers, ctx.budgets.tolist(),
                                                       tuple(ctx.data.bundle.input_shape))
            self.caps = self.assignment.widths()
            # kept so that a resumed or re-scored run serves the clients it trained
            self.keep(KeptModule("tiers/", self.assignment))
            if ctx.fabric.is_global_zero and ctx.mode == "fit":
                print(self.assignment.describe())

    def spec_of(self, width: float):
        from fl_lightning.elastic.specs import WidthSpec

        return WidthSpec.uniform(width, self.stages)

    def widths_for(self, round_idx, cohort):
        return {c: float(self.caps[c]) for c in cohort}

    # -- one client -----------------------------------------------------------------------------
    def new_client(self, task, plan):
        return HeteroFLClient(self.client_round(task, plan), self.scaler,
                              Mixing(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha), self.cost(task.spec)[1])

    @property
    def served_names(self) -> Dict[str, str]:
        return self.assignment.served_names() if self.assignment is not None else super().served_names

    def client_figures(self, task, result, plan):
        figures = super().client_figures(task, result, plan)
        if self.assignment is not None:
            k = int(self.assignment.assigned[task.client])
            figures.update({"level": k + 1, "fallback": int(self.assignment.fallback[task.client])})
        return figures

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """The sub-model study's global model (caps), its BN statistics per ``bn``; with budget,
        every tier and the population under largest-affordable serving."""
        from fl_lightning.runtime.evaluation import evaluate, evaluate_levels

        if self.assignment is None:
            return super().evaluate(split, batch_size)
        data = self.ctx.data
        dataset, indices = data.split(split)
        models = self.statistics.models(self.tier_specs)
        out = evaluate_levels(lambda k: evaluate(self.ctx.fabric, models[k], dataset, indices, data.bundle.num_classes,
                                                 batch_size),
                              range(len(models)), self.assignment.assigned.tolist(), lambda k: f"level{k + 1}",
                              "mean_level_acc")
        if out:
            out["fallback_clients"] = float(self.assignment.fallback.sum())
        return out

    def report(self, summary: dict) -> str:
        from fl_lightning.algorithms.level_report import tier_report

        a = self.assignment
        if a is None:
            return super().report(summary)
        return tier_report(summary, a.tiers, a.macs, a.params, a.counts(), a.population(), self.bn)

    def artifacts(self) -> Dict[str, str]:
        out = super().artifacts()
        if self.assignment is not None:
            out["levels.json"] = self.assignment.to_json()
        return out
