"""FEAST (Khan and Daneshtalab, 2026): federated shared-space training of an elastic ResNet.

Server side of Algorithm 1: each client's affordable set A_i from the fixed variant cache
(Eq. 3), budget-tailored routing of the envelope over A_i (Eq. 4; a flag turns it off),
local multi-variant co-training (``modules/feast_client.py``, Algorithm 2) and position-wise
sample-count-weighted sparse aggregation (Eq. 7). Evaluation recalibrates BN for every
operating point on the server's calibration split and reports every cached variant and the
population accuracy under largest-affordable serving (Supp. E.1, Table 1).
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Tuple

import torch

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.supernet.cached_variants import (CachedVariants, CacheSearch, ServesCachedVariants,
                                                     check_cache_options)
from fl_lightning.feast_protocol import CALIB_BATCH_SIZE, KAPPA_FB
from fl_lightning.elastic.routing import Routed
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt
from fl_lightning.runtime.seeding import derive_seed

Rule = Literal["full", "min_max_kd", "min_max", "min_only", "max_only"]
MixSchedule = Literal["alternate", "random", "mixup", "cutmix", "none"]
# seed streams of the random intermediate, of Mixup/CutMix and of the calibration augmentation
INTERMEDIATE_STREAM, MIXING_STREAM = 11, 12  # 13: the server calibration's (runtime/calibration.py)


class Feast(ServesCachedVariants, FedAvg):
    """FEAST: min / random-intermediate / local-max co-training with in-place distillation,
    budget-tailored sub-supernet routing and sparse aggregation."""

    dense = False

    def __init__(self, cache: Optional[str] = None, retarget: bool = False, search: CacheSearch = CacheSearch(),
                 routing: bool = True,
                 rule: Rule = "full", rho_kd: ClosedUnitInterval = 0.5, temperature: PositiveFloat = 1.0,
                 mixup_alpha: NonNegativeFloat = 0.4, cutmix_alpha: NonNegativeFloat = 1.0,
                 mix_schedule: MixSchedule = "alternate", calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train", kappa: PositiveFloat = KAPPA_FB):
        """
        Args:
            cache: JSON file of cached variants (architectures and MACs); built by the genetic
                search below and saved to the run directory when not given.
            retarget: reuse the cache file's architectures for this model and input size with
                their MACs recomputed (the paper reuses its CIFAR-100 cache on TinyImageNet).
            search: genetic-search settings used when no cache file is given.
            routing: send each client only the envelope of its affordable variants (Eq. 4);
                false sends the full supernet (same result when every client affords everything).
            rule: local training rule: full, min_max_kd, min_max, min_only, max_only (Table 2).
            rho_kd: weight of the distillation term in the student loss (Eq. 9).
            temperature: distillation temperature (1: no scaling).
            mixup_alpha: Mixup's Beta parameter (alternates with CutMix; 0 disables).
            cutmix_alpha: CutMix's Beta parameter (0 disables).
            mix_schedule: how Mixup and CutMix alternate: alternate (even / odd batches, the
                paper's wording), random (each batch picks one with probability 1/2, as the
                authors' DeepFedNAS code does), mixup, cutmix, or none.
            calib_batch_size: batch size of BN recalibration on the server's calibration split.
            calib_transform: image-level transform of the calibration images: train (the
                training augmentation, drawn once with a fixed seed and reused in the same
                order for every operating point, as Supp. B describes) or eval (none).
            kappa: forward-plus-backward factor of the training-MAC proxy (Eq. 26).
        """
        self.cache_path, self.retarget, self.search, self.routing, self.rule = cache, retarget, search, routing, rule
        self.rho_kd, self.temperature = rho_kd, temperature
        self.mixup_alpha, self.cutmix_alpha, self.mix_schedule = mixup_alpha, cutmix_alpha, mix_schedule
        self.calib_batch_size, self.calib_transform, self.kappa = calib_batch_size, calib_transform, kappa

    # -- set-up ---------------------------------------------------------------------------------
    def check(self, train) -> None:
        checks = [
            ("mixup_alpha", self.mix_schedule != "mixup" or self.mixup_alpha > 0, "must be > 0 for mix_schedule mixup"),
            ("cutmix_alpha", self.mix_schedule != "cutmix" or self.cutmix_alpha > 0,
             "must be > 0 for mix_schedule cutmix"),
            ("mix_schedule", self.mix_schedule not in ("alternate", "random") or (self.mixup_alpha > 0
             and self.cutmix_alpha > 0), "alternate and random need mixup_alpha > 0 and cutmix_alpha > 0"),
        ]
        for key, ok, problem in checks:
            if not ok:
                raise ConfigError(f"algorithm.{key}", f"{problem}, got {getattr(self, key)!r}")
        check_cache_options(self.cache_path, self.search)

    def prepare(self, ctx) -> None:
        from fl_lightning.algorithms.supernet import feast_accounting as accounting
        from fl_lightning.elastic.models.ofa_resnet import OFAResNet

        if not isinstance(ctx.model, OFAResNet):
            raise ConfigError("model", "FEAST trains an OFAResNet supernet")
        super().prepare(ctx)
        self.variants = CachedVariants(ctx, self.cache_path, self.retarget, self.search, self.calib_batch_size,
                                       self.calib_transform, method="FEAST", required_by="FEAST recalibrates BN")
        self.cache, self.sets = self.variants.cache, self.variants.sets
        self.routed_params = accounting.client_routed_params(ctx.model, self.cache, self.sets)
        self.pass_macs = [accounting.pass_macs_per_example(self.cache, s, self.rule) for s in self.sets]
        self.start_round_sums(ctx)
        description = self.describe_population()
        if ctx.fabric.is_global_zero and ctx.mode == "fit":
            print(description)

    def start_round_sums(self, ctx) -> None:
        """The parameter groups of the round's data-mass sums (``new_accumulator``)."""
        self.mass_group_names, self.mass_groups = parameter_groups(ctx.model)

    def new_accumulator(self, plan):
        """Besides the model: per parameter group, the examples x parameters routed to clients
        and the part their rule trained."""
        acc = super().new_accumulator(plan)
        acc.declare("feast/mass", torch.zeros(2, len(self.mass_group_names)))
        return acc

    def describe_population(self) -> str:
        from fl_lightning.algorithms.supernet import feast_accounting as accounting
        from fl_lightning.elastic.envelope import full_param_count

        ctx = self.ctx
        summary = accounting.population_summary(self.cache, ctx.budgets.tolist(), ctx.client_sizes, self.routed_params)
        comm = accounting.communication(full_param_count(ctx.model), self.routed_params)
        compute = accounting.training_computation(self.cache, self.sets, ctx.client_sizes,
                                                  ctx.rounds, ctx.clients_per_round,
                                                  ctx.train.epochs, self.rule, kappa=self.kappa)
        footprints = accounting.parameter_footprints(ctx.model, self.cache, accounting.default_anchors(self.cache.macs))
        self.accounting = {"population": summary, "communication": comm, "computation": compute,
                           "footprints": footprints}
        head = f"FEAST: {len(self.cache.specs)} cached variants, {self.cache.macs[0] / 1e6:.1f}M-" \
               f"{self.cache.macs[-1] / 1e6:.1f}M MACs, routing {'on' if self.routing else 'off'}, rule {self.rule}"
        return head + "\n" + accounting.format_accounting(summary, comm, compute, footprints)

    # -- one client -----------------------------------------------------------------------------
    def work(self, task) -> float:
        return super().work(task) * self.pass_macs[task.client]

    def route(self, task, plan) -> Routed:
        from fl_lightning.elastic.envelope import route_envelope

        if self.routing:
            return route_envelope(self.ctx.model, self.variants.specs_of(task.client))
        return super().route(task, plan)

    def client_module(self, routed, task, plan):
        from fl_lightning.modules.feast_client import FeastClient
        from fl_lightning.modules.mixing import AlternatingMixer

        t = self.ctx.train
        key = (self.ctx.seed, plan.round_idx, task.client)
        mixer = None
        if self.mix_schedule != "none":
            mixer = AlternatingMixer(self.ctx.num_classes, self.mixup_alpha, self.cutmix_alpha,
                                     schedule=self.mix_schedule, generator=_generator(MIXING_STREAM, *key))
        sets = self.sets[task.client]
        client = FeastClient(routed.module, plan.lr, t.momentum, t.weight_decay,
                             variants=[(self.cache.specs[j], self.cache.macs[j]) for j in sets],
                             global_min=self.cache.specs[self.cache.global_min()], rho_kd=self.rho_kd,
                             temperature=self.temperature, mixer=mixer, generator=_generator(INTERMEDIATE_STREAM, *key),
                             rule=self.rule)
        client.track_gradient_support()
        return client

    def client_figures(self, task, result, plan) -> Dict[str, float]:
        """The client's training MACs (the proxy of Eq. 26: kappa times its forward MACs)."""
        return {"train_macs": float(result.module.forward_macs()) * self.kappa}

    def commit(self, acc, task, result, plan) -> None:
        if result.update is not None:
            acc.add_sum("feast/mass", self._count_mass(result.update, result.module.gradient_support,
                                                       float(result.num_samples)))
        super().commit(acc, task, result, plan)

    def _count_mass(self, update, touched: Dict[str, torch.Tensor], num_samples: float) -> torch.Tensor:
        """Eq. 7 weighs every routed position by the client's examples, whether the client's
        rule trained it or not; count both masses. A position counts as trained when a
        trained variant reaches it (a nonzero gradient; weight decay alone also moves the
        inactive slices of a routed tensor, so a changed value is not the test)."""
        mass = torch.zeros(2, len(self.mass_group_names), dtype=torch.float64)
        for local_key, (global_key, region) in update.regions.items():
            group = self.mass_groups.get(global_key)
            if group is None:  # BN statistics and counters: not trained parameters
                continue
            mass[0, group] += num_samples * region.numel()
            if local_key in touched:
                mass[1, group] += num_samples * float(touched[local_key].sum())
        return mass

    def finish_round(self, acc, plan) -> Dict[str, float]:
        out = super().finish_round(acc, plan)
        routed, trained = acc["feast/mass"].double().cpu()
        if routed.sum() > 0:
            out["mass/trained_frac"] = float(trained.sum() / routed.sum())
            for name, r, t in zip(self.mass_group_names, routed.tolist(), trained.tolist()):
                if r > 0:
                    out[f"mass/trained_frac/{name}"] = t / r
        return out


def parameter_groups(model) -> Tuple[List[str], Dict[str, int]]:
    """The supernet's trainable parameters grouped as stem, each stage and classifier:
    (group names in model order, parameter name -> group index)."""
    names: List[str] = []
    groups: Dict[str, int] = {}
    for key, _ in model.named_parameters():
        parts = key.split(".")
        name = ".".join(parts[:2]) if parts[0] == "stages" else parts[0]
        if name not in names:
            names.append(name)
        groups[key] = names.index(name)
    return names, groups


def _generator(stream: int, seed: int, round_idx: int, client: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, stream, round_idx, client))
