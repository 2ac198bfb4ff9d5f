"""SuperFedNAS and DeepFedNAS transferred to FEAST's shared model space (FEAST Table 3, Supp. E.2).

Both keep their originals' round structure (SuperFedNAS's ``TS_all_random`` and DeepFedNAS's
``TS_optimal_path`` samplers with MaxNet's ``maxnet_cos_all_subnet`` aggregation):

- roles, MaxNet's tracking sandwich: the cohort client that has trained the largest
  architecture fewest times trains the largest one (the "max role"), the remaining client that
  has trained the smallest fewest times trains the smallest one, every other client draws one
  architecture from the method's sampler;
- sampler of the other clients: SuperFedNAS draws uniformly from the whole architecture space
  (constrained: uniformly from the architectures within the client's budget, by rejection);
  DeepFedNAS draws uniformly from its Pareto path: unconstrained, a path over the complete
  supernet (one fitness-optimal architecture per equidistant MAC target from the smallest
  architecture's MACs to the largest's, FEAST Supp. E.2 "the complete expanded supernet");
  constrained, the cached variants the client affords;
- each client trains its one extracted subnet (``modules/single_architecture.py``) and returns
  it; the server aggregates with MaxNet's overlap-aware weights, the max role weighing
  ``c(t)`` (cosine from 0.9 to 0.125) and the others ``(1 - c(t)) / (K - 1)``
  (``elastic/maxnet.py``).

Evaluation is FEAST's (through :class:`~fl_lightning.algorithms.supernet.cached_variants.CachedVariants`,
as FEAST's own): every cached variant extracted, BN-recalibrated on the server's calibration
split and scored, and the population accuracy under largest-affordable serving, so the numbers sit next to FEAST's.
docs/fednas_transfers.md gives the originals' rules, how each is realized, and the doubts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Literal, Optional, Sequence, Tuple

import numpy as np
import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.mixing import Mixing
from fl_lightning.algorithms.supernet.cached_variants import (CachedVariants, CacheSearch, check_cache_options,
                                                             check_population_reaches)
from fl_lightning.elastic.maxnet import MAXNET_FINAL, MAXNET_INIT, maxnet_coefficient, maxnet_weights
from fl_lightning.elastic.routing import Routed
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import (KAPPA_FB, SEARCH_GENERATIONS, SEARCH_MUTATION, SEARCH_POPULATION,
                                         extraction_rho)
from fl_lightning.option_types import ClosedUnitInterval, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, UnitFraction, number_type
from fl_lightning.runtime.kept_state import KeptAttributes
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed
from fl_lightning.units import count, macs as macs_text

# seed streams of the architecture draws and of Mixup/CutMix, keyed by (seed, stream, round, client)
ARCH_STREAM, MIX_STREAM = 51, 52
MAX_DRAWS = 1 << 20
"""Rejection-sampling draws per client and round before SuperFedNAS falls back to the cache."""
REJECTION_BATCH = 1024

Role = Literal["max", "min", "random"]
MixSchedule = Literal["alternate", "random", "mixup", "cutmix", "none"]


@dataclass(frozen=True)
class SandwichChoice:
    """What the server chose for a FedNAS-transfer client: its sandwich role, MaxNet weight, the MACs of its
    architecture, which tracking count it feeds, and whether its draw fell back to the cache."""

    role: Role
    maxnet_weight: float
    macs: float
    track: Optional[Literal["largest", "smallest"]]
    fell_back: bool


def sandwich_roles(cohort: Sequence[int], largest: Sequence[int],
                   smallest: Sequence[int]) -> Tuple[Optional[int], Optional[int]]:
    """MaxNet's tracking sandwich (the originals' ``update_sample`` with one max and one min
    client): ``(max client, min client)``.

    The max client is the cohort member that has trained the largest architecture fewest times
    (``largest[c]``), the min client the member of the rest that has trained the smallest
    fewest times; ties go to the earlier client in cohort order (here: the lower id). A cohort
    of one has no min client.
    """
    if not cohort:
        return None, None
    max_client = min(range(len(cohort)), key=lambda i: (largest[cohort[i]], i))
    rest = [i for i in range(len(cohort)) if i != max_client]
    min_client = min(rest, key=lambda i: (smallest[cohort[i]], i)) if rest else None
    return cohort[max_client], (cohort[min_client] if min_client is not None else None)


def uniform_genomes(cost, generator: torch.Generator, n: int) -> np.ndarray:
    """``n`` genomes drawn independently and uniformly, every gene uniform over its choices
    (the originals' ``random_subnet_arch``: depth, expansion and width drawn independently)."""
    upper = torch.as_tensor(np.asarray(cost.upper), dtype=torch.float64)
    draws = torch.rand(n, len(upper), generator=generator, dtype=torch.float64)
    genes = torch.minimum((draws * (upper + 1)).floor(), upper)
    return genes.long().numpy()


def uniform_architecture(cost, generator: torch.Generator, budget: Optional[float] = None,
                         max_draws: int = MAX_DRAWS, batch: int = REJECTION_BATCH):
    """A uniformly random architecture of the space, or (``budget``) a uniformly random one
    among those with ``MACs <= budget``: the first affordable one of a stream of uniform draws
    (rejection sampling, exact). None if ``max_draws`` draws found none."""
    if budget is None:
        return cost.decode(uniform_genomes(cost, generator, 1)[0])
    drawn = 0
    while drawn < max_draws:
        n = min(batch, max_draws - drawn)
        genes = uniform_genomes(cost, generator, n)
        ok = np.flatnonzero(cost.macs(genes) <= budget)
        if ok.size:
            return cost.decode(genes[ok[0]])
        drawn += n
    return None


@dataclass
class PathSearch:
    """How unconstrained DeepFedNAS's Pareto path over the complete supernet is built (the
    DeepFedNAS cache generator's equidistant targets between the supernet's absolute MAC
    bounds, one genetic search per target)."""

    targets: number_type(int, ge=2) = 60
    """MAC targets from the smallest architecture's MACs to the largest's, both included
    (DeepFedNAS's ``run_subnet_cache_generation.sh``: ``--num_samples 60``)."""
    population: number_type(int, ge=2) = SEARCH_POPULATION
    """Genetic-search population per target (DeepFedNAS's script: 256)."""
    generations: PositiveInt = SEARCH_GENERATIONS
    """Genetic-search generations per target (DeepFedNAS's script: 512)."""
    mutation: ClosedUnitInterval = SEARCH_MUTATION
    """Mutation probability."""
    seed: NonNegativeInt = 0
    """Search seed (target ``k`` is searched with ``seed + k``)."""
    rho: Optional[PositiveFloat] = None
    """Effectiveness ceiling rho_0 of every target; null: FEAST's cache ceilings (0.40 below
    50M MACs, 0.31 above, Supp. B.1 / E.3)."""


def pareto_path(model, input_shape, settings: PathSearch = PathSearch()):
    """DeepFedNAS's Pareto path over the complete supernet, a MAC-sorted
    :class:`~fl_lightning.elastic.search.cache.VariantCache`.

    Targets: ``settings.targets`` equidistant MAC values from the supernet's smallest
    architecture's MACs to its largest's. The two ends are those architectures themselves (the
    complete space's extremes, which the min and max roles train); every interior target gets
    the fitness-optimal architecture with ``MACs <= target`` and effectiveness at most
    ``settings.rho`` (default FEAST's cache ceiling at that budget: 0.40 below 50M, 0.31 above); a target whose search finds no
    feasible architecture is left out (as the DeepFedNAS generator leaves out a failed job), and
    an architecture found twice is kept once."""
    from fl_lightning.elastic.search.cache import Variant, VariantCache, segment_targets
    from fl_lightning.elastic.search.cost import cost_model
    from fl_lightning.elastic.search.genetic import InfeasibleError, search

    cost = cost_model(model, input_shape)
    low, high = model.min_spec(), model.max_spec()
    targets = segment_targets(cost.spec_macs(low), cost.spec_macs(high), settings.targets)
    found: Dict[object, object] = {}

    def keep(spec, info):
        found.setdefault(spec, Variant(spec, cost.spec_macs(spec), cost.spec_params(spec), info))

    keep(low, {"target": round(targets[0]), "end": "smallest"})
    for k, target in enumerate(targets[1:-1], start=1):
        rho = settings.rho if settings.rho is not None else extraction_rho(target)
        try:
            spec, _, fit = search(model, target, rho, settings.population, settings.generations,
                                  settings.mutation, seed=settings.seed + k, input_shape=cost.input_shape)
        except InfeasibleError:
            continue
        keep(spec, {"target": round(target), "rho_limit": rho, "fitness": round(fit, 4)})
    keep(high, {"target": round(targets[-1]), "end": "largest"})
    provenance = {"path": "complete supernet", "targets": len(targets), "population": settings.population,
                  "generations": settings.generations, "mutation": settings.mutation, "seed": settings.seed,
                  "rho": settings.rho}
    return VariantCache(list(found.values()), cost.input_shape, cost.num_classes, cost.model_options, provenance)


def _generator(stream: int, seed: int, round_idx: int, client: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, stream, round_idx, client))


