"""FIARSE (Wu et al., NeurIPS 2024): importance-aware submodel extraction by weight magnitude.

Each round every sampled client receives the global model and the thresholds of an
unstructured magnitude mask that keeps its budget's fraction of the convolution and linear
parameters, the largest by ``|w|`` (``elastic/magnitude_masks.py``). It trains the dense tensors
through the mask with FIARSE's threshold-controlled biased gradient
(``modules/masked_client.py``): the forward uses ``w * 1{|w| >= tau}`` with the round's ``tau``,
the optimizer steps the dense weights with the gradient that passes the mask, and weight
decay is zero. The server averages every coordinate over the clients whose mask kept it
(sample-weighted, through ``SparseAccumulator`` with ``Mask`` regions); coordinates no client
kept keep their value.

Evaluation scores the masked global model on a grid of kept fractions, with each point's
logical MACs (kept weights only) and executed MACs (the dense model's), and the population
accuracy under largest-affordable serving: each client gets the grid point with the largest
logical MACs within its budget (the smallest point when none is), as FEAST's Supp. E.1 does
for FIARSE's continuous mask family. ``docs/fiarse.md`` gives the rule, its sources and the
departures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Literal, Mapping, Optional

import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.mixing import Mixing
from fl_lightning.elastic.regions import Mask
from fl_lightning.elastic.routing import RegionMap, Routed, load_routed_state
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import NonNegativeFloat, PositiveFloat, PositiveInt, UnitFraction
from fl_lightning.runtime.calibration import ServerCalibration
from fl_lightning.runtime.seeding import derive_seed

# Seed streams: FIARSE's Mixup/CutMix draws; BN calibration shares FEAST's stream (13), so the
# same seed recalibrates every method of a comparison on the same augmented images.
MIXING_STREAM = 31


@dataclass
class MaskedRouted(Routed):
    """A routed dense model with the round's mask: thresholds per parameter, kept counts."""

    thresholds: Dict[str, torch.Tensor] = field(default_factory=dict)
    fraction: float = 1.0
    """Kept fraction requested for the client."""
    kept: Dict[str, int] = field(default_factory=dict)

    def payload_bytes(self) -> int:
        """The dense tensors cross: masking does not shrink the arrays the original sends."""
        return sum(t.numel() * t.element_size() for t in self.module.state_dict().values())

    def kept_bytes(self) -> int:
        """What the kept positions alone would take to send."""
        return super().payload_bytes()


@dataclass(frozen=True)
class MaskedSettings:
    """FIARSE's options as a client reads them."""

    gradient: str
    weight_decay: float
    mixing: Mixing


class MaskedLocalClient(LocalClient):
    """A FIARSE client: local training of the dense model through its thresholded mask (the
    thresholds come with the model), with Mixup / CutMix when asked."""

    def __init__(self, round: ClientRound, settings: MaskedSettings):
        super().__init__(round)
        self.settings = settings

    def objective(self, downlink):
        from fl_lightning.modules.masked_client import ThresholdMaskedClient

        r, s, routed = self.round, self.settings, downlink.model
        mixer = s.mixing.mixer(r.num_classes, derive_seed(r.seed, MIXING_STREAM, r.round_idx, r.client))
        return ThresholdMaskedClient(routed.module, r.lr, r.train.momentum, s.weight_decay, routed.thresholds,
                                     s.gradient, mixer)


def geometric_grid(low: float, points: int) -> List[float]:
    """``points`` kept fractions from ``low`` to 1, evenly spaced in log scale (with ``low =
    1/64`` and 25 points, every fourth is a power of 1/2: the original's model sizes)."""
    if points == 1:
        return [1.0]
    return [float(low ** (1 - i / (points - 1))) for i in range(points)]


def masked_region_map(regions: RegionMap, masks: Mapping[str, torch.Tensor]) -> RegionMap:
    """``regions`` with a ``Mask`` region for every key in ``masks`` (others unchanged)."""
    return {local: (g, Mask(masks[local]) if local in masks else region) for local, (g, region) in regions.items()}


