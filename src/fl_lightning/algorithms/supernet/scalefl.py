"""ScaleFL (Ilhan, Su and Liu, CVPR 2023): depth-width levels with early exits and self-distillation.

As the FEAST paper adapts it to its common ResNet-18 substrate (Supp. E.1):

- Levels: four operating points ``(blocks, width)`` = (3, 0.40), (4, 0.50), (5, 0.60),
  (8, 1.00) of a ``scalefl_resnet18`` (``elastic/models/scalefl_resnet.py``), each ending in an
  exit classifier; a level-k client model holds the blocks and exits of levels 1..k.
- Assignment: each client trains and is served the largest level whose served MACs (fvcore, the
  extracted model with its single final exit) fit its budget; a client that affords no level
  trains and is served level 1 (the minimum-tier fallback, counted in the report).
- Client training (``modules/scalefl_client.py``): cross-entropy at every exit of the client's
  model plus early-exit self-distillation from its deepest exit to the shallower ones, with the
  weights, temperature and schedule of ScaleFL's code.
- Aggregation: each client returns only its level's slices; every position is the
  sample-weighted mean over the clients that trained it (as ``submodel.py``).
- Evaluation: every level on its own, with BN recalibrated per level on the server's calibration
  split exactly as FEAST's evaluation does, and the population accuracy under largest-affordable
  serving with the fallback.

``docs/scalefl.md`` lists every default with its source and what departs from the original.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Literal, Tuple

import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.mixing import Mixing
from fl_lightning.algorithms.levels import LevelAssignment
from fl_lightning.algorithms.level_report import scalefl_report
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt, UnitFraction
from fl_lightning.runtime.calibration import ServerCalibration
from fl_lightning.runtime.evaluation import evaluate, evaluate_levels
from fl_lightning.runtime.kept_state import KeptModule, KeptRecord
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed

MIXING_STREAM = 33  # seed stream of ScaleFL's optional Mixup / CutMix draws


@dataclass(frozen=True)
class Distillation:
    """ScaleFL's self-distillation over its exits, as a client reads it (``kd_active``: this
    round's)."""

    gamma: float
    temperature: float
    kd_active: bool
    weights: str
    """How the exits' losses weigh (``modules/scalefl_client.py``: depth or sum)."""
    reduction: str
    detach_teacher: bool


class ExitsClient(LocalClient):
    """A ScaleFL client: its level's early-exit model trained on every exit's loss with
    self-distillation, and Mixup / CutMix when asked."""

    def __init__(self, round: ClientRound, distillation: Distillation, mixing: Mixing):
        super().__init__(round)
        self.distillation, self.mixing = distillation, mixing

    def objective(self, downlink):
        from fl_lightning.modules.scalefl_client import ScaleFLClient

        r, d = self.round, self.distillation
        mixer = self.mixing.mixer(r.num_classes, derive_seed(r.seed, MIXING_STREAM, r.round_idx, r.client))
        return ScaleFLClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay, gamma=d.gamma,
                             temperature=d.temperature, kd_active=d.kd_active, weights=d.weights,
                             reduction=d.reduction, detach_teacher=d.detach_teacher, mixer=mixer)

LEVELS = ((3, 0.40), (4, 0.50), (5, 0.60), (8, 1.00))
"""ScaleFL's four (blocks, width) levels on ResNet-18 (FEAST Supp. E.1)."""

ExitWeights = Literal["depth", "sum"]
KLReduction = Literal["elementwise", "batchmean"]


@dataclass(frozen=True)
class Level:
    """What the server chose for a ScaleFL client: its level (1-based) and whether its budget fell short of
    the smallest level (it then trains that one)."""

    level: int
    fallback: bool


