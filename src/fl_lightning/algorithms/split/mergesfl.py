"""MergeSFL (Liao et al., ICDE 2024): split FL with feature merging and batch size regulation.

A round is ``K`` lock-stepped iterations of the whole cohort. In each, every client runs its
front on a batch of its own size ``b_i``; the server concatenates the activations into one
mixed batch, takes one step of its single server half on it and sends every client its slice
of the gradient; the clients step. Batch sizes follow the clients' speeds (so that every client
finishes an iteration at the same time) and the cohort is the candidate whose merged label
distribution is closest to the global one (feature merging's IID approximation). The fronts are
averaged weighted by the examples each processed, i.e. by ``b_i``.

The cohort trains in lock-step, so it runs on one rank (``sequential_clients``) through the
cohort hook ``fit_cohort``.
docs/sfl_baselines.md has the rules, options and departures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Sequence

import torch

from fl_lightning.algorithms.split.common import key_regions, label_counts
from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.elastic.routing import Routed
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import client_generator, derive_seed

SELECT_STREAM = 41  # seed stream of MergeSFL's candidate cohorts


def regulate_batch_sizes(speeds: Sequence[float], caps: Sequence[int], total: int, low: int = 1) -> List[int]:
    """Integer batch sizes proportional to ``speeds`` with ``low <= b_i <= caps[i]`` that sum to
    ``min(total, sum(caps))``.

    Water-filling: the shares ``total * s_i / sum s`` of the clients not yet pinned are computed;
    clients above their cap are pinned at it (else those below ``low`` at ``low``) and the rest
    is shared again. Integers by largest remainder (ties to the earlier client).
    """
    n = len(speeds)
    caps = [int(c) for c in caps]
    lows = [min(low, c) for c in caps]
    total = min(int(total), sum(caps))
    weights = [max(float(s), 0.0) for s in speeds]
    if sum(weights) <= 0:
        weights = [1.0] * n
    sizes: List[Optional[float]] = [None] * n
    while True:
        free = [i for i in range(n) if sizes[i] is None]
        if not free:
            break
        remaining = total - sum(s for s in sizes if s is not None)
        mass = sum(weights[i] for i in free)
        share = {i: remaining * weights[i] / mass if mass > 0 else remaining / len(free) for i in free}
        over = [i for i in free if share[i] > caps[i]]
        under = [i for i in free if share[i] < lows[i]]
        if over:
            for i in over:
                sizes[i] = float(caps[i])
        elif under:
            for i in under:
                sizes[i] = float(lows[i])
        else:
            for i in free:
                sizes[i] = share[i]
    floors = [max(lows[i], min(caps[i], math.floor(sizes[i]))) for i in range(n)]
    left = total - sum(floors)
    order = sorted(range(n), key=lambda i: (-(sizes[i] - math.floor(sizes[i])), i))
    for i in order:
        if left <= 0:
            break
        if floors[i] < caps[i]:
            floors[i] += 1
            left -= 1
    return floors


def merged_kl(counts: torch.Tensor, sizes: Sequence[int], reference: torch.Tensor) -> float:
    """``KL(P_mix || P_ref)`` of the merged batch's label distribution
    ``P_mix = sum_i b_i p_i / sum_i b_i`` (``p_i`` the client's label distribution)."""
    p = counts / counts.sum(dim=1, keepdim=True).clamp_min(1e-12)
    b = torch.as_tensor(list(sizes), dtype=p.dtype)
    mix = (b[:, None] * p).sum(0) / b.sum()
    seen = mix > 0
    return float((mix[seen] * (mix[seen] / reference[seen].clamp_min(1e-12)).log()).sum())


@dataclass(frozen=True)
class MergedBatch:
    """What the server chose for a MergeSFL client: its rows in each merged batch."""

    batch_size: int


class MergeSFL(SplitFed):
    """Feature merging and batch size regulation on a single server half (SplitFed V2's)."""

    def __init__(self, cut: Optional[str] = None, speeds: Literal["budget", "shard", "uniform"] = "budget",
                 total_batch: Optional[PositiveInt] = None, min_batch: PositiveInt = 2,
                 selection: Literal["kl", "uniform"] = "kl", selection_trials: PositiveInt = 64,
                 rescale_gradients: bool = True, server_lr: Optional[PositiveFloat] = None, **kwargs):
        """
        Args:
            cut: block name after which the model is split (None: the middle block boundary).
            speeds: what batch sizes are proportional to: budget (the clients' MAC budgets,
                partition.budgets, as their computing speed; shard sizes when the run has
                none), shard (shard sizes: every client covers its shard in the same number of
                iterations) or uniform (train.batch_size for everyone).
            total_batch: rows of the merged batch, sum of the cohort's batch sizes (None:
                train.batch_size times clients_per_round).
            min_batch: smallest batch size a client gets (batch norm needs two rows).
            selection: kl (of candidate cohorts, the one whose merged label distribution is
                closest to the global one in KL divergence) or uniform (the run's uniform cohort).
            selection_trials: candidate cohorts drawn per round for the kl selection.
            rescale_gradients: send each client its gradient slice times B / b_i, the gradient
                of the mean loss over its own rows (false: the raw slice of the merged mean).
            server_lr: learning rate of the server half (None: the clients' round rate).
            **kwargs: SplitFed's served-statistics options (``bn``, ...).
        """
        super().__init__(cut=cut, version="v2", server_lr=server_lr, **kwargs)
        self.speeds = speeds
        self.total_batch = total_batch
        self.min_batch = min_batch
        self.selection = selection
        self.selection_trials = selection_trials
        self.rescale_gradients = rescale_gradients

    # -- set-up ---------------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        super().prepare(ctx)
        m = ctx.clients_per_round
        self.merged_rows = self.total_batch if self.total_batch is not None else ctx.train.batch_size * m
        if self.merged_rows < m * self.min_batch:
            raise ConfigError("algorithm.total_batch", f"{self.merged_rows} rows cannot give {m} clients "
                                                       f"min_batch={self.min_batch} each")
        sizes = torch.tensor(ctx.client_sizes, dtype=torch.float64)
        if self.speeds == "budget" and ctx.budgets is not None:
            self.client_speeds = torch.as_tensor(ctx.budgets, dtype=torch.float64).cpu()
        elif self.speeds in ("budget", "shard"):
            self.client_speeds = sizes
        else:
            self.client_speeds = torch.ones_like(sizes)
        data = ctx.data
        self.counts = label_counts(data.bundle.train_targets, data.clients, ctx.num_classes)
        total = self.counts.sum(0)
        self.reference = total / total.sum()
        self.slots: List[torch.nn.Module] = []

    # -- the plan -------------------------------------------------------------------------------
    def batch_sizes(self, cohort: Sequence[int]) -> List[int]:
        """The cohort's batch sizes (``regulate_batch_sizes`` on its speeds, capped by shard sizes)."""
        sizes = self.ctx.client_sizes
        return regulate_batch_sizes([float(self.client_speeds[c]) for c in cohort], [sizes[c] for c in cohort],
                                    self.merged_rows, self.min_batch)

    def plan(self, round_idx: int) -> RoundPlan:
        ctx = self.ctx
        cohort = self.selector.cohort(round_idx)
        best, best_kl = cohort, merged_kl(self.counts[cohort], self.batch_sizes(cohort), self.reference)
        if self.selection == "kl":
            generator = torch.Generator().manual_seed(derive_seed(ctx.seed, SELECT_STREAM, round_idx))
            for _ in range(self.selection_trials - 1):
                draw = torch.randperm(ctx.num_clients, generator=generator)[:ctx.clients_per_round]
                candidate = sorted(draw.tolist())
                kl = merged_kl(self.counts[candidate], self.batch_sizes(candidate), self.reference)
                if kl < best_kl:
                    best, best_kl = candidate, kl
        tasks = [ClientTask(c, cut=self.cut, choice=MergedBatch(b))
                 for c, b in zip(best, self.batch_sizes(best))]
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def iterations(self, plan: RoundPlan) -> int:
        """Lock-stepped iterations of the round: ``train.steps``, else ``epochs`` times the merged
        batches that cover the cohort's examples once, ``ceil(sum n_i / sum b_i)``."""
        t = self.ctx.train
        if t.steps:
            return t.steps
        examples = sum(self.ctx.client_sizes[task.client] for task in plan.tasks)
        rows = sum(task.choice.batch_size for task in plan.tasks)
        return t.epochs * math.ceil(examples / rows)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)
        figures["merge/kl"] = merged_kl(self.counts[plan.cohort], [t.choice.batch_size for t in plan.tasks],
                                        self.reference)
        return figures

    # -- the lock-stepped cohort ----------------------------------------------------------------
    def fit_cohort(self, plan: RoundPlan, owned):
        """The whole cohort in lock-step (it runs on one rank), then each client's uplink."""
        if not owned:
            return
        results = self._fit_cohort(plan)
        for task in owned:
            yield task, results[task.client]

    def _fit_cohort(self, plan: RoundPlan) -> Dict[int, Uplink]:
        from fl_lightning.modules.split import SplitFit
        from fl_lightning.modules.split_variants import merged_step
        from fl_lightning.runtime.client_data import ClientData

        ctx, tasks = self.ctx, plan.tasks
        while len(self.slots) < len(tasks):  # one client model per cohort member: they train at once
            self.slots.append(ctx.make_model().to(ctx.fabric.device))
        pairs, streams, fits, channels = [], [], [], []
        steps = self.iterations(plan)
        for i, (slot, task) in enumerate(zip(self.slots, tasks)):
            shared = pairs[0].server_optimizer if pairs else None
            client = self.new_client(task, plan)
            self.engine.load_front(slot, self.global_state, task.cut)  # each client its own front, one server half
            if i == 0:
                self.engine.load_back(self.global_state, task.cut)
                self.engine.load_momentum()
            channels.append(Channel())
            channels[-1].deliver(Downlink(Routed(slot, key_regions(self.global_state,
                                                                   self.engine.exchanged(self.halves.front(task.cut))))))
            pairs.append(self.engine.build_pair(client, slot, server_optimizer=shared))
            shard = ctx.shards[task.client]
            data = ClientData(shard.dataset, shard.indices, task.choice.batch_size, shard.device,
                              shard.num_workers)
            streams.append(data.steps(steps, client_generator(ctx.seed, plan.round_idx, task.client)))
            fits.append(SplitFit(0))
        head = pairs[0]
        losses = []
        for _ in range(steps):
            step = merged_step(ctx.fabric, pairs, head.server_loss, head.server_optimizer, head.server_module,
                               [next(s) for s in streams], fits, ctx.train, rescale=self.rescale_gradients)
            losses.append(step.loss)
            rows = sum(step.sizes)
            for fit, n, seconds in zip(fits, step.sizes, step.client_seconds):
                fit.examples += n
                fit.num_samples += n
                fit.client_seconds += seconds
                fit.server_seconds += step.server_seconds * n / rows  # the shared step, by rows
        self.engine.stash_momentum(head.server_optimizer)
        loss = sum(losses) / len(losses) if losses else 0.0
        results = {}
        for fit, slot, task, channel in zip(fits, self.slots, tasks, channels):
            fit.steps, fit.loss = steps, loss
            fit.seconds = fit.client_seconds + fit.server_seconds
            result = channel.collect(self.engine.result(task, fit, module=slot))
            result.metrics["batch_size"] = task.choice.batch_size
            results[task.client] = result
        return results