def changed_region_map(regions: RegionMap, local_state: Mapping[str, torch.Tensor],
                       global_state: Mapping[str, torch.Tensor]) -> RegionMap:
    """Every floating-point entry covers exactly the positions the client changed
    (``delta != 0``), the authors' count (``tot_mask += (grad != 0)``)."""
    out = {}
    for local, (g, region) in regions.items():
        value = local_state[local]
        if not value.is_floating_point():
            out[local] = (g, region)
            continue
        out[local] = (g, Mask(value.detach() != global_state[g].to(value.device, value.dtype)))
    return out


def serve(logical_macs: List[float], budget: float) -> int:
    """Largest-affordable serving: the point with the most logical MACs within ``budget``;
    the cheapest point when none is affordable (minimum-tier fallback)."""
    affordable = [j for j, m in enumerate(logical_macs) if m <= budget]
    if affordable:
        return max(affordable, key=lambda j: (logical_macs[j], j))
    return min(range(len(logical_macs)), key=lambda j: (logical_macs[j], j))


class FIARSE(FedAvg):
    """FIARSE: magnitude-masked submodels, threshold-controlled biased gradient, position-wise
    sparse-delta aggregation, evaluation on a grid of its mask family."""


    def __init__(self, threshold: Literal["global", "stage", "tensor"] = "stage",
                 gradient: Literal["masked", "surrogate"] = "masked",
                 min_fraction: UnitFraction = 1 / 64,
                 fractions: Optional[List[UnitFraction]] = None,
                 budget_match: Literal["params", "macs"] = "params",
                 macs_convention: Literal["paper", "fvcore"] = "paper",
                 weighting: Literal["samples", "uniform"] = "samples",
                 support: Literal["mask", "changed"] = "mask",
                 server_lr: PositiveFloat = 1.0,
                 weight_decay: Optional[NonNegativeFloat] = 0.0,
                 eval_fractions: Optional[List[UnitFraction]] = None,
                 eval_points: PositiveInt = 25,
                 recalibrate_bn: bool = True,
                 calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train",
                 mix_schedule: Literal["none", "alternate", "random", "mixup", "cutmix"] = "none",
                 mixup_alpha: NonNegativeFloat = 0.4,
                 cutmix_alpha: NonNegativeFloat = 1.0):
        """
        Args:
            threshold: which parameters share a magnitude threshold: stage (one per top-level
                module: stem, each ResNet stage, classifier; the authors' layer-wise code, which
                their README runs for CIFAR-100, and the grouping whose smallest point, 1/64 of
                555M = 8.7M MACs, is the 9M low end FEAST reports for FIARSE), global (one for
                the whole model, the authors' ``fiarse/`` code) or tensor (one per convolution /
                linear layer).
            gradient: what reaches the dense weights through the mask: masked (``g * m``,
                what the authors' code computes) or surrogate (``g * m * (1 + 2 tau |w| /
                (|w| + tau)^2)``, the backward their ``Bern`` function defines but never runs).
            min_fraction: smallest kept fraction; budget ratios are clipped to
                ``[min_fraction, 1]`` (1/64, the original's smallest model size).
            fractions: explicit kept fraction per client (the original's ``--model-size``
                list, expanded), instead of MAC budget over the full model's MACs; serving
                then uses ``fraction x dense MACs`` as the client's budget.
            budget_match: how a budget picks the kept fraction: params (fraction = budget /
                dense MACs, clipped: the kept share of parameters matches the budget ratio) or
                macs (the largest fraction whose logical MACs stay within the budget).
            macs_convention: MACs of budgets, grid points and logs: paper (convolutions and
                linear layers only, the DeepFedNAS counter FEAST's budgets use) or fvcore
                (fvcore's total, batch norm and pooling included).
            weighting: each client's weight in the position-wise mean: samples (its
                examples, the project's rule) or uniform (the authors' plain mean; identical
                under their balanced partitions).
            support: positions a client's update counts for: mask (the positions its
                round-start mask kept) or changed (the positions whose value it changed, the
                authors' ``grad != 0`` count).
            server_lr: global step on the averaged update of parameters (``x <- x + lr
                (mean - x)``; buffers take the mean); 1 (the original's default) makes the
                new global the position-wise mean of the clients' models.
            weight_decay: SGD weight decay of the clients; 0 as in the original (FEAST keeps
                FIARSE's zero weight decay); null uses ``train.weight_decay``.
            eval_fractions: kept fractions evaluated (the serving grid); default
                ``eval_points`` fractions from ``min_fraction`` to 1, evenly spaced in log scale.
            eval_points: size of the default grid.
            recalibrate_bn: re-estimate BN statistics of every evaluated point on the
                server's calibration split (FEAST's protocol; needs ``data.calib_size > 0``);
                false scores with the aggregated running statistics.
            calib_batch_size: batch size of that recalibration.
            calib_transform: image transform of the calibration images: train (the training
                augmentation, drawn once with a fixed seed, FEAST's choice) or eval.
            mix_schedule: Mixup / CutMix on the clients' batches: none (the original),
                alternate (FEAST's common protocol), random, mixup or cutmix.
            mixup_alpha: Mixup's Beta parameter.
            cutmix_alpha: CutMix's Beta parameter.
        """
        super().__init__()
        self.dense = False  # position-wise means over the clients that hold each position
        self.threshold, self.gradient = threshold, gradient
        self.min_fraction = float(min_fraction)
        self.fractions_given = None if fractions is None else [float(f) for f in fractions]
        self.budget_match, self.macs_convention = budget_match, macs_convention
        self.weighting, self.support, self.server_lr = weighting, support, float(server_lr)
        self.weight_decay = None if weight_decay is None else float(weight_decay)
        self.eval_fractions = None if eval_fractions is None else [float(f) for f in eval_fractions]
        self.eval_points = int(eval_points)
        self.recalibrate_bn, self.calib_batch_size, self.calib_transform = recalibrate_bn, int(calib_batch_size), calib_transform
        self.mix_schedule, self.mixup_alpha, self.cutmix_alpha = mix_schedule, float(mixup_alpha), float(cutmix_alpha)

    # -- set-up ---------------------------------------------------------------------------------
    def check(self, train, population=None) -> None:
        from fl_lightning.modules.mixing import mixing_checks

        checks = [
            ("fractions", self.fractions_given != [], "must list one kept fraction per client, or be null"),
            ("eval_fractions", self.eval_fractions != [], "must list at least one kept fraction, or be null"),
            *mixing_checks(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha),
        ]
        for key, ok, problem in checks:
            if not ok:
                value = {"fractions": self.fractions_given}.get(key, getattr(self, key, None))
                raise ConfigError(f"algorithm.{key}", f"{problem}, got {value!r}")

    def prepare(self, ctx) -> None:
        from fl_lightning.elastic.bn import batch_norms
        from fl_lightning.elastic.magnitude_masks import group_keys, layer_macs, maskable_keys

        super().prepare(ctx)
        self.keys = maskable_keys(ctx.model)
        if not self.keys:
            raise ConfigError("model", "FIARSE masks convolution and linear parameters; this model has none")
        self.groups = group_keys(ctx.model, self.threshold)
        self.maskable_numel = sum(self.global_state[k].numel() for k in self.keys)
        self.param_keys = {k for k, _ in ctx.model.named_parameters()}
        self.input_shape = tuple(ctx.data.bundle.input_shape)
        self.macs = layer_macs(self.worker, self.input_shape)
        self.dense_macs = self.macs.executed(self.macs_convention)
        n = ctx.num_clients
        if self.fractions_given is not None:
            if len(self.fractions_given) != n:
                raise ConfigError("algorithm.fractions", f"needs {n} fractions (one per client), "
                                                         f"got {len(self.fractions_given)}")
            ratios = list(self.fractions_given)
            self.budgets = [f * self.dense_macs for f in ratios]
        else:
            if ctx.budgets is None:
                raise ConfigError("partition.budgets", "FIARSE needs client MAC budgets (or algorithm.fractions)")
            self.budgets = [float(b) for b in ctx.budgets.tolist()]
            ratios = [b / self.dense_macs for b in self.budgets]
        self.client_fraction = [min(1.0, max(self.min_fraction, r)) for r in ratios]
        self.grid = sorted(set(self.eval_fractions or geometric_grid(self.min_fraction, self.eval_points)))
        self.has_bn = bool(batch_norms(ctx.model))
        self._family, self._family_round, self._round_masks = None, None, {}
        recalibrates = self.recalibrate_bn and self.has_bn
        self.calibration = ServerCalibration(
            ctx, self.calib_batch_size, self.calib_transform, otherwise="algorithm.recalibrate_bn: false",
            required_by="FIARSE recalibrates BN per evaluated point" if recalibrates else None)

    def artifacts(self) -> Dict[str, str]:
        """Each client's budget and training fraction, the grid and the dense MACs."""
        return {"fiarse.json": json.dumps({
            "macs_convention": self.macs_convention, "dense_macs": self.dense_macs, "grid": self.grid,
            "budgets": self.budgets, "fractions": self.client_fraction, "threshold": self.threshold,
            "gradient": self.gradient}, indent=2)}

    # -- masks ----------------------------------------------------------------------------------
    def family(self):
        """The mask family of the current global weights."""
        from fl_lightning.elastic.magnitude_masks import MaskFamily

        return MaskFamily(self.global_state, self.groups)

    def round_family(self, round_idx: int):
        """One family per round: the global weights do not change between its clients."""
        if self._family_round != round_idx:
            self._family, self._family_round = self.family(), round_idx
            self._round_masks = {}
        return self._family

    def round_masks(self, family, fraction: float):
        """The round's thresholds, region map and kept counts for ``fraction``, built once per
        round and shared by its clients of that fraction (a shared region also adds its count
        once in aggregation)."""
        if fraction not in self._round_masks:
            thresholds = family.thresholds(fraction)
            masks = family.masks(self.global_state, thresholds)
            regions = masked_region_map(self.worker_regions, masks)
            self._round_masks[fraction] = (thresholds, regions, {k: regions[k][1].numel() for k in masks})
        return self._round_masks[fraction]

    def client_fraction_now(self, family, client: int) -> float:
        if self.budget_match == "macs":
            return family.fraction_for_macs(self.macs, self.budgets[client], self.min_fraction, self.macs_convention)
        return self.client_fraction[client]

    # -- a round --------------------------------------------------------------------------------
    def route(self, task, plan) -> MaskedRouted:
        """The dense global model (loaded into the worker) with the client's mask as regions."""
        family = self.round_family(plan.round_idx)
        fraction = self.client_fraction_now(family, task.client)
        thresholds, regions, kept = self.round_masks(family, fraction)
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        return MaskedRouted(self.worker, regions, thresholds=thresholds, fraction=fraction, kept=kept)

    def new_client(self, task, plan):
        t = self.ctx.train
        weight_decay = t.weight_decay if self.weight_decay is None else self.weight_decay
        settings = MaskedSettings(self.gradient, weight_decay,
                                  Mixing(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha))
        return MaskedLocalClient(self.client_round(task, plan), settings)

    def client_figures(self, task, result, plan):
        """FIARSE's costs; ``bytes_kept`` is what the kept positions alone would take to send."""
        routed: MaskedRouted = result.model
        kept = sum(routed.kept.values())
        return {"bytes_kept": routed.kept_bytes(),
                "fraction": routed.fraction, "kept_fraction": kept / self.maskable_numel,
                "logical_macs": float(self.macs.logical(routed.kept, self.macs_convention)),
                "executed_macs": float(self.dense_macs)}

    def commit(self, acc, task, result, plan) -> None:
        """Add the client's model on its support, weighted by examples (or 1)."""
        local = result.model.module.state_dict()
        regions = result.model.regions
        if self.support == "changed":
            regions = changed_region_map(regions, local, self.global_state)
        acc.add(local, self.weight(result), regions)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        """``x <- x + server_lr (mean - x)`` for parameters; buffers take the mean."""
        new_state = acc.result()
        if self.server_lr != 1.0:
            for key, value in new_state.items():
                if key in self.param_keys:
                    old = self.global_state[key]
                    new_state[key] = old + self.server_lr * (value.to(old.dtype) - old)
        self.apply(new_state)
        self._family, self._family_round, self._round_masks = None, None, {}
        return {}

    # -- evaluation -----------------------------------------------------------------------------
    def grid_points(self, family=None) -> List[dict]:
        """Every grid fraction's thresholds, kept fraction and logical MACs on the current weights."""
        family = (family or self.family()).presort()
        numel = family.total
        points = []
        for fraction in self.grid:
            thresholds = family.thresholds(fraction)
            kept = family.kept(thresholds)
            points.append({"fraction": fraction, "thresholds": thresholds, "kept_fraction": sum(kept.values()) / numel,
                           "logical_macs": float(self.macs.logical(kept, self.macs_convention))})
        return points

    def masked_model(self, family, thresholds) -> torch.nn.Module:
        """The worker holding the global model with pruned entries zeroed (the served model),
        its BN statistics recalibrated when asked."""
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        state = self.worker.state_dict()
        with torch.no_grad():
            for key, mask in family.masks(self.global_state, thresholds).items():
                state[key].mul_(mask.to(state[key].dtype))
        if self.recalibrate_bn and self.has_bn:  # FEAST's calibration images, order and draw
            self.calibration.recalibrate(self.worker)
        return self.worker

    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        """Population accuracy under largest-affordable serving (``acc``) and every grid point's
        accuracy, kept fraction and logical MACs (validation scores the served points only)."""
        from fl_lightning.runtime.evaluation import evaluate

        family = self.family()
        points = self.grid_points(family)
        logical = [p["logical_macs"] for p in points]
        served = [serve(logical, b) for b in self.budgets]
        indices = sorted(set(served)) if split == "val" else range(len(points))
        dataset, split_indices = self.ctx.data.split(split)
        scores = {}
        for j in indices:
            model = self.masked_model(family, points[j]["thresholds"])
            scores[j] = evaluate(self.ctx.fabric, model, dataset, split_indices, self.ctx.num_classes, batch_size)
        out = {"acc": sum(scores[j]["acc"] for j in served) / len(served),
               "mean_point_acc": sum(s["acc"] for s in scores.values()) / len(scores),
               "executed_macs": float(self.dense_macs)}
        for j, s in scores.items():
            out.update({f"point{j:02d}_acc": s["acc"], f"point{j:02d}_fraction": points[j]["kept_fraction"],
                        f"point{j:02d}_logical_macs": points[j]["logical_macs"],
                        f"point{j:02d}_clients": float(served.count(j))})
        return out

    def report(self, summary: dict) -> str:
        """Accuracy against logical and executed MACs on the grid, and the population accuracy."""
        block = summary.get("best") or summary.get("final")
        if not block or "test_acc" not in block:
            return ""
        which = "best-validation checkpoint" if "best" in summary else "final model"
        lines = [f"FIARSE test accuracy ({which}), MACs in the {self.macs_convention} convention:",
                 f"{'point':>5}  {'kept %':>7}  {'logical':>10}  {'executed':>10}  {'clients':>7}  {'acc %':>6}"]
        executed = block.get("test_executed_macs", float(self.dense_macs))
        for j in range(len(self.grid)):
            acc = block.get(f"test_point{j:02d}_acc")
            if acc is None:
                continue
            lines.append(f"{j:5d}  {100 * block[f'test_point{j:02d}_fraction']:7.2f}  "
                         f"{block[f'test_point{j:02d}_logical_macs'] / 1e6:9.2f}M  {executed / 1e6:9.2f}M  "
                         f"{int(block[f'test_point{j:02d}_clients']):7d}  {100 * acc:6.2f}")
        lines.append(f"population accuracy under largest-affordable serving: {100 * block['test_acc']:.2f}%")
        return "\n".join(lines)


__all__ = ["FIARSE", "MaskedRouted", "geometric_grid", "masked_region_map", "changed_region_map", "serve"]
