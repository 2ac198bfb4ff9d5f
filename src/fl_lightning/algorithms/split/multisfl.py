"""MultiSFL (Xia et al., AAAI 2025): multi-model aggregation and knowledge replay.

The server keeps ``N = clients_per_round`` branch models (each a whole model: a client portion
and a server portion) besides the master model (the global model, which is what is evaluated).
Each round every branch is trained by one client of the cohort (a seeded random one-to-one
assignment), continuing from the branch's own state: split training as SplitFed V1, with the
server portion also seeing replayed activations of assistant devices that hold the classes the
branch has seen least (knowledge replay). Then

- the master becomes the plain mean of the branches (multi-model aggregation), and
- every branch is pulled toward the master, ``theta_b <- theta_b + pull (theta_master - theta_b)``
  (weak aggregation; ``pull = 1/11``, the authors' code's weights 1 and 10).

The branch models, the branches' label statistics and the assignment are all server state,
checkpointed. docs/sfl_baselines.md has the rules, every coefficient and the departures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from fl_lightning.algorithms.split.common import SplitClient, key_regions, label_counts
from fl_lightning.algorithms.split.splitfed import SplitFed
from fl_lightning.elastic.routing import load_routed_state
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import ClosedUnitInterval, PositiveFloat
from fl_lightning.runtime.channel import DOWN, UP, Channel, state_bytes
from fl_lightning.runtime.kept_state import KeptAttributes, KeptTensors
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.seeding import derive_seed

# seed streams: branch assignment, assistant selection and sampling, replay chunk order
ASSIGN_STREAM, REPLAY_STREAM, CHUNK_STREAM = 43, 44, 45
WEAK_PULL = 1.0 / 11.0  # the authors' code: branch <- (1 * master + 10 * branch) / 11


def weak_aggregate(branch: Dict[str, torch.Tensor], master: Dict[str, torch.Tensor], pull: float) -> None:
    """``branch <- branch + pull (master - branch)`` in place, floating tensors only (integer
    buffers, batch norm's step counters, stay the branch's)."""
    with torch.no_grad():
        for key, value in branch.items():
            if value.is_floating_point():
                value.add_(master[key].to(value.dtype) - value, alpha=pull)


def decayed_distribution(distribution: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                         decay: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """A branch's label statistic after one more client, as the authors' code updates it:
    ``W <- decay W + 1``, ``D <- (decay D + n_c) / W`` (``n_c`` the client's label counts)."""
    weight = decay * weight + 1.0
    return (decay * distribution + counts) / weight, weight


def replay_requirement(distribution: torch.Tensor, client_examples: int, budget: float) -> torch.Tensor:
    """Examples of each class to replay for a branch: ``R = max(C, floor(budget n_c))`` shared
    over the classes below the mean of ``D`` in proportion to their deficit
    ``max(mean(D) - D_k, 0)``, rounded down."""
    classes = distribution.numel()
    total = max(classes, int(client_examples * budget))
    deficit = (distribution.mean() - distribution).clamp_min(0)
    if deficit.sum() <= 0:
        return torch.zeros(classes, dtype=torch.long)
    return torch.floor(total * deficit / deficit.sum()).to(torch.long)


def choose_assistants(requirement: torch.Tensor, counts: torch.Tensor, client: int,
                      generator: torch.Generator) -> List[Tuple[int, torch.Tensor]]:
    """Assistant devices in a random order of the other clients, each giving
    ``min(its class count, what is still required)`` of every class until nothing is."""
    need = requirement.clone()
    order = [c for c in torch.randperm(counts.shape[0], generator=generator).tolist() if c != client]
    chosen = []
    for helper in order:
        if need.sum() <= 0:
            break
        give = torch.minimum(counts[helper].to(torch.long), need)
        if give.sum() > 0:
            chosen.append((helper, give))
            need -= give
    return chosen


@dataclass(frozen=True)
class Branch:
    """What the server chose for a MultiSFL client: the branch model it trains this round."""

    branch: int


@dataclass(frozen=True)
class BranchRound:
    """What the server gives a MultiSFL client for its round: its branch's tensors and the keys
    of their client portion, the index of its cut among the candidates, the worker its front
    trains in, the assistant devices' replay (dataset indices, how many assistants) and the
    rank's helper worker that computes the replayed activations."""

    state: Dict[str, torch.Tensor]
    front_keys: List[str]
    cut_index: int
    front_worker: torch.nn.Module
    replay: Optional[Tuple[torch.Tensor, int]]
    """None without knowledge replay."""
    helper_worker: torch.nn.Module


class BranchClient(SplitClient):
    """A MultiSFL client's round: split training of its assigned branch (not the master), the
    server portion also stepping on replayed activations of the assistant devices."""

    def __init__(self, round, engine, given: BranchRound):
        super().__init__(round, engine)
        self.given = given

    def fit(self, downlink: Downlink) -> Uplink:
        from fl_lightning.modules.split import split_step, train_split
        from fl_lightning.modules.split_variants import Replay
        from fl_lightning.runtime.client_data import ClientData

        r, given = self.round, self.given
        cut, shard = r.task.cut, r.shard
        front_keys = given.front_keys
        front_regions = key_regions(given.state, front_keys)
        # its branch's front (received) and server portion (loaded in the server worker): SplitFed V1's pair
        pair = self.engine.build_pair(self, downlink.model.module)
        given.helper_worker.train()
        helper_front, _ = given.helper_worker.split(cut)
        helper_data, assistants = None, 0
        if given.replay is not None:
            indices, assistants = given.replay
            if len(indices) >= 2:  # batch norm needs two rows per part
                chunk = max(2, math.ceil(len(indices) / shard.batches_per_epoch()))
                helper_data = ClientData(shard.dataset, indices, chunk, shard.device, shard.num_workers)

        assistant_link = Channel()  # the assistant devices' traffic, apart from the client's own
        front_bytes = state_bytes(given.state, front_keys)  # the client portion, as each assistant receives it

        def refresh_helper():  # the assistants receive the client portion as it is now
            load_routed_state(given.helper_worker, given.front_worker.state_dict(), front_regions)
            assistant_link.count(DOWN, "model", assistants * front_bytes)

        replay = Replay(self.forward(helper_front), refresh_helper, helper_data,
                        torch.Generator().manual_seed(derive_seed(r.seed, CHUNK_STREAM, r.round_idx, r.task.client)),
                        shard.batches_per_epoch(), assistant_link)
        fit = train_split(r.fabric, split_step(pair, replay), shard, r.train, r.generator())
        result = self.engine.result(r.task, fit, state=given.state)
        result.metrics.update({"branch": r.task.choice.branch, "cut": given.cut_index,
                               "assistants": assistants, "replay_examples": replay.examples,
                               "replay_bytes_up": assistant_link.total(UP),
                               "replay_model_bytes": assistant_link.total(DOWN)})
        return result


class MultiSFL(SplitFed):
    """Branch models trained by one client each, averaged into a master, weakly pulled back."""

    def __init__(self, cut: Optional[str] = None, pull: ClosedUnitInterval = WEAK_PULL, replay: bool = True,
                 replay_budget: ClosedUnitInterval = 0.01, replay_decay: ClosedUnitInterval = 0.5,
                 adaptive_split: bool = False, candidates: Optional[List[str]] = None,
                 server_lr: Optional[PositiveFloat] = None, **kwargs):
        """
        Args:
            cut: block name after which the model is split (None: the middle block boundary).
            pull: weak aggregation coefficient: each branch moves this fraction of the way to
                the master after every round (1/11: the authors' weights 1 for the master and 10
                for the branch).
            replay: knowledge replay (assistant devices' activations join the server's batches).
            replay_budget: replayed examples per round as a fraction of the client's shard (at
                least one per class).
            replay_decay: decay of a branch's cumulative label distribution per round.
            adaptive_split: cut each client at the deepest of ``candidates`` whose client forward
                MACs fit its budget (partition.budgets; the shallowest when none does): the
                FedSGA paper's reading of MultiSFL; the original has one cut.
            candidates: the cuts adaptive_split chooses from, shallowest first (None: the stage
                ends as for FedSGA).
            server_lr: learning rate of the server portion (None: the clients' round rate).
            **kwargs: SplitFed's served-statistics options of the master (``bn``, ...).
        """
        super().__init__(cut=cut, version="v1", server_lr=server_lr, **kwargs)
        self.pull = pull
        self.replay = replay
        self.replay_budget = replay_budget
        self.replay_decay = replay_decay
        self.adaptive_split = adaptive_split
        self.candidates = candidates

    def check(self, train, population=None) -> None:
        super().check(train, population)
        if self.candidates is not None and not self.adaptive_split:
            raise ConfigError("algorithm.candidates", "is used only with adaptive_split: true")
        if self.cut is not None and self.adaptive_split:
            raise ConfigError("algorithm.cut", "is not used with adaptive_split: true (the cuts are the candidates)")

    # -- set-up ---------------------------------------------------------------------------------
    def candidate_cuts(self, model) -> List[str]:
        if not self.adaptive_split:
            return super().candidate_cuts(model)
        from fl_lightning.algorithms.split.common import default_candidates

        names = list(model.block_names)
        cuts = list(self.candidates) if self.candidates is not None else default_candidates(names)
        for cut in cuts:
            self._check_cut("algorithm.candidates", cut, names)
        if len(set(cuts)) != len(cuts) or [names.index(c) for c in cuts] != sorted(names.index(c) for c in cuts):
            raise ConfigError("algorithm.candidates", f"must be distinct and listed shallowest first, got {cuts}")
        return cuts

    def prepare(self, ctx) -> None:
        super().prepare(ctx)
        device = ctx.fabric.device
        self.num_branches = ctx.clients_per_round
        self.branches = [{k: v.detach().clone() for k, v in self.global_state.items()}
                         for _ in range(self.num_branches)]
        self.counts = label_counts(ctx.data.bundle.train_targets, ctx.data.clients, ctx.num_classes)
        self.distribution = torch.zeros(self.num_branches, ctx.num_classes, dtype=torch.float64)
        self.distribution_weight = torch.zeros(self.num_branches, dtype=torch.float64)
        for branch, values in enumerate(self.branches):
            self.keep(KeptTensors(f"branch/{branch}/", values))
        self.keep(KeptAttributes(self, {"replay/distribution": "distribution", "replay/weight": "distribution_weight"},
                                 torch.float64))
        self.helper_worker = ctx.make_model().to(device)
        self._by_class: Dict[int, List[torch.Tensor]] = {}
        self.client_cut = None
        if self.adaptive_split:
            macs = [self.halves.front_macs[c] for c in self.cuts]
            budgets = ctx.budgets.tolist() if ctx.budgets is not None else [math.inf] * ctx.num_clients
            self.client_cut = [self.cuts[max([k for k, m in enumerate(macs) if m <= b], default=0)] for b in budgets]

    # -- the plan -------------------------------------------------------------------------------
    def plan(self, round_idx: int) -> RoundPlan:
        """The uniform cohort, the k-th client of a seeded random order training branch k, and
        each branch's label statistic updated with its client (pending until the round ends)."""
        ctx = self.ctx
        cohort = self.selector.cohort(round_idx)
        order = torch.randperm(len(cohort), generator=torch.Generator().manual_seed(
            derive_seed(ctx.seed, ASSIGN_STREAM, round_idx))).tolist()
        tasks = []
        for branch, position in enumerate(order):
            client = cohort[position]
            cut = self.client_cut[client] if self.client_cut is not None else self.cut
            tasks.append(ClientTask(client, cut=cut, choice=Branch(branch)))
        tasks.sort(key=lambda t: t.client)
        return RoundPlan(round_idx, self.round_lr(round_idx), tasks)

    def branch_statistic(self, task: ClientTask) -> Tuple[torch.Tensor, torch.Tensor]:
        """The task's branch's label statistic with the task's client added (it replaces the
        branch's when the round ends)."""
        branch = task.choice.branch
        return decayed_distribution(self.distribution[branch], self.distribution_weight[branch],
                                    self.counts[task.client], self.replay_decay)

    # -- knowledge replay -----------------------------------------------------------------------
    def _class_indices(self, client: int) -> List[torch.Tensor]:
        if client not in self._by_class:
            indices = self.ctx.data.clients[client]
            targets = torch.as_tensor(self.ctx.data.bundle.train_targets, dtype=torch.long)[indices]
            self._by_class[client] = [indices[targets == k] for k in range(self.ctx.num_classes)]
        return self._by_class[client]

    def replay_set(self, task: ClientTask, round_idx: int) -> Tuple[torch.Tensor, int]:
        """Dataset indices the assistants replay for this client's branch, and how many assistants."""
        distribution, _ = self.branch_statistic(task)
        need = replay_requirement(distribution, len(self.ctx.data.clients[task.client]), self.replay_budget)
        generator = torch.Generator().manual_seed(derive_seed(self.ctx.seed, REPLAY_STREAM, round_idx, task.client))
        chosen = choose_assistants(need, self.counts, task.client, generator)
        picked = []
        for helper, give in chosen:
            for k, indices in enumerate(self._class_indices(helper)):
                if give[k] > 0:
                    picked.append(indices[torch.randperm(len(indices), generator=generator)[:int(give[k])]])
        if not picked:
            return torch.zeros(0, dtype=torch.long), 0
        return torch.cat(picked), len(chosen)

    # -- a client's round -----------------------------------------------------------------------
    def downlink(self, task: ClientTask, plan: RoundPlan) -> Downlink:
        """The front of the client's branch (its server portion loaded beside it)."""
        return Downlink(self.engine.receive(task, plan, source=self.branches[task.choice.branch]))

    def new_client(self, task: ClientTask, plan: RoundPlan) -> BranchClient:
        replay = self.replay_set(task, plan.round_idx) if self.replay else None
        given = BranchRound(self.branches[task.choice.branch], self.halves.front(task.cut), self.cuts.index(task.cut),
                            self.engine.client_worker, replay, self.helper_worker)
        return BranchClient(self.client_round(task, plan), self.engine, given)

    def new_accumulator(self, plan):
        """Besides the master: every branch's trained state (from the rank that trained it,
        zeros elsewhere) and whether it trained."""
        acc = super().new_accumulator(plan)
        for branch, values in enumerate(self.branches):
            for key, value in values.items():
                acc.declare(f"branch/{branch}/{key}", torch.zeros_like(value))
            acc.declare(f"branch/{branch}/trained", torch.zeros(()))
        return acc

    def commit(self, acc, task: ClientTask[Branch], result, plan: RoundPlan) -> None:
        """Every branch weighs the same in the master (the authors' plain mean); the trained
        branch is summed for the round's end (a key the branch did not send, BN statistics
        under sbn, keeps its value)."""
        acc.add(result.model.module.state_dict(), 1.0, result.model.regions)
        acc.add(result.server_side.module.state_dict(), 1.0, result.server_side.regions)
        local = result.model.module.state_dict()
        regions = {**result.model.regions, **result.server_side.regions}
        trained = {global_key: local[local_key].detach() for local_key, (global_key, _) in regions.items()}
        branch = task.choice.branch
        for key, value in self.branches[branch].items():
            acc.add_sum(f"branch/{branch}/{key}", trained.get(key, value))
        acc.add_sum(f"branch/{branch}/trained", torch.ones(()))

    # -- the round's end ------------------------------------------------------------------------
    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)  # the master: the mean of the branches
        with torch.no_grad():
            for branch in range(self.num_branches):
                if acc[f"branch/{branch}/trained"] > 0:
                    for key, value in self.branches[branch].items():
                        value.copy_(acc[f"branch/{branch}/{key}"].to(value.dtype))
                weak_aggregate(self.branches[branch], self.global_state, self.pull)
        for task in plan.tasks:
            self.distribution[task.choice.branch], self.distribution_weight[task.choice.branch] = \
                self.branch_statistic(task)
        return figures
