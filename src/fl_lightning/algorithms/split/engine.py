"""A rank's split-learning engine: what every split client's round runs on.

The split method makes one :class:`SplitEngine` per rank in ``prepare`` and hands it to each
client it makes (``SplitFed.new_client``); the client's ``fit`` runs its round on it
(``engine.run(client, downlink)``). The engine holds the halves of every cut the run uses, the
client and server workers, the served-statistics part and SplitFed V2's server momentum. Before
a client's fit, the method loads its halves (``receive``: the front the client receives into the
client worker, the server half into the server worker; ``load_front`` and ``load_back`` are its
parts); in the fit the engine builds the pair (``build_pair``), trains it with the method's
training step (its ``train_pass``: MU-SplitFed's several server steps) and makes the client's
uplink. MultiSFL loads a branch instead of the global model; MergeSFL builds one pair per
cohort member sharing one server optimizer.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from fl_lightning.algorithms.split.common import key_regions, split_metrics
from fl_lightning.elastic.bn import statistics_keys
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.plan import ClientTask, RoundPlan


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


class SplitEngine:
    """The split machinery of one rank (above).

    Args:
        ctx: the run context.
        global_state: the server's tensors (the global model's state dict).
        cuts: every cut the run may use, shallowest first.
        statistics: the method's served-statistics part (``bn_protocol.ServedStatistics``).
        version: v1 (a server copy per client) or v2 (one shared server half).
        server_lr: the server half's learning rate (None: the round's).
        server_trainables: the method's server-side tensors trained with the back, by name.
        train_pass: the method's training step over a client's shard, ``(client, pair) -> fit``.
        fresh_server_state: the server half's optimizer is made afresh for every batch (no
            momentum survives a step, none is carried).
    """

    def __init__(self, ctx, global_state: Dict[str, torch.Tensor], cuts: List[str], statistics, version: str,
                 server_lr: Optional[float], server_trainables: Callable[[], Dict[str, torch.Tensor]],
                 train_pass: Callable, fresh_server_state: bool = False):
        self.ctx, self.global_state, self.cuts, self.statistics = ctx, global_state, cuts, statistics
        self.version, self.server_lr = version, server_lr
        self.server_trainables, self.train_pass = server_trainables, train_pass
        self.fresh_server_state = fresh_server_state
        self.halves = SplitHalves(ctx.model, cuts, ctx.data.bundle.input_shape)
        device = ctx.fabric.device
        self.client_worker = ctx.make_model().to(device)
        self.server_worker = ctx.make_model().to(device)
        self.pair = nn.ModuleDict({"front": self.client_worker, "back": self.server_worker})
        self.unsent = statistics_keys(ctx.model) if statistics.protocol == "sbn" else set()
        self.server_momentum: Dict[str, torch.Tensor] = {}  # V2: carried across clients and rounds
        self.loaded_momentum: Dict[str, torch.Tensor] = {}  # V2: the server half's, loaded for one client
        self.server_names: Dict[int, str] = {}

    def receive(self, task: ClientTask, plan: RoundPlan, source: Optional[Dict[str, torch.Tensor]] = None,
                deepest: Optional[str] = None) -> Routed:
        """The server's side before a client's fit: the front of ``source`` (default: the global
        model) up to ``deepest`` (default: the task's cut) into the client worker, and the server
        half a copy of the back for this client (V1), or the one shared server half, loaded at the
        round's first client and carrying its momentum across clients and rounds (V2). Returns
        what the client receives: the front's exchanged tensors in the client worker."""
        source = self.global_state if source is None else source
        cut = deepest or task.cut
        self.load_front(self.client_worker, source, cut)
        if self.version == "v1" or task is plan.tasks[0]:
            self.load_back(source, task.cut)
        self.load_momentum()
        return Routed(self.client_worker, key_regions(source, self.exchanged(self.halves.front(cut))))

    def run(self, client, downlink: Downlink) -> Uplink:
        """Build the client's pair on the loaded workers, train it over the client's shard, and
        return its uplink."""
        pair = self.build_pair(client, downlink.model.module)
        fit = self.train_pass(client, pair)
        if self.carries_momentum:
            self.stash_momentum(pair.server_optimizer)
        return self.result(client.task, fit)

    def load_momentum(self) -> None:
        """V2: the server half's momentum as it stands, for the next pair's server optimizer."""
        if self.carries_momentum:
            self.loaded_momentum = {name: buffer.detach().clone() for name, buffer in self.server_momentum.items()}

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

    def build_pair(self, client, worker: nn.Module, server_optimizer=None):
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
        self.server_names = names
        momentum = None
        if self.carries_momentum:
            momentum = {id(p): self.loaded_momentum[names[id(p)]] for p in server_params
                        if names.get(id(p)) in self.loaded_momentum}
        return make_pair(r.fabric, r.train, client_forward=client.forward(front),
                         server_loss=lambda zs, y: client.server_loss(back, zs, y), client_module=front,
                         server_module=back, client_params=list(front.parameters()) + client.trainables(),
                         server_params=server_params, lr=r.lr,
                         server_lr=self.server_lr if self.server_lr is not None else r.lr,
                         server_momentum=momentum, after_client_backward=client.after_backward,
                         server_optimizer=server_optimizer, client_backward=client.backward,
                         fresh_server_state=self.fresh_server_state)

    @property
    def carries_momentum(self) -> bool:
        """V2's shared server half carries its optimizer's momentum across clients and rounds."""
        return self.version == "v2" and bool(self.ctx.train.momentum) and not self.fresh_server_state

    def result(self, task: ClientTask, fit, module: Optional[nn.Module] = None,
               state: Optional[Dict[str, torch.Tensor]] = None) -> Uplink:
        """The client's uplink with the figures of a split round: the trained front it sends
        back (the exchanged keys of ``state``, default the global model), held by the rank's
        pair or by ``module``, and V1's server copy beside it (server side); what crossed the cut
        is on the fit's channel."""
        cut = task.cut
        state = state if state is not None else self.global_state
        front_keys, back_keys = self.exchanged(self.halves.front(cut)), self.exchanged(self.halves.back(cut))
        server_side = None
        if module is None:
            model = Routed(self.pair, key_regions(state, front_keys, "front."))
            if self.version == "v1":
                server_side = Routed(self.pair, key_regions(state, back_keys, "back."))
        else:
            model = Routed(module, key_regions(state, front_keys))
        metrics = split_metrics(self.halves, cut, steps=fit.steps, seconds=fit.seconds,
                                client_seconds=fit.client_seconds, server_seconds=fit.server_seconds,
                                examples=fit.examples)
        metrics.update(fit.extras)
        return Uplink(task.client, fit.num_samples, fit.loss, model=model, server_side=server_side, metrics=metrics,
                      channel=fit.channel)

    def exchanged(self, keys: List[str]) -> List[str]:
        """The keys of a half that are sent and aggregated (under sbn, no BN statistics)."""
        return [k for k in keys if k not in self.unsent]

    def stash_momentum(self, optimizer: torch.optim.Optimizer) -> None:
        from fl_lightning.modules.split import momentum_buffers

        for pid, buffer in momentum_buffers(optimizer).items():
            if pid in self.server_names:
                self.server_momentum[self.server_names[pid]] = buffer
