"""FEAST (Khan and Daneshtalab, 2026): federated shared-space training of an elastic ResNet.

Server side of Algorithm 1: each client's affordable set A_i from the fixed variant cache
(Eq. 3), budget-tailored routing of the envelope over A_i (Eq. 4; a flag turns it off),
local multi-variant co-training (``modules/feast_client.py``, Algorithm 2) and position-wise
sample-count-weighted sparse aggregation (Eq. 7). Evaluation recalibrates BN for every
operating point on the server's calibration split and reports every cached variant and the
population accuracy under largest-affordable serving (Supp. E.1, Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Tuple

import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.mixing import Mixing
from fl_lightning.algorithms.supernet.cached_variants import (CachedVariants, CacheSearch, check_cache_options,
                                                             check_population_reaches)
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.feast_protocol import KAPPA_FB
from fl_lightning.elastic.regions import union_numel
from fl_lightning.elastic.routing import Routed
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt
from fl_lightning.runtime.seeding import derive_seed
from fl_lightning.units import count, macs as macs_text

Rule = Literal["full", "min_max_kd", "min_max", "min_only", "max_only"]
MixSchedule = Literal["alternate", "random", "mixup", "cutmix", "none"]
# seed streams of the random intermediate, of Mixup/CutMix and of the calibration augmentation
INTERMEDIATE_STREAM, MIXING_STREAM = 11, 12  # 13: the server calibration's (runtime/calibration.py)


@dataclass(frozen=True)
class FeastSettings:
    """FEAST's options as a client reads them."""

    mixing: Mixing
    rho_kd: float
    temperature: float
    rule: str
    kappa: float
    """Training MACs per forward MAC (the proxy of Eq. 26)."""


class FeastLocalClient(LocalClient):
    """A FEAST client's round: its local maximum, the global minimum and a random intermediate
    of its affordable variants per mini-batch with in-place distillation (``modules/
    feast_client.py``), its draws from the (seed, round, client) streams. It reports its
    training MACs, and which variants it trained (the uplink's payload) for the trained mass."""

    def __init__(self, round: ClientRound, settings: FeastSettings, variants: List[Tuple[object, float]],
                 global_min):
        super().__init__(round)
        self.settings, self.variants, self.global_min = settings, variants, global_min

    def objective(self, downlink):
        from fl_lightning.modules.feast_client import FeastClient
        from fl_lightning.modules.mixing import AlternatingMixer

        r, s = self.round, self.settings
        key = (r.seed, r.round_idx, r.client)
        mixer = None
        if s.mixing.schedule != "none":
            mixer = AlternatingMixer(r.num_classes, s.mixing.mixup_alpha, s.mixing.cutmix_alpha,
                                     schedule=s.mixing.schedule, generator=_generator(MIXING_STREAM, *key))
        return FeastClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay, variants=self.variants,
                           global_min=self.global_min, rho_kd=s.rho_kd, temperature=s.temperature, mixer=mixer,
                           generator=_generator(INTERMEDIATE_STREAM, *key), rule=s.rule)

    def uplink(self, downlink, module, fit):
        """The trained model goes back; the training MACs are kappa times its forward MACs."""
        return self.result(downlink, fit, model=downlink.model, payload=module.trained_variants(),
                           figures={"train_macs": float(module.forward_macs()) * self.settings.kappa})