class ArchitectureClient(LocalClient):
    """A transfer's client: local training of its subnet (``task.spec``, its forward MACs
    ``task.choice.macs``), Mixup / CutMix when asked, batch norm frozen when asked; it reports
    its training MACs (forward passes times ``kappa``)."""

    def __init__(self, round: ClientRound, mixing: Mixing, frozen_bn: bool, kappa: float):
        super().__init__(round)
        self.mixing, self.frozen_bn, self.kappa = mixing, frozen_bn, kappa

    def objective(self, downlink):
        from fl_lightning.modules.mixing import AlternatingMixer
        from fl_lightning.modules.single_architecture import SingleArchitectureClient

        r, m = self.round, self.mixing
        mixer = None
        if m.schedule != "none":
            mixer = AlternatingMixer(r.num_classes, m.mixup_alpha, m.cutmix_alpha, schedule=m.schedule,
                                     generator=_generator(MIX_STREAM, r.seed, r.round_idx, r.client))
        return SingleArchitectureClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay,
                                        macs=self.task.choice.macs, mixer=mixer, frozen_bn=self.frozen_bn)

    def uplink(self, downlink, module, fit):
        return self.result(downlink, fit, model=downlink.model,
                           figures={"train_macs": float(module.forward_macs()) * self.kappa})


