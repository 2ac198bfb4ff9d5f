"""SplitFed (Thapa et al., 2022): the model cut at a block boundary, client fronts averaged.

Each client trains the front ``f(1:p)`` of the model; the server trains the back on the
activations the client sends and returns the gradient at the cut (``modules/split.py``).

- V1: every client's server half is a copy of the global back, trained on that client's
  activations; fronts and server copies are averaged sample-weighted at the end of the round.
- V2: one server half is trained client by client in a shuffled order (the cohort runs in
  order on rank 0), its optimizer persisting across clients and rounds; only the fronts are
  averaged.

Each client's round is a :class:`SplitClient` made per task (``new_client``): its forward,
backward and the server's loss and step on its batches. Subclasses choose a cut per client
(``cut_for``) and their own client (FedSGA: a prompt and the alignment term). docs/fedsga.md describes what is counted.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional

import torch
from torch import nn

from fl_lightning.algorithms.fedavg import FedAvg, Weighting
from fl_lightning.algorithms.bn_protocol import Protocol, SbnData
from fl_lightning.algorithms.split.common import SplitClient, key_regions, split_metrics
from fl_lightning.elastic.bn import statistics_keys
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.errors import ConfigError
from fl_lightning.feast_protocol import CALIB_BATCH_SIZE
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.channel import DOWN, UP
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.seeding import derive_seed

ORDER_STREAM = 21  # seed stream of SplitFed V2's client order


class SplitHalves:
    """The global keys on each side of every cut used by a run, and the client-side cost of each."""

    def __init__(self, model: nn.Module, cuts: List[str], input_shape):
        from fl_lightning.elastic.macs import count_macs
        from fl_lightning.elastic.split import split_keys

        self.keys = {cut: split_keys(model, cut) for cut in cuts}
        self.front_macs = {}
        self.front_params = {}
        for cut in cuts:
            front, _ = model.split(cut)
            self.front_macs[cut] = count_macs(front, input_shape)
            self.front_params[cut] = sum(p.numel() for p in front.parameters())

    def front(self, cut: str) -> List[str]:
        return self.keys[cut][0]

    def back(self, cut: str) -> List[str]:
        return self.keys[cut][1]


class SplitFed(FedAvg):
    """SplitFed V1 or V2 at one block boundary for every client."""

    default_bn = "sbn"
    dense = True  # every global key is trained by every client, on one side of the cut or the other

    def __init__(self, cut: Optional[str] = None, version: Literal["v1", "v2"] = "v1",
                 server_lr: Optional[PositiveFloat] = None, bn: Optional[Protocol] = None, sbn_data: SbnData = "train",
                 calib_batch_size: PositiveInt = CALIB_BATCH_SIZE, calib_transform: Literal["train", "eval"] = "train",
                 weighting: Optional[Weighting] = None):
        """
        Args:
            cut: block name after which the model is split (the last block the client runs);
                one of the model's ``block_names``. None: the middle block boundary.
            version: v1 (a server copy per client, averaged) or v2 (one server half trained
                client by client, in a shuffled order).
            server_lr: learning rate of the server half (None: the clients' round rate).
            bn: where the served model (front and server half) gets its BN statistics: sbn
                (the default when None; static BN: both halves train on batch statistics and track none; one pass
                over ``sbn_data`` through the served model before evaluation), recalibrate (the
                server's calibration split), client (the pooled statistics of every batch the
                fronts and the server half normalized in the round) or aggregated (the tracked
                running statistics: V2's server half then holds those of the round's last
                clients; for comparison only). docs/served_statistics.md.
            sbn_data: the sBN pass's data: train (the union of the client shards) or calib.
            calib_batch_size: batch size of the statistics pass (sbn and recalibrate).
            calib_transform: images of that pass through the training augmentation (train,
                drawn once from a fixed seed) or none (eval).
            weighting: a client's weight in the averages of fronts (and V1's server copies):
                samples (its examples, the project's common rule; the default) or uniform (one
                per client: the authors' ``FedAvg``, a plain mean).
        """
        super().__init__(bn=bn, sbn_data=sbn_data, calib_batch_size=calib_batch_size,
                         calib_transform=calib_transform, weighting=weighting)
        self.cut = cut
        self.version = version
        self.server_lr = server_lr

    @property
    def sequential_clients(self) -> bool:
        return self.version == "v2"

    # -- set-up ---------------------------------------------------------------------------------
    def candidate_cuts(self, model: nn.Module) -> List[str]:
        """Every cut the run may use (SplitFed: one)."""
        names = list(model.block_names)
        cut = self.cut if self.cut is not None else names[(len(names) - 1) // 2]
        self._check_cut("algorithm.cut", cut, names)
        self.cut = cut
        return [cut]

    @staticmethod
    def _check_cut(key: str, cut: str, names: List[str]) -> None:
        if cut not in names[:-1]:
            raise ConfigError(key, f"must be a block boundary before the last block, one of "
                                   f"{', '.join(names[:-1])}; got {cut!r}")

    def prepare(self, ctx) -> None:
        if getattr(ctx.fabric.strategy.precision, "scaler", None) is not None:
            raise ConfigError("fabric.precision", "split methods step two optimizers per batch; fp16 with a "
                                                  "gradient scaler is not supported, use bf16-mixed or 32-true")
        if not hasattr(ctx.model, "split"):
            raise ConfigError("model", f"{type(ctx.model).__name__} has no block boundaries to split at")
        self.cuts = self.candidate_cuts(ctx.model)
        self.halves = SplitHalves(ctx.model, self.cuts, ctx.data.bundle.input_shape)
        device = ctx.fabric.device
        self.client_worker = ctx.make_model().to(device)
        self.server_worker = ctx.make_model().to(device)
        self.pair = nn.ModuleDict({"front": self.client_worker, "back": self.server_worker})
        self.unsent = statistics_keys(ctx.model) if self.statistics.protocol == "sbn" else set()
        self._server_momentum: Dict[str, torch.Tensor] = {}  # V2: carried across clients and rounds
        self.keep(KeptTensors("server_momentum/", self._server_momentum))

    # -- a round --------------------------------------------------------------------------------
    def plan(self, round_idx: int) -> RoundPlan:
        return RoundPlan(round_idx, self.round_lr(round_idx),
                         [ClientTask(c, cut=self.cut_for(c, round_idx)) for c in self.cohort(round_idx)])

    def cohort(self, round_idx: int) -> List[int]:
        """The round's clients; V2's server visits them in a seeded random order."""
        ctx = self.ctx
        cohort = self.selector.cohort(round_idx)
        if self.version == "v2":
            order = torch.randperm(len(cohort), generator=torch.Generator().manual_seed(
                derive_seed(ctx.seed, ORDER_STREAM, round_idx)))
            cohort = [cohort[i] for i in order.tolist()]
        return cohort

    def cut_for(self, client: int, round_idx: int) -> str:
        return self.cut

    def new_client(self, task: ClientTask, plan: RoundPlan) -> SplitClient:
        """The client's split round (``split_common.SplitClient``): FedSGA's carries a prompt."""
        return SplitClient(self, task, plan)

    def server_trainables(self) -> Dict[str, torch.Tensor]:
        """Server-side tensors trained with the back, by name (FedSGA: the harmonizer)."""
        return {}

    def fit_split_client(self, client: SplitClient) -> ClientResult:
        """Build the client's pair, train it over the client's shard, and return the result."""
        pair = self.make_pair(client)
        fit = self.train_pass(client, pair)
        if self.version == "v2":
            self._stash_momentum(pair.server_optimizer)
        return self.client_result(client.task, fit)

    def make_pair(self, client: SplitClient):
        """SplitFed's pair for ``client``: the global front in the rank's worker, and the server
        half a copy of the global back for this client (V1), or the one shared server half,
        loaded from the global model at the round's first client and carrying its momentum
        across clients and rounds (V2)."""
        cut = client.task.cut
        self.load_front(self.client_worker, self.global_state, cut)
        if self.version == "v1" or client.task is client.plan.tasks[0]:
            self.load_back(self.global_state, cut)
        return self.build_pair(client, self.client_worker)

    def load_front(self, worker: nn.Module, source: Dict[str, torch.Tensor], cut: str) -> None:
        """The front of ``source`` (the global model, or MultiSFL's branch) into ``worker``."""
        load_routed_state(worker, source, key_regions(source, self.halves.front(cut)))
        self.statistics.prepare(worker)

    def load_back(self, source: Dict[str, torch.Tensor], cut: str) -> None:
        """The back of ``source`` into the server worker (V2: everything any client of the run
        may train on the server, behind the shallowest cut)."""
        back_keys = self.halves.back(cut if self.version == "v1" else self.cuts[0])
        load_routed_state(self.server_worker, source, key_regions(source, back_keys))
        self.statistics.prepare(self.server_worker)  # V2: statistics pooled over the round

    def build_pair(self, client: SplitClient, worker: nn.Module, server_optimizer=None):
        """The client round's two halves with their optimizers (``modules/split.py``), driven by
        ``client``'s forward, backward and server loss: ``worker``'s front (loaded) and the
        server worker's back, the server stepping with ``server_optimizer`` when the cohort
        shares one (MergeSFL), else its own (V2: with the momentum carried over)."""
        from fl_lightning.modules.split import make_pair

        r = client.round
        cut = r.task.cut
        worker.train()
        self.server_worker.train()
        front, _ = worker.split(cut)
        _, back = self.server_worker.split(cut)
        extra = self.server_trainables()
        server_params = list(back.parameters()) + list(extra.values())
        names = {id(p): name for name, p in self.server_worker.named_parameters()}
        names.update({id(p): name for name, p in extra.items()})
        self._server_names = names
        momentum = None
        if self.version == "v2":
            momentum = {id(p): self._server_momentum[names[id(p)]] for p in server_params
                        if names.get(id(p)) in self._server_momentum}
        return make_pair(r.fabric, r.train, client_forward=client.forward(front),
                         server_loss=lambda zs, y: client.server_loss(back, zs, y), client_module=front,
                         server_module=back, client_params=list(front.parameters()) + client.trainables(),
                         server_params=server_params, lr=r.lr,
                         server_lr=self.server_lr if self.server_lr is not None else r.lr,
                         server_momentum=momentum, after_client_backward=client.after_backward,
                         server_optimizer=server_optimizer, client_backward=client.backward)

    def train_pass(self, client: SplitClient, pair):
        """One client's split training over its shard with the standard step and the client's
        server rule (``modules/split.py``); MU-SplitFed changes the step (MultiSFL's client runs
        its replay step itself)."""
        from fl_lightning.modules.split import split_step, train_split

        r = client.round
        return train_split(r.fabric, split_step(pair, client.server_rule), r.shard, r.train, r.generator())

    def client_result(self, task: ClientTask, fit, module: Optional[nn.Module] = None,
                      state: Optional[Dict[str, torch.Tensor]] = None) -> ClientResult:
        """The client's result with the figures of a split round: the trained front (and V1's
        server copy) of ``state`` (default: the global model), or the front held by ``module``."""
        cut = task.cut
        state = state if state is not None else self.global_state
        front_keys, back_keys = self.exchanged(self.halves.front(cut)), self.exchanged(self.halves.back(cut))
        if module is None:
            module = self.pair
            regions = key_regions(state, front_keys, "front.")
            if self.version == "v1":
                regions.update(key_regions(state, back_keys, "back."))
        else:
            regions = key_regions(state, front_keys)
        metrics = split_metrics(self.halves, cut, steps=fit.steps, seconds=fit.seconds,
                                client_seconds=fit.client_seconds, server_seconds=fit.server_seconds,
                                examples=fit.examples)
        metrics.update(fit.extras)
        # besides the cut's traffic, the front comes down at the start and goes back at the end
        fit.channel.send_state(DOWN, "model", state, front_keys)
        fit.channel.send_state(UP, "model", state, front_keys)
        return ClientResult(task.client, fit.num_samples, fit.loss, update=Routed(module, regions),
                            module=module, metrics=metrics, channel=fit.channel)

    def exchanged(self, keys: List[str]) -> List[str]:
        """The keys of a half that are sent and aggregated (under sbn, no BN statistics)."""
        return [k for k in keys if k not in self.unsent]

    def _stash_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        from fl_lightning.modules.split import momentum_buffers

        for pid, buffer in momentum_buffers(optimizer).items():
            if pid in self._server_names:
                self._server_momentum[self._server_names[pid]] = buffer

    # -- V2: the shared server half -------------------------------------------------------------
    def new_accumulator(self, plan):
        """V2: the server half enters once this rank's clients are committed, and every rank
        gets its momentum (rank 0 trained it) through the same reduction."""
        acc = super().new_accumulator(plan)
        if self.version == "v2":
            acc.before_reduce(self.add_server_half)
            if self.ctx.train.momentum:
                for name, tensor in self._server_tensors().items():
                    acc.declare(f"momentum/{name}", torch.zeros_like(tensor, dtype=torch.float64))
        return acc

    def commit(self, acc, task, result, plan) -> None:
        super().commit(acc, task, result, plan)
        if self.version == "v2":  # the server half holds this client's share of its back
            acc.hold("server_half", task.client, (self.exchanged(self.halves.back(task.cut)), self.weight(result)))

    def add_server_half(self, acc) -> None:
        """V2: the shared server half enters the average of every back tensor with the weight
        of the committed clients it trained for (all of them when everyone cuts alike, so the
        back becomes the server half's), unless its values went non-finite; its momentum goes
        to every rank (a tensor that has no buffer yet gets zeros, which SGD's next step treats
        as it treats none)."""
        weights: Dict[str, float] = {}
        for keys, weight in acc.held.get("server_half", {}).values():
            for key in keys:
                weights[key] = weights.get(key, 0.0) + weight
        if not weights:
            return
        state = self.server_worker.state_dict()
        if all(torch.isfinite(state[k]).all() for k in weights if state[k].is_floating_point()):
            for key, weight in weights.items():
                acc.add(state, weight, key_regions(self.global_state, [key]))
        if self.ctx.train.momentum:
            for name in self._server_tensors():
                buffer = self._server_momentum.get(name)
                if buffer is not None:
                    acc.add_sum(f"momentum/{name}", buffer)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)
        if self.version == "v2" and self.ctx.train.momentum:
            tensors = self._server_tensors()
            self._server_momentum.clear()
            self._server_momentum.update({name: acc[f"momentum/{name}"].to(t.dtype) for name, t in tensors.items()})
        return figures

    def _server_tensors(self) -> Dict[str, torch.Tensor]:
        """Every server-side tensor V2 may train, by name: the backbone's parameters behind the
        shallowest cut and the extra trainables."""
        behind = set(self.halves.back(self.cuts[0]))
        out = {name: p for name, p in self.server_worker.named_parameters() if name in behind}
        out.update(self.server_trainables())
        return out