class Feast(FedAvg):
    """FEAST: min / random-intermediate / local-max co-training with in-place distillation,
    budget-tailored sub-supernet routing and sparse aggregation."""


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
        super().__init__()
        self.dense = False  # position-wise means over the clients that hold each position
        self.cache_path, self.retarget, self.search, self.routing, self.rule = cache, retarget, search, routing, rule
        self.rho_kd, self.temperature = rho_kd, temperature
        self.mixup_alpha, self.cutmix_alpha, self.mix_schedule = mixup_alpha, cutmix_alpha, mix_schedule
        self.calib_batch_size, self.calib_transform, self.kappa = calib_batch_size, calib_transform, kappa

    # -- set-up ---------------------------------------------------------------------------------
    def check(self, train, population=None) -> None:
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
        check_population_reaches(self.cache_path, self.retarget, self.search, population)

    def largest_client_model(self, model):
        """For the memory estimate before any data (``federation/memory.py``): the bounds of the
        largest envelope a client can be routed (all cached variants') and the costliest cached
        variant, read from the cache file; None (the whole supernet) without routing or when
        the cache is searched at start."""
        from fl_lightning.elastic.envelope import envelope
        from fl_lightning.elastic.search.cache import VariantCache

        if not self.routing or self.cache_path is None:
            return None
        specs = [model.check_spec(spec) for spec in VariantCache.load(self.cache_path).specs]  # by MACs
        return envelope(specs, model.max_expansion), specs[-1]

    def prepare(self, ctx) -> None:
        from fl_lightning.algorithms.supernet import feast_accounting as accounting
        from fl_lightning.elastic.models.ofa_resnet import OFAResNet

        if not isinstance(ctx.model, OFAResNet):
            raise ConfigError("model", "FEAST trains an OFAResNet supernet")
        if not self.routing:  # FedAvg's reusable worker: routing-free FEAST trains the whole supernet in it
            super().prepare(ctx)
        self.variants = CachedVariants(ctx, self.cache_path, self.retarget, self.search, self.calib_batch_size,
                                       self.calib_transform, method="FEAST", required_by="FEAST recalibrates BN")
        self.cache, self.sets = self.variants.cache, self.variants.sets
        self.routed_params = accounting.client_routed_params(ctx.model, self.cache, self.sets)
        self.pass_macs = [accounting.pass_macs_per_example(self.cache, s, self.rule) for s in self.sets]
        # the parameter groups of the round's data-mass sums (new_accumulator)
        self.mass_group_names, self.mass_groups = parameter_groups(ctx.model)
        self._covered: Dict[object, Dict[str, tuple]] = {}  # spec -> parameter key -> its leading block
        self.variants.accounting, description = self.population_accounting()
        if ctx.fabric.is_global_zero and ctx.mode == "fit":
            print(description)

    def new_accumulator(self, plan):
        """Besides the model: per parameter group, the examples x parameters routed to clients
        and the part their rule trained."""
        acc = super().new_accumulator(plan)
        acc.declare("feast/mass", torch.zeros(2, len(self.mass_group_names)))
        return acc

    def population_accounting(self) -> Tuple[dict, str]:
        """The population's accounting (Table 2's communication, Table 7's computation, the
        parameter footprints) and its text for the console."""
        from fl_lightning.algorithms.supernet import feast_accounting as accounting
        from fl_lightning.elastic.envelope import full_param_count

        ctx = self.ctx
        summary = accounting.population_summary(self.cache, ctx.budgets.tolist(), ctx.client_sizes, self.routed_params)
        comm = accounting.communication(full_param_count(ctx.model), self.routed_params)
        compute = accounting.training_computation(self.cache, self.sets, ctx.client_sizes,
                                                  ctx.rounds, ctx.clients_per_round,
                                                  ctx.train.epochs, self.rule, kappa=self.kappa)
        footprints = accounting.parameter_footprints(ctx.model, self.cache, accounting.default_anchors(self.cache.macs))
        head = f"FEAST: {len(self.cache.specs)} cached variants, {count(self.cache.macs[0])}-" \
               f"{macs_text(self.cache.macs[-1])}, routing {'on' if self.routing else 'off'}, rule {self.rule}"
        return ({"population": summary, "communication": comm, "computation": compute, "footprints": footprints},
                head + "\n" + accounting.format_accounting(summary, comm, compute, footprints))

    # -- what it serves: the cached variants (the part, ``cached_variants.py``) -------------------
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        return self.variants.evaluate(split, batch_size)

    def report(self, summary: dict) -> str:
        return self.variants.report(summary)

    def artifacts(self) -> Dict[str, str]:
        return self.variants.artifacts()

    @property
    def served_names(self) -> Dict[str, str]:
        return self.variants.served_names()

    # -- one client -----------------------------------------------------------------------------
    def work(self, task) -> float:
        return super().work(task) * self.pass_macs[task.client]

    def route(self, task, plan) -> Routed:
        from fl_lightning.elastic.envelope import route_envelope

        if self.routing:
            return route_envelope(self.ctx.model, self.variants.specs_of(task.client))
        return super().route(task, plan)

    def new_client(self, task, plan) -> "FeastLocalClient":
        """The client's round with its affordable variants (its cached set, cost each) and the
        global minimum."""
        variants = [(self.cache.specs[j], self.cache.macs[j]) for j in self.sets[task.client]]
        settings = FeastSettings(Mixing(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha), self.rho_kd,
                                 self.temperature, self.rule, self.kappa)
        return FeastLocalClient(self.client_round(task, plan), settings, variants,
                                self.cache.specs[self.cache.global_min()])

    def commit(self, acc, task, result, plan) -> None:
        if result.model is not None:
            acc.add_sum("feast/mass", self._count_mass(result.model, result.payload, float(result.num_samples)))
        super().commit(acc, task, result, plan)

    def _count_mass(self, update, trained: set, num_samples: float) -> torch.Tensor:
        """Eq. 7 weighs every routed position by the client's examples, whether the client's
        rule trained it or not; count both masses. A position counts as trained when a variant
        the client trained covers it (the regions of its extraction: what its forward reads),
        counted from the regions' shapes on the host, so nothing waits on the device."""
        covered = [self._covered_blocks(spec) for spec in trained]
        mass = [[0.0] * len(self.mass_group_names) for _ in range(2)]
        for local_key, (global_key, region) in update.regions.items():
            group = self.mass_groups.get(global_key)
            if group is None:  # BN statistics and counters: not trained parameters
                continue
            mass[0][group] += num_samples * region.numel()
            mass[1][group] += num_samples * union_numel([c[global_key] for c in covered if global_key in c])
        return torch.tensor(mass, dtype=torch.float64)

    def _covered_blocks(self, spec) -> Dict[str, tuple]:
        """Parameter key -> the leading block of it that variant ``spec`` covers (kept per spec)."""
        if spec not in self._covered:
            regions = self.ctx.model.regions(spec)
            self._covered[spec] = {key: tuple(region.local_shape) for key, (_, region) in regions.items()
                                   if key in self.mass_groups}
        return self._covered[spec]

    def finish_round(self, acc, plan) -> Dict[str, float]:
        out = super().finish_round(acc, plan)
        routed, trained = acc["feast/mass"].double().cpu()  # one transfer per round
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