class ScaleFL(FedAvg):
    """ScaleFL: largest-affordable depth-width levels, multi-exit training with early-exit
    self-distillation, position-wise sample-weighted aggregation."""


    def __init__(self, levels: List[Tuple[PositiveInt, UnitFraction]] = [list(level) for level in LEVELS],
                 kd_gamma: NonNegativeFloat = 0.05, kd_temperature: PositiveFloat = 3.0,
                 kd_start: ClosedUnitInterval = 0.25, exit_weights: ExitWeights = "depth",
                 kl_reduction: KLReduction = "elementwise", detach_teacher: bool = False,
                 recalibrate: bool = True, calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train",
                 mix_schedule: Literal["none", "alternate", "random", "mixup", "cutmix"] = "none",
                 mixup_alpha: NonNegativeFloat = 0.4, cutmix_alpha: NonNegativeFloat = 1.0):
        """
        Args:
            levels: the levels as [blocks, width] pairs, smallest first: the first ``blocks``
                BasicBlocks at width ratio ``width`` and the exit after them (the model must have
                a classifier there: ``model.exit_blocks``). Default ScaleFL's four,
                (3, 0.40), (4, 0.50), (5, 0.60), (8, 1.00) (FEAST Supp. E.1).
            kd_gamma: weight gamma of the self-distillation term (ScaleFL's ``--KD_gamma``; its
                code's default 0 disables it, 0.05 is the value its published commands use).
            kd_temperature: distillation temperature T; the term is scaled by T^2 (ScaleFL's
                ``--KD_T`` default 3).
            kd_start: fraction of the rounds before self-distillation starts: it is on in round
                t (0-based) when t >= kd_start * rounds (ScaleFL: after the first quarter).
            exit_weights: depth (exit j of k weighs j / (k(k+1)/2), ScaleFL's code) or sum
                (every exit weighs 1).
            kl_reduction: elementwise (the KL averaged over batch and classes, PyTorch's
                ``nn.KLDivLoss()`` default that ScaleFL uses) or batchmean (averaged over the batch).
            detach_teacher: stop the distillation gradient at the deepest exit (ScaleFL does not).
            recalibrate: re-estimate each level's BN statistics on the server's calibration split
                before evaluating it (FEAST's protocol); false uses the aggregated statistics.
            calib_batch_size: batch size of BN recalibration.
            calib_transform: image transform of the calibration images: train (the training
                augmentation, drawn once with FEAST's calibration seed) or eval (none).
            mix_schedule: Mixup / CutMix on client batches: none (ScaleFL), alternate (FEAST's
                protocol for every method, Supp. E.1), random, mixup or cutmix. Every exit's
                cross-entropy then takes the mixed soft targets.
            mixup_alpha: Mixup's Beta parameter.
            cutmix_alpha: CutMix's Beta parameter.
        """
        super().__init__()
        self.dense = False  # position-wise means over the clients that hold each position
        self.levels = [list(level) for level in levels]
        self.kd_gamma, self.kd_temperature, self.kd_start = kd_gamma, kd_temperature, kd_start
        self.exit_weights, self.kl_reduction, self.detach_teacher = exit_weights, kl_reduction, detach_teacher
        self.recalibrate, self.calib_batch_size, self.calib_transform = recalibrate, calib_batch_size, calib_transform
        self.mix_schedule, self.mixup_alpha, self.cutmix_alpha = mix_schedule, mixup_alpha, cutmix_alpha

    # -- options --------------------------------------------------------------------------------
    def check(self, train, population=None) -> None:
        from fl_lightning.modules.mixing import mixing_checks

        if not self.levels:
            raise ConfigError("algorithm.levels", "needs at least one level")
        pairs = [(int(b), float(w)) for b, w in self.levels]
        if any(not (b1 <= b2 and w1 <= w2 and (b1, w1) != (b2, w2)) for (b1, w1), (b2, w2) in zip(pairs, pairs[1:])):
            raise ConfigError("algorithm.levels", f"must be nested and distinct, smallest first (blocks and width "
                                                  f"non-decreasing), got {self.levels}")
        for key, ok, problem in mixing_checks(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha):
            if not ok:
                raise ConfigError(f"algorithm.{key}", f"{problem}, got {getattr(self, key)!r}")

    # -- set-up ---------------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        from fl_lightning.elastic.macs import spec_macs
        from fl_lightning.elastic.models.scalefl_resnet import DepthWidthSpec, exit_costs

        model = ctx.model
        if getattr(model, "spec_type", None) is not DepthWidthSpec or not hasattr(model, "forward_exits"):
            raise ConfigError("model", "ScaleFL trains a ScaleFLResNet18 (a depth-width model with exits)")
        if ctx.budgets is None:
            raise ConfigError("partition.budgets", "ScaleFL assigns levels by client MAC budgets")
        # BN recalibration exactly as FEAST's evaluation: the same calibration images, order and
        # augmentation draw, and the same reset-and-average estimate per extracted operating point
        self.calibration = ServerCalibration(
            ctx, self.calib_batch_size, self.calib_transform, otherwise="algorithm.recalibrate: false",
            required_by="ScaleFL recalibrates BN per level" if self.recalibrate else None)
        self.specs = [DepthWidthSpec(int(b), float(w)) for b, w in self.levels]
        for i, spec in enumerate(self.specs):
            if spec.depth not in model.classifier_depths():
                raise ConfigError(f"algorithm.levels[{i}]",
                                  f"level {i + 1} ends after block {spec.depth}, where the model has no exit "
                                  f"(classifiers follow blocks {model.classifier_depths()}; "
                                  f"see model.exit_blocks)")
        self.input_shape = tuple(ctx.data.bundle.input_shape)
        self.costs = [exit_costs(model, spec, self.input_shape) for spec in self.specs]
        self.level_macs = [spec_macs(model, spec, self.input_shape) for spec in self.specs]  # served, memoized
        self.assignment = LevelAssignment.by_budget(self.level_macs, ctx.budgets.tolist(),
                                                    lambda k: (f"algorithm.levels[{k}]", f"level {k + 1}"))
        # the assignment, and the levels' MACs it was made with
        self.keep(KeptModule("", self.assignment))
        self.keep(KeptRecord("level_macs", lambda: torch.tensor([float(m) for m in self.level_macs],
                                                                dtype=torch.float64)))
        if ctx.fabric.is_global_zero and ctx.mode == "fit":
            print(self.describe_population())

    def describe_population(self) -> str:
        a = self.assignment
        lines = [f"ScaleFL: {len(self.specs)} levels, {int(a.fallback.sum())} of {len(a.assigned)} clients "
                 f"afford no level and fall back to level 1"]
        for k, (spec, cost, n) in enumerate(zip(self.specs, self.costs, a.counts())):
            lines.append(f"  level {k + 1} ({spec}): {self.level_macs[k] / 1e6:.2f}M MACs served, "
                         f"{cost['train_macs'] / 1e6:.2f}M with all exits, {cost['params'] / 1e6:.3f}M params routed, "
                         f"{n} clients")
        return "\n".join(lines)

    def artifacts(self) -> Dict[str, str]:
        levels = [{"level": k + 1, "blocks": s.depth, "width": s.width, "served_macs": int(self.level_macs[k]),
                   **{key: int(v) for key, v in self.costs[k].items()}} for k, s in enumerate(self.specs)]
        return {"levels.json": json.dumps({"levels": levels, "clients": self.assignment.population()}, indent=2)}

    # -- a round --------------------------------------------------------------------------------
    def kd_active(self, round_idx: int) -> bool:
        return round_idx >= self.kd_start * self.ctx.rounds

    def plan(self, round_idx: int) -> RoundPlan:
        cohort = self.selector.cohort(round_idx)
        tasks = []
        for c in cohort:
            k = int(self.assignment.assigned[c])
            tasks.append(ClientTask(c, spec=self.specs[k], choice=Level(k + 1, bool(self.assignment.fallback[c]))))
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def route(self, task, plan):
        """The client's level as a plain model holding only that level's slices (blocks and exits)."""
        return self.ctx.model.extract(task.spec)

    def new_client(self, task, plan):
        distillation = Distillation(self.kd_gamma, self.kd_temperature, self.kd_active(plan.round_idx),
                                    self.exit_weights, self.kl_reduction, self.detach_teacher)
        return ExitsClient(self.client_round(task, plan), distillation,
                           Mixing(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha))

    @property
    def served_names(self) -> Dict[str, str]:
        return self.assignment.served_names()

    def client_figures(self, task, result, plan):
        k = task.choice.level - 1
        cost = self.costs[k]
        return {"level": task.choice.level, "fallback": int(task.choice.fallback),
                "macs": self.level_macs[k], "train_macs": cost["train_macs"], "params": cost["params"],
                "kd_active": int(self.kd_active(plan.round_idx))}

    # -- evaluation -----------------------------------------------------------------------------
    def level_model(self, k: int) -> torch.nn.Module:
        """Level ``k`` (0-based) as served: the plain extracted model, BN recalibrated per level."""
        if self.recalibrate:
            return self.calibration.subnet(self.specs[k])
        return self.ctx.model.extract(self.specs[k]).module.to(self.ctx.fabric.device)

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Every level on its own and the population accuracy: each client scored by the level
        it is served (largest affordable, or level 1 as the fallback); ``acc`` is the latter."""
        data = self.ctx.data
        dataset, indices = data.split(split)
        out = evaluate_levels(lambda k: evaluate(self.ctx.fabric, self.level_model(k), dataset, indices,
                                                 data.bundle.num_classes, batch_size),
                              range(len(self.specs)), self.assignment.assigned.tolist(), lambda k: f"level{k + 1}",
                              "mean_level_acc")
        if out:
            out["fallback_clients"] = float(self.assignment.fallback.sum())
        return out

    def report(self, summary: dict) -> str:
        """Accuracy of every level, the population accuracy, and every client once, by the level
        it is served."""
        return scalefl_report(summary, self.specs, self.level_macs, [c["served_params"] for c in self.costs],
                              self.assignment.counts(), self.assignment.population())


__all__ = ["ScaleFL", "LEVELS"]