class _FedNASTransfer(FedAvg):
    """The shared round of the SuperFedNAS / DeepFedNAS transfers; subclasses choose the
    architectures (:meth:`architecture`, :meth:`global_extremes`)."""

    method = ""

    def __init__(self, constrained: bool = False, cache: Optional[str] = None, retarget: bool = False,
                 search: CacheSearch = CacheSearch(), maxnet_init: UnitFraction = MAXNET_INIT,
                 maxnet_final: UnitFraction = MAXNET_FINAL, maxnet_steps: Optional[PositiveInt] = None,
                 mixup_alpha: NonNegativeFloat = 0.4, cutmix_alpha: NonNegativeFloat = 1.0,
                 mix_schedule: MixSchedule = "alternate", calib_batch_size: PositiveInt = CALIB_BATCH_SIZE,
                 calib_transform: Literal["train", "eval"] = "train", kappa: PositiveFloat = KAPPA_FB,
                 frozen_bn: bool = False):
        """
        Args:
            constrained: the budget-constrained variant of Table 3: every client trains only
                architectures within its MAC budget (the max role its largest affordable cached
                variant); false samples from the complete supernet whatever the budgets
                (SuperFedNAS: uniform architectures; DeepFedNAS: its Pareto path over the
                whole space).
            cache: JSON file of cached variants: the evaluated operating points (FEAST's, so
                the numbers compare) and constrained DeepFedNAS's Pareto path; built by the genetic search
                below and saved to the run directory when not given.
            retarget: reuse the cache file's architectures with MACs recomputed for this model
                and input (as FEAST does on TinyImageNet).
            search: genetic-search settings used when no cache file is given.
            maxnet_init: MaxNet coefficient c(0), the max-role client's aggregation weight in
                round 0 (0.9: FEAST Supp. E.2, DeepFedNAS's scripts).
            maxnet_final: MaxNet coefficient once annealed (0.125: same sources).
            maxnet_steps: rounds of the cosine anneal, after which c stays at maxnet_final;
                null: rounds - 1, so c reaches maxnet_final at the last round (DeepFedNAS's
                scripts use 0.8 x rounds: 1600 of 2000, 1200 of 1500).
            mixup_alpha: Mixup's Beta parameter (FEAST's canonical augmentation; 0 disables).
            cutmix_alpha: CutMix's Beta parameter (0 disables).
            mix_schedule: how Mixup and CutMix alternate: alternate (even / odd batches),
                random (a fair coin per batch, DeepFedNAS's code), mixup, cutmix, or none.
            calib_batch_size: batch size of BN recalibration on the server's calibration split.
            calib_transform: image-level transform of the calibration images: train (drawn
                once with a fixed seed, as FEAST) or eval (none).
            kappa: forward-plus-backward factor of the reported training MACs (FEAST Eq. 26).
            frozen_bn: clients hold every batch norm at the identity (weight 1, bias 0,
                statistics 0 and 1, evaluation mode, not trained), as the originals'
                ``SubnetTrainer`` does unless ``--use_bn`` is given (no published command gives
                it); false trains batch norm, FEAST's client (docs/fednas_transfers.md).
        """
        super().__init__()
        self.dense = False  # position-wise means over the clients that hold each position
        self.frozen_bn = frozen_bn
        self.cache_path, self.retarget, self.search = cache, retarget, search
        self.mixup_alpha, self.cutmix_alpha, self.mix_schedule = mixup_alpha, cutmix_alpha, mix_schedule
        self.calib_batch_size, self.calib_transform, self.kappa = calib_batch_size, calib_transform, kappa
        self.constrained = constrained
        self.maxnet_init, self.maxnet_final, self.maxnet_steps = maxnet_init, maxnet_final, maxnet_steps

    # -- set-up ---------------------------------------------------------------------------------
    def check(self, train, population=None) -> None:
        from fl_lightning.modules.mixing import mixing_checks

        for key, ok, problem in mixing_checks(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha):
            if not ok:
                raise ConfigError(f"algorithm.{key}", f"{problem}, got {getattr(self, key)!r}")
        check_cache_options(self.cache_path, self.search)
        check_population_reaches(self.cache_path, self.retarget, self.search, population)

    def prepare(self, ctx) -> None:
        from fl_lightning.elastic.models.ofa_resnet import OFAResNet
        from fl_lightning.elastic.search.cost import cost_model

        if not isinstance(ctx.model, OFAResNet):
            raise ConfigError("model", f"{self.method} trains an OFAResNet supernet")
        super().prepare(ctx)
        self.variants = CachedVariants(ctx, self.cache_path, self.retarget, self.search, self.calib_batch_size,
                                       self.calib_transform, method=self.method,
                                       required_by=f"{self.method} is evaluated as FEAST, recalibrating BN")
        self.cache, self.sets = self.variants.cache, self.variants.sets
        # the cache's (and budgets') MAC convention
        self.cost = cost_model(ctx.model, self.variants.input_shape)
        self.budgets = [float(b) for b in ctx.budgets.tolist()]
        self.check_population()
        self.steps = self.maxnet_steps if self.maxnet_steps is not None else max(ctx.rounds - 1, 1)
        self.largest = torch.zeros(ctx.num_clients, dtype=torch.int64)
        self.smallest = torch.zeros(ctx.num_clients, dtype=torch.int64)
        # how often each client trained the largest / smallest architecture: the next rounds' roles
        self.keep(KeptAttributes(self, {"tracking/largest": "largest", "tracking/smallest": "smallest"}, torch.int64))
        self.variants.accounting, description = self.population_accounting()
        if ctx.fabric.is_global_zero and ctx.mode == "fit":
            print(description)

    def check_population(self) -> None:
        """Refuse a population the sampler cannot serve (subclasses)."""

    def population_accounting(self) -> Tuple[dict, str]:
        """The population's figures (affordable sets, budgets, shards) and the sampler's, and
        their text for the console."""
        counts = [len(s) for s in self.sets]
        sizes = self.ctx.client_sizes
        accounting = {
            "method": self.method,
            "constrained": self.constrained,
            "population": {"clients": len(self.sets), "afford_1": sum(c == 1 for c in counts),
                           "afford_2": sum(c == 2 for c in counts), "afford_3_or_more": sum(c >= 3 for c in counts),
                           "budget_min": min(self.budgets), "budget_max": max(self.budgets),
                           "shard_sizes": {"min": int(min(sizes)), "median": float(np.median(sizes)),
                                           "max": int(max(sizes))}},
            "maxnet": {"init": self.maxnet_init, "final": self.maxnet_final, "steps": self.steps},
            "sampler": self.sampler_description(),
        }
        a = accounting["population"]
        return accounting, (
            f"{self.method} ({'budget-constrained' if self.constrained else 'unconstrained'}): "
            f"{self.sampler_description()}; MaxNet coefficient {self.maxnet_init:g} -> {self.maxnet_final:g} "
            f"(cosine over {self.steps} rounds)\nevaluation: {len(self.cache.specs)} cached variants, "
            f"{count(self.cache.macs[0])}-{macs_text(self.cache.macs[-1])}; clients affording 1 / 2 / 3+ "
            f"cached variants: {a['afford_1']} / {a['afford_2']} / {a['afford_3_or_more']}")

    # -- what it serves: the cached variants, as FEAST (the part, ``cached_variants.py``) ---------
    def evaluate(self, split: str, batch_size: int) -> Dict[str, float]:
        return self.variants.evaluate(split, batch_size)

    def report(self, summary: dict) -> str:
        return self.variants.report(summary)

    def artifacts(self) -> Dict[str, str]:
        return self.variants.artifacts()

    @property
    def served_names(self) -> Dict[str, str]:
        return self.variants.served_names()

    def sampler_description(self) -> str:
        raise NotImplementedError

    # -- architectures --------------------------------------------------------------------------
    def global_extremes(self) -> Tuple[object, object]:
        """The sampler's largest and smallest architectures (what the tracking counts)."""
        raise NotImplementedError

    def architecture(self, role: Role, client: int, round_idx: int) -> Tuple[object, bool]:
        """``(spec, fell_back)`` for one client of one round."""
        raise NotImplementedError

    def coefficient(self, round_idx: int) -> float:
        """MaxNet's ``c(t)``."""
        return maxnet_coefficient(round_idx, self.steps, self.maxnet_init, self.maxnet_final)

    # -- a round --------------------------------------------------------------------------------
    def plan(self, round_idx: int) -> RoundPlan:
        """The cohort (FEAST's uniform sample), the sandwich roles from the tracking counts, one
        architecture and one MaxNet weight per client. Pure: the counts change in
        :meth:`finish_round`, so every rank plans the same round."""
        cohort = self.selector.cohort(round_idx)
        max_client, min_client = sandwich_roles(cohort, self.largest.tolist(), self.smallest.tolist())
        c = self.coefficient(round_idx)
        weights = maxnet_weights(len(cohort), cohort.index(max_client) if max_client is not None else None, c)
        top, bottom = self.global_extremes()
        tasks = []
        for client, weight in zip(cohort, weights):
            role: Role = "max" if client == max_client else "min" if client == min_client else "random"
            spec, fell_back = self.architecture(role, client, round_idx)
            track = "largest" if role == "max" or (role == "random" and spec == top) else \
                "smallest" if role == "min" or (role == "random" and spec == bottom) else None
            tasks.append(ClientTask(client, spec=spec, choice=SandwichChoice(
                role=role, maxnet_weight=weight, macs=self.cost.spec_macs(spec), track=track, fell_back=fell_back)))
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def route(self, task: ClientTask, plan: RoundPlan) -> Routed:
        """The client's subnet only (the originals' ``get_active_subnet``): a plain module with
        copies of its leading slices, and the map back."""
        return self.ctx.model.extract(task.spec)

    def new_client(self, task: ClientTask, plan: RoundPlan) -> ArchitectureClient:
        return ArchitectureClient(self.client_round(task, plan),
                                  Mixing(self.mix_schedule, self.mixup_alpha, self.cutmix_alpha), self.frozen_bn,
                                  self.kappa)

    def work(self, task: ClientTask) -> float:
        return super().work(task) * task.choice.macs

    def client_figures(self, task: ClientTask, result, plan: RoundPlan) -> Dict[str, float]:
        o = task.choice
        return {"role": o.role, "arch": str(task.spec), "arch_macs": o.macs,
                "maxnet_weight": o.maxnet_weight, "arch_fallback": int(o.fell_back)}

    def commit(self, acc, task: ClientTask, result, plan: RoundPlan) -> None:
        """MaxNet weighting: the client's slices enter the position-wise mean with its MaxNet
        weight (not its sample count)."""
        if result.model is not None:
            acc.add(result.model.module.state_dict(), float(task.choice.maxnet_weight), result.model.regions)

    def finish_round(self, acc, plan: RoundPlan) -> Dict[str, float]:
        super().finish_round(acc, plan)
        self.track(plan)
        return {"maxnet_coefficient": self.coefficient(plan.round_idx)}

    def track(self, plan: RoundPlan) -> None:
        """Count who trained the largest / smallest architecture this round (the originals'
        ``cli_subnet_track``). Every rank holds the whole plan, so the counts agree."""
        for task in plan.tasks:
            if task.choice.track == "largest":
                self.largest[task.client] += 1
            elif task.choice.track == "smallest":
                self.smallest[task.client] += 1


