"""A client's round as an object: the procedure one client runs, apart from the server's policy.

The method (a ``FedAvg`` or one of its family) is the server: it plans the round, says what a client receives
and how results merge. For each task it makes a client object (``FedAvg.new_client(task,
plan)``) whose ``fit()`` runs that client's round and returns its ``ClientResult``. Whatever
the round learns about the client (FedAS's alignment loss and Fisher trace, FedGH's
prototypes, FedSGA's prompt) lives on the object or travels on the result, never on the method.

- :class:`LocalClient`: federated local training. ``receive`` (the routed model comes down),
  train, ``after_training`` (what goes back up, and the result), then the method's
  per-client figures. FedAS aligns before training and measures its Fisher trace after; FedGH
  uploads prototypes instead of its model.
- ``split/common.py``'s ``SplitClient``: split learning, the server half in the loop. It is
  given the rank's split engine (``split/engine.py``) and its ``fit`` runs the round on it: the
  engine builds the client/server pair, trains it and makes the result; the client object
  supplies its forward, backward and the server's loss and step on its batches.

Every client gets its round as a frozen :class:`ClientRound` (the task, the round's learning
rate, the training settings, its shard, the device, its batch-order stream) and the method's
hyper-parameters it needs as a small frozen dataclass of the method's (FedAS's ``Alignment``,
FedSGA's ``FedSGASettings``), so that what a client may read is written down in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Type

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.channel import Channel
from fl_lightning.runtime.local_training import LocalFit, train_locally
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.seeding import client_generator

if TYPE_CHECKING:
    from fl_lightning.algorithms.fedavg import FedAvg


@dataclass(frozen=True)
class ClientRound:
    """What a client is given for its round, fixed when its object is made."""

    task: ClientTask
    round_idx: int
    lr: float
    """The round's learning rate (every client of a round uses the same)."""
    train: LocalTrainConfig
    shard: Any
    """The client's ``ClientData`` (its examples, batched)."""
    fabric: Any
    seed: int
    num_classes: int

    @classmethod
    def of(cls, ctx, task: ClientTask, plan: RoundPlan) -> "ClientRound":
        return cls(task, plan.round_idx, plan.lr, ctx.train, ctx.shards[task.client], ctx.fabric, ctx.seed,
                   ctx.num_classes)

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    def generator(self) -> torch.Generator:
        """The client's batch-order stream of this round: a function of (seed, round, client) only."""
        return client_generator(self.seed, self.round_idx, self.task.client)


class Client:
    """One client's round of ``method`` (the method that made it): ``round`` is what the client
    is given; the method is the server it talks to."""

    def __init__(self, method: "FedAvg", task: ClientTask, plan: RoundPlan):
        self.method, self.task, self.plan = method, task, plan
        self.round = ClientRound.of(method.ctx, task, plan)

    def fit(self) -> ClientResult:
        """Run the client's round; the result is committed by the method if it is finite."""
        raise NotImplementedError


class LocalClient(Client):
    """Receive the routed model, train it locally, send it back (the default of every FL method)."""

    def __init__(self, method: "FedAvg", task: ClientTask, plan: RoundPlan):
        super().__init__(method, task, plan)
        self.channel = Channel()
        """Everything that crosses between the server and this client in the round."""

    def fit(self) -> ClientResult:
        routed = self.receive()
        module = self.method.client_module(routed, self.task, self.plan)
        fit = self.train(module)
        result = self.after_training(routed, module, fit)
        result.metrics.update(self.method.client_figures(self.task, result, self.plan))
        return result

    def receive(self) -> Routed:
        """The model the client starts from (the method's routing), sent down the channel."""
        routed = self.method.route(self.task, self.plan)
        self.method.send_model(self.channel, routed, self.task)
        return routed

    def train(self, module) -> LocalFit:
        """Local training over the client's shard, batches drawn from its (seed, round, client) stream."""
        r = self.round
        return train_locally(r.fabric, module, r.shard, r.train, r.generator())

    def after_training(self, routed: Routed, module, fit: LocalFit) -> ClientResult:
        """What the trained client sends up (the method's ``return_model``), and its result."""
        self.method.return_model(self.channel, routed, self.task)
        return self.result(routed, module, fit)

    def result(self, routed: Routed, module, fit: LocalFit, kind: Type[ClientResult] = ClientResult,
               figures: Optional[dict] = None, **fields) -> ClientResult:
        """The client's result (of type ``kind``, with ``fields``): the trained model, the fit's
        ``steps`` and ``seconds`` then ``figures`` in its metrics, and the client's channel."""
        metrics = {"steps": fit.steps, "seconds": fit.seconds, **(figures or {})}
        return kind(self.task.client, fit.num_samples, fit.loss, update=routed, module=module, metrics=metrics,
                    channel=self.channel, **fields)
