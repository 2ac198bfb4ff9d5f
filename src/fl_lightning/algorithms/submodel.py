"""Sub-model federated learning: nested width slices per client, with five allocation policies.

Every policy here trains, for each client in a round's cohort, the leading ``p``-fraction of
every layer's channels (the classifier's input side included) and averages each coordinate
over exactly the clients that trained it (``dense = False``). The policies differ only in how
``p`` is chosen (``docs/submodel.md``):

- :class:`HeteroFL`: every client at its cap ``p_max`` (with ``assign: budget`` the cap is the
  largest of HeteroFL's tiers the client's MAC budget affords: FEAST's supernet baseline,
  ``docs/heterofl_supernet.md``).
- :class:`FjORD`: each round a tier drawn uniformly from the tiers no larger than the cap
  (``sample: step``: FjORD's own per-step draw inside the cap's sub-model).
- :class:`Uniform`: ``min(width, p_max)`` with ``width = 0.5``.
- :class:`RandomBudget`: random time-varying widths whose cohort average matches a target
  budget (a number, or the per-round ``p_bar`` trace of a saved run).
- :class:`HASFL`: heterogeneity-aware allocation from update divergence (Algorithm 1 of
  ``papers/hasfl-capacity-confounds-coverage.md``), with the coverage guarantee.

Caps are server state drawn once per seed (:func:`draw_caps`). The allocation for a round is
decided in ``plan`` from state that every rank holds (caps, last round's estimates), so every
rank computes the same plan. Monitoring (every round): the cohort's mean width ``p_bar``, the
fraction of each layer's coordinates that no client trained this round (``uncovered/<key>``)
and that no client has trained since initialisation (``never_trained/<key>``), and per client
its width, cap, parameters and MACs trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Literal, Optional, Sequence, Union

import numpy as np
import torch

from fl_lightning.algorithms.base import FedAvg, Weighting
from fl_lightning.algorithms.bn_protocol import Protocol, SbnData
from fl_lightning.data.budgets import seeded_rng
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CALIB_BATCH_SIZE
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, UnitFraction, number_type
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed, sample_clients

TIERS = (0.25, 0.5, 0.75, 1.0)
TIER_PROBS = (0.3, 0.3, 0.2, 0.2)
"""Default cap distribution: constrained devices are more common (expected cap 0.575; the
paper's realized mean over its seeds is about 0.56)."""

ALLOCATION = 17  # stream tag of allocation draws (FjORD tiers, Random-budget widths)
MIXING_STREAM = 18  # stream tag of HeteroFL's optional Mixup / CutMix draws


def draw_caps(num_clients: int, seed: int, tiers: Sequence[float] = TIERS,
              probs: Sequence[float] = TIER_PROBS) -> torch.Tensor:
    """Each client's capacity cap ``p_max``, drawn i.i.d. from ``tiers`` with ``probs``;
    a pure function of ``seed`` (every policy of a seed shares it). float64 [N]."""
    rng = seeded_rng(seed, "capacity_caps")
    p = np.asarray(probs, dtype=np.float64)
    idx = rng.choice(len(tiers), size=int(num_clients), p=p / p.sum())
    return torch.tensor([float(tiers[i]) for i in idx], dtype=torch.float64)


def allocation_rng(seed: int, round_idx: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, ALLOCATION, round_idx))


@dataclass(frozen=True)
class Width:
    """What the server chose for a sub-model client: its width this round (at most its cap)."""

    p: float