class SuperFedNAS(_FedNASTransfer):
    """SuperFedNAS (Khare et al., ECCV 2024) transferred to FEAST's supernet: MaxNet's tracking
    sandwich with uniformly random architectures of the whole space for the other clients
    (``TS_all_random``), MaxNet aggregation.

    Constrained: the other clients' architectures are uniform among those within the client's
    budget (rejection sampling; a client for which ``MAX_DRAWS`` draws find none falls back to
    a uniform draw from its affordable cached variants, logged as ``arch_fallback``); the max role
    trains the client's largest affordable cached variant; the min role the space's smallest
    architecture (every client must afford it).
    """

    method = "SuperFedNAS"

    def sampler_description(self) -> str:
        where = "within each client's budget (rejection sampling)" if self.constrained else "of the whole supernet"
        return f"uniformly random architectures {where}, tracking sandwich (max / min roles)"

    def check_population(self) -> None:
        smallest = self.cost.spec_macs(self.ctx.model.min_spec())
        if self.constrained and min(self.budgets) < smallest:
            poorest = int(np.argmin(self.budgets))
            raise ConfigError("partition.budgets.b_min",
                              f"client {poorest}'s budget {macs_text(self.budgets[poorest])} is below the "
                              f"supernet's smallest architecture ({macs_text(smallest)}), the min role's")

    def global_extremes(self):
        model = self.ctx.model
        return model.max_spec(), model.min_spec()

    def architecture(self, role: Role, client: int, round_idx: int):
        model = self.ctx.model
        if role == "max":
            return (self.cache.specs[self.sets[client][-1]] if self.constrained else model.max_spec()), False
        if role == "min":
            return model.min_spec(), False
        generator = _generator(ARCH_STREAM, self.ctx.seed, round_idx, client)
        spec = uniform_architecture(self.cost, generator, self.budgets[client] if self.constrained else None)
        if spec is not None:
            return model.check_spec(spec), False
        pool = self.sets[client]
        return self.cache.specs[pool[int(torch.randint(len(pool), (1,), generator=generator))]], True


