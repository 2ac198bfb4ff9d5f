"""SplitFed (Thapa et al., 2022): the model cut at a block boundary, client fronts averaged.

Each client trains the front ``f(1:p)`` of the model; the server trains the back on the
activations the client sends and returns the gradient at the cut (``modules/split.py``).

- V1: every client's server half is a copy of the global back, trained on that client's
  activations; fronts and server copies are averaged sample-weighted at the end of the round.
- V2: one server half is trained client by client in a shuffled order (the cohort runs in
  order on rank 0), its optimizer persisting across clients and rounds; only the fronts are
  averaged.

Subclasses choose a cut per client (``cut_for``) and add server-side loss terms
(``server_objective``): FedSGA does both. docs/fedsga.md describes what is counted.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional

import torch
from torch import nn

from fl_lightning.algorithms.base import FedAvg
from fl_lightning.algorithms.split_common import key_regions, split_metrics, state_bytes
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.errors import ConfigError
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.seeding import client_generator, derive_seed, sample_clients

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

    dense = True  # every global key is trained by every client, on one side of the cut or the other

    def __init__(self, cut: Optional[str] = None, version: Literal["v1", "v2"] = "v1",
                 server_lr: Optional[float] = None):
        """
        Args:
            cut: block name after which the model is split (the last block the client runs);
                one of the model's ``block_names``. None: the middle block boundary.
            version: v1 (a server copy per client, averaged) or v2 (one server half trained
                client by client, in a shuffled order).
            server_lr: learning rate of the server half (None: the clients' round rate).
        """
        self.cut = cut
        self.version = version
        self.server_lr = server_lr

    @property
    def sequential_clients(self) -> bool:
        return self.version == "v2"

    def check(self, train) -> None:
        if self.version not in ("v1", "v2"):
            raise ConfigError("algorithm.version", f"must be v1 or v2, got {self.version!r}")
        if self.server_lr is not None and not self.server_lr > 0:
            raise ConfigError("algorithm.server_lr", f"must be > 0, got {self.server_lr}")

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

    def setup(self, ctx) -> None:
        self.ctx = ctx
        if getattr(ctx.fabric.strategy.precision, "scaler", None) is not None:
            raise ConfigError("fabric.precision", "split methods step two optimizers per batch; fp16 with a "
                                                  "gradient scaler is not supported, use bf16-mixed or 32-true")
        if not hasattr(ctx.model, "split"):
            raise ConfigError("model.name", f"{type(ctx.model).__name__} has no block boundaries to split at")
        self.global_state = ctx.model.state_dict()
        self.cuts = self.candidate_cuts(ctx.model)
        self.halves = SplitHalves(ctx.model, self.cuts, ctx.data.bundle.input_shape)
        device = ctx.fabric.device
        self.client_worker = ctx.make_model().to(device)
        self.server_worker = ctx.make_model().to(device)
        self.pair = nn.ModuleDict({"front": self.client_worker, "back": self.server_worker})
        self.server_optimizer = None  # V2: one optimizer across clients and rounds
        self._server_momentum: Dict[str, torch.Tensor] = {}

    # -- a round --------------------------------------------------------------------------------
    def plan(self, round_idx: int) -> RoundPlan:
        ctx = self.ctx
        cohort = sample_clients(ctx.seed, round_idx, ctx.num_clients, ctx.clients_per_round)
        if self.version == "v2":  # the server visits the clients in a random order
            order = torch.randperm(len(cohort), generator=torch.Generator().manual_seed(
                derive_seed(ctx.seed, ORDER_STREAM, round_idx)))
            cohort = [cohort[i] for i in order.tolist()]
        return RoundPlan(round_idx, self.round_lr(round_idx),
                         [ClientTask(c, cut=self.cut_for(c, round_idx)) for c in cohort])

    def cut_for(self, client: int, round_idx: int) -> str:
        return self.cut

    def server_objective(self, task: ClientTask, plan: RoundPlan):
        """``loss(back_output_fn, zs, y)``: the server half's loss on one batch (cross-entropy)."""
        import torch.nn.functional as F

        def loss(back, sent, y):
            return F.cross_entropy(back(sent), y)
        return loss

    def client_forward(self, front: nn.Module, task: ClientTask):
        """The client half's forward on a batch (FedSGA prepends the client's prompt)."""
        return front

    def client_trainables(self, task: ClientTask) -> List[torch.Tensor]:
        """Client-side tensors trained besides the front (FedSGA: the prompt)."""
        return []

    def server_trainables(self, task: ClientTask) -> List[torch.Tensor]:
        """Server-side tensors trained besides the back (FedSGA: the harmonizer)."""
        return []

    def fit_client(self, task: ClientTask, plan: RoundPlan) -> ClientResult:
        from fl_lightning.modules.split import sgd

        ctx, cut = self.ctx, task.cut
        front_keys, back_keys = self.halves.front(cut), self.halves.back(cut)
        load_routed_state(self.client_worker, self.global_state, key_regions(self.global_state, front_keys))
        if self.version == "v1" or task is plan.tasks[0]:  # V2: the server half carries over within the round
            load_routed_state(self.server_worker, self.global_state, key_regions(self.global_state, back_keys))
        self.client_worker.train()
        self.server_worker.train()
        front, _ = self.client_worker.split(cut)
        _, back = self.server_worker.split(cut)
        server_lr = self.server_lr if self.server_lr is not None else plan.lr
        client_params = list(front.parameters()) + self.client_trainables(task)
        server_params = list(back.parameters()) + self.server_trainables(task)
        client_opt = sgd(client_params, plan.lr, ctx.train)
        server_opt = self._server_optimizer(server_params, server_lr)
        objective = self.server_objective(task, plan)
        fit = self.train_pass(task, plan, self.client_forward(front, task), lambda zs, y: objective(back, zs, y),
                              client_opt, server_opt, client_params, server_params)
        if self.version == "v2":
            self._stash_momentum(server_opt)
        regions = key_regions(self.global_state, front_keys, "front.")
        if self.version == "v1":
            regions.update(key_regions(self.global_state, back_keys, "back."))
        metrics = split_metrics(self.halves, cut, state_bytes(self.global_state, front_keys), steps=fit.steps,
                                seconds=fit.seconds, client_seconds=fit.client_seconds,
                                server_seconds=fit.server_seconds, cut_bytes_up=fit.cut_bytes_up,
                                cut_bytes_down=fit.cut_bytes_down, examples=fit.examples)
        metrics.update(fit.extras)
        return ClientResult(task.client, fit.num_samples, fit.loss, update=Routed(self.pair, regions),
                            module=self.pair, metrics=metrics)

    def train_pass(self, task: ClientTask, plan: RoundPlan, client_forward, server_loss, client_opt, server_opt,
                   client_params, server_params):
        """One client's split training over its shard (``modules/split.py``); MU-SplitFed
        replaces it with its unbalanced server updates."""
        from fl_lightning.modules.split import train_split

        ctx = self.ctx
        return train_split(ctx.fabric, client_forward, server_loss, client_opt, server_opt, ctx.shards[task.client],
                           ctx.train, client_generator(ctx.seed, plan.round_idx, task.client),
                           client_params=client_params, server_params=server_params,
                           after_client_backward=self.after_client_backward(task))

    def after_client_backward(self, task: ClientTask):
        return None

    def _server_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        from fl_lightning.modules.split import sgd

        if self.version == "v1":
            return sgd(params, lr, self.ctx.train)
        # V2: one server half for every client; its momentum carries across clients and rounds
        optimizer = sgd(params, lr, self.ctx.train)
        names = {id(p): name for name, p in self.server_worker.named_parameters()}
        for p in params:
            buffer = self._server_momentum.get(names.get(id(p), ""))
            if buffer is not None:
                optimizer.state[p]["momentum_buffer"] = buffer.clone()
        return optimizer

    def _stash_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        names = {id(p): name for name, p in self.server_worker.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                buffer = optimizer.state.get(p, {}).get("momentum_buffer")
                if buffer is not None and id(p) in names:
                    self._server_momentum[names[id(p)]] = buffer.detach().clone()

    def finish_round(self, new_state, sums, plan, owned) -> None:
        super().finish_round(new_state, sums, plan, owned)
        if self.version == "v2":
            self._publish_server_half(plan, owned)

    def _publish_server_half(self, plan: RoundPlan, owned: List[int]) -> None:
        """V2: the sequentially trained server half becomes the global back (rank 0 trained it)."""
        from fl_lightning.runtime.collectives import all_reduce_sum

        back_keys = self.halves.back(self.cut)
        trained = bool(owned)
        values = {k: (self.server_worker.state_dict()[k].to(torch.float64) if trained
                      else torch.zeros_like(self.global_state[k], dtype=torch.float64))
                  for k in back_keys if self.global_state[k].is_floating_point()}
        if self.ctx.train.momentum:  # every rank sends the same keys: zeros where it trained nothing
            params = dict(self.server_worker.named_parameters())
            for key in back_keys:
                if key in params:
                    buffer = self._server_momentum.get(key) if trained else None
                    values[f"momentum/{key}"] = (buffer.to(torch.float64) if buffer is not None
                                                 else torch.zeros_like(params[key], dtype=torch.float64))
        reduced = all_reduce_sum(self.ctx.fabric, values)
        with torch.no_grad():
            for key in back_keys:
                if key in reduced:
                    self.global_state[key].copy_(reduced[key])
        self._server_momentum = {k[len("momentum/"):]: v.to(self.global_state[k[len("momentum/"):]].dtype)
                                 for k, v in reduced.items() if k.startswith("momentum/")}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"server_momentum/{k}": v for k, v in self._server_momentum.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._server_momentum = {k[len("server_momentum/"):]: v for k, v in state.items()
                                 if k.startswith("server_momentum/")}