class SubmodelAlgorithm(FedAvg):
    """Shared machinery: caps, width specs per task, routing by leading-slice extraction,
    coordinate-wise aggregation, coverage and cost monitoring. Subclasses implement
    :meth:`widths_for` (the cohort's widths for a round)."""

    default_bn = "sbn"
    dense = False

    def __init__(self, tiers: List[UnitFraction] = list(TIERS), tier_probs: List[NonNegativeFloat] = list(TIER_PROBS),
                 caps: Optional[List[UnitFraction]] = None, log_layers: bool = True, bn: Optional[Protocol] = None,
                 sbn_data: SbnData = "train", calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train", weighting: Optional[Weighting] = None):
        """
        Args:
            tiers: capacity tiers (width ratios in (0, 1]) a client's cap is drawn from.
            tier_probs: probability of each tier (normalised); defaults favour small devices.
            caps: explicit per-client caps instead of a draw (length = number of clients).
            log_layers: log the per-layer coverage fractions (besides their totals).
            bn: where the served model gets its BN statistics (None: the policy's default, sbn
                except FjORD's per_width): sbn (static BN, HeteroFL's: clients track none, one pass over ``sbn_data`` through the served model before
                evaluation; the study's protocol for every policy), recalibrate (the server's
                calibration split), client (the pooled statistics of the batches the clients
                normalized in the round) or aggregated (the clients' running statistics,
                averaged across widths: for comparison only, docs/submodel.md).
            sbn_data: the sBN pass's data: train (the union of the client shards, as HeteroFL's
                code) or calib (the server's calibration split).
            calib_batch_size: batch size of the statistics pass (sbn and recalibrate).
            calib_transform: images of that pass through the training augmentation (train,
                drawn once from a fixed seed) or none (eval).
            weighting: a client's weight in each position's mean: samples (its examples, the
                study's rule; the default) or uniform (one per client, as HeteroFL's and
                FedRolex's code combine).
        """
        super().__init__(bn=bn, sbn_data=sbn_data, calib_batch_size=calib_batch_size,
                         calib_transform=calib_transform, weighting=weighting)
        self.tiers = [float(t) for t in tiers]
        self.tier_probs = [float(p) for p in tier_probs]
        self.caps_given = None if caps is None else [float(c) for c in caps]
        self.log_layers = log_layers

    def check(self, train) -> None:
        if not self.tiers:
            raise ConfigError("algorithm.tiers", "must list at least one width")
        if any(a >= b for a, b in zip(self.tiers, self.tiers[1:])):
            raise ConfigError("algorithm.tiers", f"must be distinct widths, smallest first, got {self.tiers}")
        if len(self.tier_probs) != len(self.tiers) or sum(self.tier_probs) <= 0:
            raise ConfigError("algorithm.tier_probs", f"must be {len(self.tiers)} non-negative numbers (one per "
                                                      f"tier) with a positive sum, got {self.tier_probs}")

    # -- set-up -----------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.global_state = ctx.model.state_dict()
        n = ctx.num_clients
        if self.caps_given is not None:
            if len(self.caps_given) != n:
                raise ConfigError("algorithm.caps", f"needs {n} caps (one per client), got {len(self.caps_given)}")
            self.caps = torch.tensor(self.caps_given, dtype=torch.float64)
        else:
            self.caps = draw_caps(n, ctx.seed, self.tiers, self.tier_probs)
        self.stages = len(ctx.model.max_spec().widths)
        self.param_keys = [k for k, _ in ctx.model.named_parameters()]
        # Coordinates trained by some client since initialisation (bool per parameter).
        self.ever = {k: torch.zeros(self.global_state[k].shape, dtype=torch.bool, device=self.global_state[k].device)
                     for k in self.param_keys}
        self.last_widths: Dict[int, float] = {}
        self._costs: Dict[object, tuple] = {}
        self._statistics = self.served_statistics(ctx)

    # -- the plan ---------------------------------------------------------------------------
    def widths_for(self, round_idx: int, cohort: List[int]) -> Dict[int, float]:
        """Each cohort client's width this round (at most its cap)."""
        raise NotImplementedError

    def plan(self, round_idx: int) -> RoundPlan:
        from fl_lightning.elastic.specs import WidthSpec

        ctx = self.ctx
        cohort = sample_clients(ctx.seed, round_idx, ctx.num_clients, ctx.clients_per_round)
        widths = self.widths_for(round_idx, cohort)
        tasks = []
        for c in cohort:
            p = min(float(widths[c]), float(self.caps[c]))
            tasks.append(ClientTask(c, spec=WidthSpec.uniform(p, self.stages), choice=Width(p)))
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def route(self, task, plan):
        return self.statistics.route(self.ctx.model.extract(task.spec))

    def cost(self, spec) -> tuple:
        """(parameters, forward MACs per example) of the sub-model ``spec``, memoized."""
        from fl_lightning.elastic.macs import count_macs, count_params

        model = self.ctx.model
        # Widths that round to the same channels are the same sub-model: count it once.
        key = model.stage_channels(spec) if hasattr(model, "stage_channels") else spec
        if key not in self._costs:
            local = model.extract(spec).module
            example = self.ctx.data.bundle.train[0][0]
            dtype = None if example.is_floating_point() else example.dtype  # token models take ids
            self._costs[key] = (count_params(local), count_macs(local, self.ctx.data.bundle.input_shape, dtype))
        return self._costs[key]

    def work(self, task) -> float:
        return super().work(task) * self.cost(task.spec)[1]

    def client_figures(self, task, result, plan):
        params, macs = self.cost(task.spec)
        return {"p": task.choice.p, "p_max": float(self.caps[task.client]), "params": params, "macs": macs}

    # -- the server step --------------------------------------------------------------------
    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = {"p_bar": float(np.mean([t.choice.p for t in plan.tasks]))}
        total = uncovered = never = 0
        for key in self.param_keys:
            covered = acc.counts(key) > 0
            self.ever[key] |= covered
            n = covered.numel()
            u, e = n - int(covered.sum()), n - int(self.ever[key].sum())
            total, uncovered, never = total + n, uncovered + u, never + e
            if self.log_layers:
                figures[f"uncovered/{key}"] = u / n
                figures[f"never_trained/{key}"] = e / n
        figures["uncovered/all"] = uncovered / total
        figures["never_trained/all"] = never / total
        for task in plan.tasks:
            self.last_widths[task.client] = task.choice.p
        figures.update(super().finish_round(acc, plan))
        return figures

    def artifacts(self) -> Dict[str, str]:
        return {"caps.json": json.dumps([float(c) for c in self.caps])}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        out = {"caps": self.caps.clone()}
        out.update({f"ever/{k}": v.to(torch.uint8) for k, v in self.ever.items()})
        return out

    def load_state_dict(self, state) -> None:
        self.caps = state["caps"].to(torch.float64).cpu()
        for k, v in self.ever.items():
            v.copy_(state[f"ever/{k}"].bool())


class HeteroFL(SubmodelAlgorithm):
    """HeteroFL (Diao et al., 2021) with coordinate-wise averaging: every client at its cap.

    The defaults are the sub-model study's (caps drawn per seed, the global model evaluated)
    with the authors' static batch norm (``bn: sbn``: clients track no statistics; the served
    model's come from one pass over the union of the client shards, as HeteroFL's ``stats``). FEAST's supernet baseline (``docs/heterofl_supernet.md``) sets
    ``assign: budget``: the cap is the largest of HeteroFL's five tiers that the client's MAC
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
        from fl_lightning.algorithms.heterofl_tiers import HETEROFL_TIERS

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

    def check(self, train) -> None:
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
        super().check(train)

    def setup(self, ctx) -> None:
        from fl_lightning.algorithms.heterofl_tiers import TierAssignment

        self.check(ctx.train)
        super().setup(ctx)
        self.tier_specs = [self.spec_of(t) for t in self.tiers]
        if self.assign == "budget":
            if ctx.budgets is None:
                raise ConfigError("partition.budgets", "assign budget needs client MAC budgets")
            self.assignment = TierAssignment.by_budget(ctx.model, self.tier_specs, self.tiers, ctx.budgets.tolist(),
                                                       tuple(ctx.data.bundle.input_shape))
            self.caps = self.assignment.widths()
            if ctx.fabric.is_global_zero and ctx.mode == "fit":
                print(self.assignment.describe())

    def spec_of(self, width: float):
        from fl_lightning.elastic.specs import WidthSpec

        return WidthSpec.uniform(width, self.stages)

    def widths_for(self, round_idx, cohort):
        return {c: float(self.caps[c]) for c in cohort}

    # -- one client -----------------------------------------------------------------------------
    def client_module(self, routed, task, plan):
        p = task.choice.p
        if self.scaler and p < 1:  # at rate 1 the Scaler is the identity: attach nothing
            from fl_lightning.elastic.layers.scaler import attach_scaler

            attach_scaler(routed.module, p)
        if self.mix_schedule == "none":
            return super().client_module(routed, task, plan)
        from fl_lightning.modules.mixing import client_mixer
        from fl_lightning.modules.single_architecture import SingleArchitectureClient

        t = self.ctx.train
        mixer = client_mixer(self.ctx.num_classes, self.mix_schedule, self.mixup_alpha, self.cutmix_alpha,
                             derive_seed(self.ctx.seed, MIXING_STREAM, plan.round_idx, task.client))
        return SingleArchitectureClient(routed.module, plan.lr, t.momentum, t.weight_decay,
                                        macs=self.cost(task.spec)[1], mixer=mixer)

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

    def state_dict(self) -> Dict[str, torch.Tensor]:
        out = super().state_dict()
        if self.assignment is not None:  # kept so a resumed or re-scored run serves the clients it trained
            out.update({f"tiers/{k}": v for k, v in self.assignment.state_dict().items()})
        return out

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        if self.assignment is not None:
            self.assignment.load_state_dict({k: state[f"tiers/{k}"] for k in ("assigned", "fallback")})


class Uniform(SubmodelAlgorithm):
    """Every client at ``min(width, p_max)`` (the paper's Uniform baseline, width 0.5)."""

    def __init__(self, width: UnitFraction = 0.5, **kwargs):
        """
        Args:
            width: the common width before capping.
        """
        super().__init__(**kwargs)
        self.width = float(width)

    def widths_for(self, round_idx, cohort):
        return {c: min(self.width, float(self.caps[c])) for c in cohort}


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

    default_bn = "per_width"

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
        super().__init__(bn=bn, **kwargs)
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
        if self.bn == "per_width" and task.choice.p < 1.0 - 1e-9 and result.update is not None:
            from fl_lightning.algorithms.bn_protocol import drop_statistics

            result.update = drop_statistics(result.update)
        super().commit(acc, task, result, plan)

    def client_module(self, routed, task, plan):
        from fl_lightning.elastic.specs import WidthSpec

        t = self.ctx.train
        if self.sample == "step":
            from fl_lightning.modules.submodel_distill import OrderedDropoutClient

            rng = np.random.default_rng(derive_seed(self.ctx.seed, ALLOCATION, plan.round_idx, task.client))
            return OrderedDropoutClient(routed.module, plan.lr, t.momentum, t.weight_decay, task.spec,
                                        self.allowed(task.client), self.stages, rng,
                                        self.distill_alpha if self.distill else None)
        if not self.distill:
            return super().client_module(routed, task, plan)
        from fl_lightning.modules.submodel_distill import OrderedDropoutDistillClient

        smallest = min(self.tiers)
        low = WidthSpec.uniform(min(smallest, task.choice.p), self.stages)
        return OrderedDropoutDistillClient(routed.module, plan.lr, t.momentum, t.weight_decay,
                                           task.spec, low, self.distill_weight)

    def client_figures(self, task, result, plan):
        figures = super().client_figures(task, result, plan)
        if self.sample == "step" and result.module is not None and result.module.drawn:
            figures["p_steps"] = float(np.mean(result.module.drawn))
        return figures


class RandomBudget(SubmodelAlgorithm):
    """Random time-varying widths whose cohort average matches a target budget.

    Each round every cohort client draws ``u ~ U(0, 1)``; widths are
    ``min(p_max, clip(p_lo + s u, p_lo, 1))`` with the scale ``s`` found by bisection so that
    the cohort mean equals the round's target (clipped to what the caps allow). The target is
    ``budget`` (a number), or the per-round ``p_bar`` of a saved run (``budget_from``: a run
    folder or its ``metrics.jsonl``; rounds past its end repeat its mean).
    """

    def __init__(self, budget: UnitFraction = 0.5, budget_from: Optional[str] = None, p_lo: UnitFraction = 0.0625,
                 **kwargs):
        """
        Args:
            budget: target average width of each round's cohort.
            budget_from: a saved run (folder or metrics.jsonl) whose per-round ``p_bar`` is the target trace.
            p_lo: smallest width drawn.
        """
        super().__init__(**kwargs)
        self.budget = float(budget)
        self.budget_from = budget_from
        self.p_lo = float(p_lo)
        self.trace: Optional[List[float]] = None

    def check(self, train):
        super().check(train)
        if self.budget_from is not None:
            self.trace = load_budget_trace(self.budget_from)

    def target(self, round_idx: int) -> float:
        if self.trace is None and self.budget_from is not None:
            self.trace = load_budget_trace(self.budget_from)
        if self.trace:
            return self.trace[round_idx] if round_idx < len(self.trace) else float(np.mean(self.trace))
        return self.budget

    def widths_for(self, round_idx, cohort):
        rng = allocation_rng(self.ctx.seed, round_idx)
        u = rng.random(len(cohort))
        caps = np.array([float(self.caps[c]) for c in cohort])
        widths = matched_widths(u, caps, self.target(round_idx), self.p_lo)
        return {c: float(w) for c, w in zip(cohort, widths)}


def matched_widths(u: np.ndarray, caps: np.ndarray, target: float, p_lo: float) -> np.ndarray:
    """``min(caps, clip(p_lo + s u, p_lo, 1))`` with ``s >= 0`` chosen so the mean is ``target``
    (or as near as the caps allow)."""
    lo_caps = np.minimum(caps, p_lo)

    def widths(s):
        return np.minimum(caps, np.clip(p_lo + s * u, p_lo, 1.0))

    if target <= widths(0.0).mean():
        return widths(0.0) if target >= lo_caps.mean() else lo_caps
    hi = 1.0
    while widths(hi).mean() < target and hi < 1e6:
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if widths(mid).mean() < target:
            lo = mid
        else:
            hi = mid
    return widths(hi)


def load_budget_trace(path: Union[str, Path]) -> List[float]:
    """Per-round ``p_bar`` of a saved run (its folder or its ``metrics.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError("algorithm.budget_from", f"no metrics file at {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trace = [float(r["p_bar"]) for r in sorted(rows, key=lambda r: r["round"]) if r.get("p_bar") is not None]
    if not trace:
        raise ConfigError("algorithm.budget_from", f"{path} has no p_bar column (not a sub-model run)")
    return trace


class HASFL(SubmodelAlgorithm):
    """HAS-FL (Algorithm 1): allocation by normalised update divergence, with coverage guarantee.

    - Estimate, for each client trained this round (parameters only):
      ``H_hat = ||m * (D_i - D_bar)||^2 / (||m * D_bar||^2 + eps)`` with ``D_i`` the client's
      update, ``D_bar`` the coordinate-wise aggregate's change, ``m`` the client's coordinates.
    - EMA ``H_tilde <- beta H_tilde + (1 - beta) H_hat`` for the clients trained,
      ``H_tilde(0) = 1``; every ``t_norm`` rounds all estimates are rescaled to unit mean.
      With ``ema: adapt`` (the paper's Algorithm 1, lines 20-31) the EMA takes only the
      estimates of the rounds that end an adaptation step; ``ema: round`` takes every round's.
    - Widths: ``p_max`` for the first ``t_warm`` rounds; then, recomputed every ``t_adapt``
      rounds, ``p = min(p_max, p_min + gamma H_tilde / (H_bar + eps))`` with ``H_bar`` the mean
      over all clients; with ``coverage``, clients whose cap is the federation's largest get it.

    An adaptation step ends the completed round ``done`` (1-based count) when
    ``done >= t_warm`` and ``(done - t_warm) % t_adapt == 0``; the new widths apply from the
    next round on.
    """

    def __init__(self, p_min: UnitFraction = 0.4, gamma: NonNegativeFloat = 0.25,
                 beta: number_type(float, ge=0, lt=1) = 0.9, t_warm: NonNegativeInt = 10,
                 t_adapt: PositiveInt = 5, t_norm: PositiveInt = 20, coverage: bool = True, eps: PositiveFloat = 1e-8,
                 ema: Literal["adapt", "round"] = "adapt", **kwargs):
        """
        Args:
            p_min: base width of the allocation rule.
            gamma: sensitivity to the relative heterogeneity estimate.
            beta: EMA factor of the estimates.
            t_warm: warm-up rounds at the caps.
            t_adapt: rounds between allocation updates after the warm-up.
            t_norm: rounds between rescalings of the estimates to unit mean.
            coverage: the coverage guarantee (clients with the largest cap train at it).
            eps: stabiliser of the ratios.
            ema: when the estimates enter the moving average: adapt (only in the rounds that
                end an adaptation step, after the warm-up: the paper's Algorithm 1, where the
                estimate and its EMA sit inside the every-t_adapt block) or round (every round,
                warm-up included: about t_adapt times more updates, so H_tilde follows recent
                rounds more closely and drifts further between rescalings).
        """
        super().__init__(**kwargs)
        self.p_min, self.gamma, self.beta = float(p_min), float(gamma), float(beta)
        self.t_warm, self.t_adapt, self.t_norm = int(t_warm), int(t_adapt), int(t_norm)
        self.coverage, self.eps, self.ema = bool(coverage), float(eps), ema

    def setup(self, ctx):
        super().setup(ctx)
        n = ctx.num_clients
        self.h_tilde = torch.ones(n, dtype=torch.float64)
        # Warm-up at the caps; without one, the rule applies from the first round (H_tilde = 1).
        self.widths = self.caps.clone() if self.t_warm > 0 else self.allocate()

    # -- allocation rule --------------------------------------------------------------------
    def allocate(self) -> torch.Tensor:
        return allocation_rule(self.h_tilde, self.caps, self.p_min, self.gamma, self.coverage, self.eps)

    def widths_for(self, round_idx, cohort):
        return {c: float(self.widths[c]) for c in cohort}

    def adapts_after(self, done: int) -> bool:
        """Whether the round that completes ``done`` rounds ends an adaptation step."""
        return done >= self.t_warm and (done - self.t_warm) % self.t_adapt == 0

    # -- estimation -------------------------------------------------------------------------
    def new_accumulator(self, plan):
        """Besides the model: each committed client's update on its own coordinates stays on
        its rank until the aggregate D_bar is known; then the owners' H_hat, one vector summed
        over ranks (a late sum), makes the estimates identical everywhere."""
        acc = super().new_accumulator(plan)
        acc.after_reduce(self.estimates)
        return acc

    def commit(self, acc, task, result, plan):
        super().commit(acc, task, result, plan)
        local = result.update.module.state_dict()
        delta = {}
        for local_key, (global_key, region) in result.update.regions.items():
            if global_key in self.ever:
                old = region.gather(self.global_state[global_key]).to(torch.float64)
                delta[global_key] = (local[local_key].detach().to(torch.float64) - old, region)
        acc.hold("delta", task.client, delta)

    def estimates(self, acc) -> Dict[str, torch.Tensor]:
        """H_hat of the clients this rank committed (zeros for the others), and which they are;
        the global state is still the round's old one."""
        h_hat = torch.zeros(self.ctx.num_clients, dtype=torch.float64)
        trained = torch.zeros(self.ctx.num_clients, dtype=torch.float64)
        new_state = acc.result()
        for client, delta in acc.held.get("delta", {}).items():
            h_hat[client] = update_divergence(delta, new_state, self.global_state, self.eps)
            trained[client] = 1.0
        device = self.ctx.fabric.device
        return {"h_hat": h_hat.to(device), "trained": trained.to(device)}

    def finish_round(self, acc, plan):
        h_hat, trained = acc["h_hat"].cpu(), acc["trained"].cpu() > 0
        figures = super().finish_round(acc, plan)
        done = plan.round_idx + 1  # rounds completed
        adapting = self.adapts_after(done)
        if adapting or self.ema == "round":
            self.h_tilde = torch.where(trained, self.beta * self.h_tilde + (1 - self.beta) * h_hat, self.h_tilde)
        if done % self.t_norm == 0:
            self.h_tilde = self.h_tilde / self.h_tilde.mean().clamp_min(self.eps)
        if adapting:
            self.widths = self.allocate()
        figures["H_bar"] = float(self.h_tilde.mean())
        for task in plan.tasks:
            c = task.client
            figures[f"H_hat/{c}"] = float(h_hat[c])
        for c in range(self.ctx.num_clients):
            figures[f"H_tilde/{c}"] = float(self.h_tilde[c])
            figures[f"p/{c}"] = float(self.widths[c])
        return figures

    def state_dict(self):
        out = super().state_dict()
        out.update({"h_tilde": self.h_tilde.clone(), "widths": self.widths.clone()})
        return out

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.h_tilde = state["h_tilde"].to(torch.float64).cpu()
        self.widths = state["widths"].to(torch.float64).cpu()


def allocation_rule(h_tilde: torch.Tensor, caps: torch.Tensor, p_min: float, gamma: float,
                    coverage: bool, eps: float = 1e-8) -> torch.Tensor:
    """Eq. (6) and the coverage guarantee: ``min(p_max, p_min + gamma H / (H_bar + eps))``;
    with ``coverage``, clients whose cap equals the largest cap get their cap."""
    h_tilde, caps = h_tilde.to(torch.float64), caps.to(torch.float64)
    p = torch.minimum(caps, p_min + gamma * h_tilde / (h_tilde.mean() + eps))
    if coverage:
        top = caps == caps.max()
        p = torch.where(top, caps, p)
    return p


def update_divergence(delta: Dict[str, tuple], new_state, old_state, eps: float = 1e-8) -> float:
    """``||m (D_i - D_bar)||^2 / (||m D_bar||^2 + eps)`` over the client's coordinates ``m``.

    ``delta`` maps global keys to (the client's update on its region, the region); the
    aggregate's change ``D_bar = new - old`` is read on the same region only.
    """
    num = den = 0.0
    for key, (d_i, region) in delta.items():
        d_bar = region.gather(new_state[key]).to(torch.float64) - region.gather(old_state[key]).to(torch.float64)
        num += float((d_i - d_bar).pow(2).sum())
        den += float(d_bar.pow(2).sum())
    return num / (den + eps)


__all__ = ["SubmodelAlgorithm", "HeteroFL", "FjORD", "Uniform", "RandomBudget", "HASFL", "draw_caps",
           "allocation_rule", "update_divergence", "matched_widths", "load_budget_trace", "TIERS", "TIER_PROBS"]
