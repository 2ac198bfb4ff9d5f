"""Sub-model federated learning: the family's base, which every policy of ``submodel/`` extends.

Every policy trains, for each client in a round's cohort, the leading ``p``-fraction of
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
from typing import Dict, List, Literal, Optional, Sequence

import numpy as np
import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg, Weighting
from fl_lightning.algorithms.bn_protocol import Protocol, SbnData
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import NonNegativeFloat, PositiveInt, UnitFraction
from fl_lightning.runtime.kept_state import KeptAttributes, KeptTensors
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed
from fl_lightning.seeds import seeded_rng

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


class SubmodelClient(LocalClient):
    """A sub-model client: local training of its width-``p`` slice (``task.choice``), with
    HeteroFL's Scaler when asked (every conv output divided by ``p`` in training)."""

    def __init__(self, round: ClientRound, scaler: bool = False):
        super().__init__(round)
        self.scaler = scaler

    def objective(self, downlink):
        self.attach_scaler(downlink.model.module)
        return super().objective(downlink)

    def attach_scaler(self, module) -> None:
        p = self.task.choice.p
        if self.scaler and p < 1:  # at rate 1 the Scaler is the identity: attach nothing
            from fl_lightning.elastic.layers.scaler import attach_scaler

            attach_scaler(module, p)


class SubmodelAlgorithm(FedAvg):
    """Shared machinery: caps, width specs per task, routing by leading-slice extraction,
    coordinate-wise aggregation, coverage and cost monitoring. Subclasses implement
    :meth:`widths_for` (the cohort's widths for a round)."""

    def __init__(self, tiers: List[UnitFraction] = list(TIERS), tier_probs: List[NonNegativeFloat] = list(TIER_PROBS),
                 caps: Optional[List[UnitFraction]] = None, log_layers: bool = True, bn: Optional[Protocol] = None,
                 sbn_data: SbnData = "train", calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train", weighting: Optional[Weighting] = None,
                 eval_widths: Optional[List[UnitFraction]] = None):
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
            eval_widths: besides the served model, score the leading sub-model of each of these
                widths at every evaluation, each with statistics of its own from the served-
                statistics protocol (under sbn: its own pass over ``sbn_data``), as FjORD's
                authors report every width: ``acc_w<width>`` and ``loss_w<width>``.
        """
        super().__init__(bn=bn if bn is not None else "sbn", sbn_data=sbn_data, calib_batch_size=calib_batch_size,
                         calib_transform=calib_transform, weighting=weighting)
        self.dense = False  # each position averaged over the clients whose slice holds it
        self.tiers = [float(t) for t in tiers]
        self.tier_probs = [float(p) for p in tier_probs]
        self.caps_given = None if caps is None else [float(c) for c in caps]
        self.log_layers = log_layers
        self.eval_widths = None if eval_widths is None else [float(w) for w in eval_widths]

    def check(self, train, population=None) -> None:
        if self.eval_widths is not None and len(set(self.eval_widths)) != len(self.eval_widths):
            raise ConfigError("algorithm.eval_widths", f"must be distinct widths, got {self.eval_widths}")
        if not self.tiers:
            raise ConfigError("algorithm.tiers", "must list at least one width")
        if any(a >= b for a, b in zip(self.tiers, self.tiers[1:])):
            raise ConfigError("algorithm.tiers", f"must be distinct widths, smallest first, got {self.tiers}")
        # the tier probabilities draw the caps; given caps make them irrelevant
        if self.caps_given is None and (len(self.tier_probs) != len(self.tiers) or sum(self.tier_probs) <= 0):
            raise ConfigError("algorithm.tier_probs", f"must be {len(self.tiers)} non-negative numbers (one per "
                                                      f"tier) with a positive sum, got {self.tier_probs}")

    # -- set-up -----------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
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
        self.keep(KeptAttributes(self, {"caps": "caps"}, torch.float64))
        self.keep(KeptTensors("ever/", self.ever, stored_as=torch.uint8))
        self.last_widths: Dict[int, float] = {}
        self._costs: Dict[object, tuple] = {}

    # -- the plan ---------------------------------------------------------------------------
    def widths_for(self, round_idx: int, cohort: List[int]) -> Dict[int, float]:
        """Each cohort client's width this round (at most its cap)."""
        raise NotImplementedError

    def plan(self, round_idx: int) -> RoundPlan:
        from fl_lightning.elastic.specs import WidthSpec

        cohort = self.selector.cohort(round_idx)
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

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """The served model (FedAvg's), and with ``eval_widths`` each width's own sub-model."""
        out = super().evaluate(split, batch_size)
        if self.eval_widths and out:
            out.update(self.evaluate_widths(split, batch_size))
        return out

    @property
    def served_names(self) -> Dict[str, str]:
        """With ``eval_widths``, each width's accuracy (``acc_w<width>``) named by its width and MACs."""
        from fl_lightning.elastic.specs import WidthSpec
        from fl_lightning.units import macs

        if not self.eval_widths:
            return {}
        return {f"acc_w{w:g}": f"width {w:g} {macs(self.cost(WidthSpec.uniform(w, self.stages))[1])}"
                for w in self.eval_widths}

    def evaluate_widths(self, split: str, batch_size: int) -> Dict[str, float]:
        """``acc_w<width>`` / ``loss_w<width>`` of the leading sub-model of every ``eval_widths``
        entry, each served with statistics of its own (one pass per the protocol)."""
        from fl_lightning.elastic.specs import WidthSpec
        from fl_lightning.runtime.evaluation import evaluate

        data = self.ctx.data
        dataset, indices = data.split(split)
        models = self.statistics.models([WidthSpec.uniform(w, self.stages) for w in self.eval_widths])
        out = {}
        for width, model in zip(self.eval_widths, models):
            metrics = evaluate(self.ctx.fabric, model, dataset, indices, data.bundle.num_classes, batch_size)
            out.update({f"{key}_w{width:g}": value for key, value in metrics.items()})
        return out

    def artifacts(self) -> Dict[str, str]:
        return {"caps.json": json.dumps([float(c) for c in self.caps])}