class DeepFedNAS(_FedNASTransfer):
    """DeepFedNAS (Khan and Daneshtalab, 2026) transferred to FEAST's supernet: MaxNet's tracking
    sandwich on its Pareto path (``TS_optimal_path``): the max role trains the path's last
    (most expensive) architecture, the min role its first, every other client one path
    architecture drawn uniformly; MaxNet aggregation.

    Unconstrained, the path covers the complete supernet (FEAST Supp. E.2: the unconstrained
    variants "sample from the complete expanded supernet"): :func:`pareto_path`, from the
    smallest architecture to the largest, built with ``path`` at set-up (``path.json`` in the
    run directory). Constrained: the path is the variant cache; the max role trains the
    client's largest affordable cached variant and the others draw uniformly from the cached
    variants the client affords (the min role's smallest cached variant is affordable by every
    client).
    """

    method = "DeepFedNAS"

    def __init__(self, constrained: bool = False, cache: Optional[str] = None, retarget: bool = False,
                 search: CacheSearch = CacheSearch(), path: PathSearch = PathSearch(),
                 maxnet_init: UnitFraction = MAXNET_INIT, maxnet_final: UnitFraction = MAXNET_FINAL,
                 maxnet_steps: Optional[PositiveInt] = None, mixup_alpha: NonNegativeFloat = 0.4,
                 cutmix_alpha: NonNegativeFloat = 1.0, mix_schedule: MixSchedule = "alternate",
                 calib_batch_size: PositiveInt = CALIB_BATCH_SIZE, calib_transform: Literal["train", "eval"] = "train",
                 kappa: PositiveFloat = KAPPA_FB, frozen_bn: bool = False):
        """
        Args:
            constrained: the budget-constrained variant of Table 3 (the path is then the
                variant cache, restricted to what each client affords); false: the path over
                the complete supernet, whatever the budgets.
            cache: JSON file of cached variants (the evaluated operating points, FEAST's);
                built by ``search`` and saved to the run directory when not given.
            retarget: reuse the cache file's architectures with MACs recomputed for this model.
            search: genetic-search settings of the variant cache when no cache file is given.
            path: genetic-search settings of the unconstrained variant's Pareto path over the
                complete supernet (unused when constrained).
            maxnet_init: MaxNet coefficient c(0) (0.9).
            maxnet_final: MaxNet coefficient once annealed (0.125).
            maxnet_steps: rounds of the cosine anneal; null: rounds - 1.
            mixup_alpha: Mixup's Beta parameter (0 disables).
            cutmix_alpha: CutMix's Beta parameter (0 disables).
            mix_schedule: how Mixup and CutMix alternate (alternate, random, mixup, cutmix, none).
            calib_batch_size: batch size of BN recalibration on the server's calibration split.
            calib_transform: image-level transform of the calibration images (train or eval).
            kappa: forward-plus-backward factor of the reported training MACs (FEAST Eq. 26).
            frozen_bn: clients hold every batch norm at the identity (the originals' client
                without ``--use_bn``); false trains it (FEAST's client).
        """
        super().__init__(constrained=constrained, cache=cache, retarget=retarget, search=search,
                         maxnet_init=maxnet_init, maxnet_final=maxnet_final, maxnet_steps=maxnet_steps,
                         mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, mix_schedule=mix_schedule,
                         calib_batch_size=calib_batch_size, calib_transform=calib_transform, kappa=kappa,
                         frozen_bn=frozen_bn)
        self.path_search = path

    def prepare(self, ctx) -> None:
        self.path = None
        if not self.constrained:
            from fl_lightning.elastic.search.cache import VariantCache

            saved = Path(ctx.run_dir) / "path.json"
            if ctx.resuming and saved.is_file():  # a resumed run samples the path it started with
                self.path = VariantCache.load(saved, ctx.model)
            else:
                self.path = pareto_path(ctx.model, tuple(ctx.data.bundle.input_shape), self.path_search)
        super().prepare(ctx)

    def artifacts(self) -> Dict[str, str]:
        files = super().artifacts()
        if self.path is not None:
            files["path.json"] = json.dumps(self.path.to_dict(), indent=2)
        return files

    def sampler_description(self) -> str:
        if self.constrained:
            return ("uniform draws from each client's affordable cached variants (the Pareto path), "
                    "tracking sandwich (max / min roles)")
        return (f"uniform draws from a Pareto path over the complete supernet ({len(self.path.specs)} architectures, "
                f"{count(self.path.macs[0])}-{macs_text(self.path.macs[-1])}), tracking sandwich "
                f"(max / min roles)")

    def global_extremes(self):
        if self.constrained:
            return self.cache.specs[-1], self.cache.specs[0]
        return self.path.specs[-1], self.path.specs[0]

    def architecture(self, role: Role, client: int, round_idx: int):
        if self.constrained:
            specs, pool, smallest = self.cache.specs, self.sets[client], self.cache.global_min()
        else:
            specs, pool, smallest = self.path.specs, range(len(self.path.specs)), 0
        if role == "max":
            return specs[pool[-1]], False
        if role == "min":
            return specs[smallest], False
        generator = _generator(ARCH_STREAM, self.ctx.seed, round_idx, client)
        return specs[pool[int(torch.randint(len(pool), (1,), generator=generator))]], False
