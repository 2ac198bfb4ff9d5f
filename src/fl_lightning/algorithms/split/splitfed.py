"""SplitFed (Thapa et al., 2022): the model cut at a block boundary, client fronts averaged.

Each client trains the front ``f(1:p)`` of the model; the server trains the back on the
activations the client sends and returns the gradient at the cut (``modules/split.py``).

- V1: every client's server half is a copy of the global back, trained on that client's
  activations; fronts and server copies are averaged sample-weighted at the end of the round.
- V2: one server half is trained client by client in a shuffled order (the cohort runs in
  order on rank 0), its optimizer's momentum carried across clients and rounds (or, as the
  authors' script, an optimizer made afresh for every batch: ``server_optimizer: per_batch``);
  only the fronts are averaged.

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
from fl_lightning.algorithms.split.common import SplitClient, key_regions
from fl_lightning.algorithms.split.engine import SplitEngine
from fl_lightning.defaults import CALIB_BATCH_SIZE
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.kept_state import KeptTensors
from fl_lightning.runtime.link import Downlink
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import derive_seed

ORDER_STREAM = 21  # seed stream of SplitFed V2's client order
ServerOptimizerLife = Literal["carried", "per_batch"]


class SplitFed(FedAvg):
    """SplitFed V1 or V2 at one block boundary for every client."""


    def __init__(self, cut: Optional[str] = None, version: Literal["v1", "v2"] = "v1",
                 server_lr: Optional[PositiveFloat] = None, bn: Optional[Protocol] = None, sbn_data: SbnData = "train",
                 calib_batch_size: PositiveInt = CALIB_BATCH_SIZE, calib_transform: Literal["train", "eval"] = "train",
                 weighting: Optional[Weighting] = None, server_optimizer: ServerOptimizerLife = "carried"):
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
            server_optimizer: the server half's optimizer state. carried: one optimizer per
                client round (V2: its momentum carried across clients and rounds). per_batch: made
                afresh for every batch, as the SplitFed authors' scripts build it inside the
                server's training function, so no momentum survives a step (SGD's first step
                with momentum is a plain step).
        """
        super().__init__(bn=bn if bn is not None else "sbn", sbn_data=sbn_data, calib_batch_size=calib_batch_size,
                         calib_transform=calib_transform, weighting=weighting)
        # every global key is trained by every client, on one side of the cut or the other (dense);
        # V2's one server half trains the cohort in order
        self.sequential_clients = version == "v2"
        self.cut = cut
        self.version = version
        self.server_lr = server_lr
        self.server_optimizer = server_optimizer

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
        self.engine = SplitEngine(ctx, self.global_state, self.cuts, self.statistics, self.version, self.server_lr,
                                  self.server_trainables, self.train_pass,
                                  fresh_server_state=self.server_optimizer == "per_batch")
        self.halves = self.engine.halves  # the method's rules read the cuts' keys and costs
        self.keep(KeptTensors("server_momentum/", self.engine.server_momentum))

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

    def downlink(self, task: ClientTask, plan: RoundPlan) -> Downlink:
        """The front the client receives (in the rank's client worker), its server half loaded
        beside it (``SplitEngine.receive``)."""
        return Downlink(self.engine.receive(task, plan))

    def new_client(self, task: ClientTask, plan: RoundPlan) -> SplitClient:
        """The client's split round on the rank's engine (``split/common.py``'s SplitClient;
        FedSGA's carries a prompt)."""
        return SplitClient(self.client_round(task, plan), self.engine)

    def server_trainables(self) -> Dict[str, torch.Tensor]:
        """Server-side tensors trained with the back, by name (FedSGA: the harmonizer)."""
        return {}

    def train_pass(self, client: SplitClient, pair):
        """One client's split training over its shard with the standard step and the client's
        server rule (``modules/split.py``); MU-SplitFed changes the step (MultiSFL's client runs
        its replay step itself)."""
        from fl_lightning.modules.split import split_step, train_split

        r = client.round
        return train_split(r.fabric, split_step(pair, client.server_rule), r.shard, r.train, r.generator())

    # -- V2: the shared server half -------------------------------------------------------------
    def new_accumulator(self, plan):
        """V2: the server half enters once this rank's clients are committed, and every rank
        gets its momentum (rank 0 trained it) through the same reduction."""
        acc = super().new_accumulator(plan)
        if self.version == "v2":
            acc.before_reduce(self.add_server_half)
            if self.engine.carries_momentum:
                for name, tensor in self._server_tensors().items():
                    acc.declare(f"momentum/{name}", torch.zeros_like(tensor, dtype=torch.float64))
        return acc

    def commit(self, acc, task, result, plan) -> None:
        super().commit(acc, task, result, plan)
        if result.server_side is not None:  # V1: the server copy trained for this client
            acc.add(result.server_side.module.state_dict(), self.weight(result), result.server_side.regions)
        if self.version == "v2":  # the server half holds this client's share of its back
            keys = self.engine.exchanged(self.halves.back(task.cut))
            acc.hold("server_half", task.client, (keys, self.weight(result)))

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
        state = self.engine.server_worker.state_dict()
        if all(torch.isfinite(state[k]).all() for k in weights if state[k].is_floating_point()):
            for key, weight in weights.items():
                acc.add(state, weight, key_regions(self.global_state, [key]))
        if self.engine.carries_momentum:
            for name in self._server_tensors():
                buffer = self.engine.server_momentum.get(name)
                if buffer is not None:
                    acc.add_sum(f"momentum/{name}", buffer)

    def finish_round(self, acc, plan) -> Dict[str, float]:
        figures = super().finish_round(acc, plan)
        if self.engine.carries_momentum:
            tensors = self._server_tensors()
            self.engine.server_momentum.clear()
            self.engine.server_momentum.update({name: acc[f"momentum/{name}"].to(t.dtype)
                                                for name, t in tensors.items()})
        return figures

    def _server_tensors(self) -> Dict[str, torch.Tensor]:
        """Every server-side tensor V2 may train, by name: the backbone's parameters behind the
        shallowest cut and the extra trainables."""
        behind = set(self.halves.back(self.cuts[0]))
        out = {name: p for name, p in self.engine.server_worker.named_parameters() if name in behind}
        out.update(self.server_trainables())
        return out
