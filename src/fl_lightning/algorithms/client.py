"""A client's round as an object: the procedure one client runs, apart from the server's policy.

The method (a ``FedAvg`` or one of its family) is the server: it plans the round, builds what a
client receives (its ``downlink``) and commits what comes back. For each task it makes a client
object (``FedAvg.new_client(task, plan)``) from the client's round and the method's settings
alone; the object never sees the method. Its ``fit(downlink)`` runs the client's round on what
the downlink carries and returns an ``Uplink`` (``runtime/link.py``): the client owns its
objective and its figures, the method owns plan, route and aggregate, and the direction is one
way.

- :class:`LocalClient`: federated local training of the received model with cross-entropy and
  SGD. A client with another objective overrides :meth:`LocalClient.objective` (FedProx's
  proximal term, SCAFFOLD's corrected steps, FEAST's variants) and, when it sends back more
  or less than its trained model, :meth:`LocalClient.uplink` (SCAFFOLD's ``delta c_i``, FedGH's
  prototypes, FedBABU's body).
- ``split/common.py``'s ``SplitClient``: split learning, the server half in the loop, on the
  rank's split engine.

Every client gets its round as a frozen :class:`ClientRound` (the task, the round's learning
rate, the training settings, its shard, the device, its batch-order stream) and the method's
hyper-parameters it needs as a small frozen dataclass of the method's (FedAS's ``Alignment``,
FedSGA's ``FedSGASettings``), so that what a client may read is written down in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.local_training import LocalFit, train_locally
from fl_lightning.runtime.plan import ClientTask, RoundPlan
from fl_lightning.runtime.seeding import client_generator


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
    def client(self) -> int:
        return self.task.client

    @property
    def device(self) -> torch.device:
        return self.fabric.device

    def generator(self) -> torch.Generator:
        """The client's batch-order stream of this round: a function of (seed, round, client) only."""
        return client_generator(self.seed, self.round_idx, self.task.client)


class Client:
    """One client's round, given its :class:`ClientRound`; ``fit`` runs it on a downlink."""

    def __init__(self, round: ClientRound):
        self.round = round

    @property
    def task(self) -> ClientTask:
        return self.round.task

    def fit(self, downlink: Downlink) -> Uplink:
        """Run the client's round on what ``downlink`` carries; the uplink is committed by the
        method if it is finite."""
        raise NotImplementedError


class LocalClient(Client):
    """Train the received model locally with cross-entropy and SGD, send it back (the default
    of every FL method)."""

    def fit(self, downlink: Downlink) -> Uplink:
        module = self.objective(downlink)
        fit = self.train(module)
        return self.uplink(downlink, module, fit)

    def objective(self, downlink: Downlink):
        """The LightningModule that trains the received model (plain cross-entropy and SGD at the
        run's momentum and weight decay)."""
        from fl_lightning.modules.supervised import SupervisedClient

        r = self.round
        return SupervisedClient(downlink.model.module, r.lr, r.train.momentum, r.train.weight_decay)

    def train(self, module) -> LocalFit:
        """Local training over the client's shard, batches drawn from its (seed, round, client) stream."""
        r = self.round
        return train_locally(r.fabric, module, r.shard, r.train, r.generator())

    def uplink(self, downlink: Downlink, module, fit: LocalFit) -> Uplink:
        """What goes back: the received model, trained (every region it received)."""
        return self.result(downlink, fit, model=downlink.model)

    def result(self, downlink: Downlink, fit: LocalFit, model: Optional[Routed] = None,
               figures: Optional[Dict[str, float]] = None, **fields) -> Uplink:
        """The client's uplink: ``model`` (what goes up of it), the fit's ``steps`` and
        ``seconds`` then ``figures`` in its metrics, on the client's channel, with ``fields``
        (``tensors``, ``held``)."""
        metrics = {"steps": fit.steps, "seconds": fit.seconds, **(figures or {})}
        return Uplink(self.task.client, fit.num_samples, fit.loss, model=model, metrics=metrics,
                      channel=downlink.channel, **fields)
