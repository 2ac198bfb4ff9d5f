"""FedGH (Yi et al., ACM MM 2023): a generalized global header trained by the server on the
clients' class-averaged representations; clients keep their own feature extractors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.client import LocalClient
from fl_lightning.algorithms.personalized.head_body import class_prototypes, find_classifier, head_keys
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.channel import DOWN
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.evaluation import ClientModels
from fl_lightning.runtime.plan import ClientTask
from fl_lightning.runtime.result import ClientResult
from fl_lightning.runtime.round_state import RoundAccumulator

TRAINED = "fedgh/trained"  # per-client flag in the store: 1 once the client holds a trained body


@dataclass
class Prototypes:
    """What a FedGH client uploads: its per-class mean representations."""

    means: torch.Tensor
    """``[C, D]``; rows of classes the client does not hold are zero and are not sent."""
    present: torch.Tensor
    """``[C]`` float mask of the classes the client holds."""


class FedGHClient(LocalClient):
    """A FedGH client's round: its own body under the global header, trained locally; what goes
    up is each present class's prototype and label, never the model. Given: the worker's
    classifier (the header, whose input is the representation)."""

    def __init__(self, method, task, plan, classifier: torch.nn.Module):
        super().__init__(method, task, plan)
        self.classifier = classifier

    def after_training(self, routed, module, fit) -> ClientResult:
        """Prototypes of the trained body over the client's shard go up, as the result's payload."""
        r = self.round
        # batch statistics: the representations the header sees in local training; with running
        # statistics from a few local steps, evaluation-mode ones were up to 100x larger and the
        # server's header steps diverged
        protos, counts = class_prototypes(routed.module, self.classifier, r.shard.dataset, r.shard.indices,
                                          r.num_classes, r.train.batch_size, r.device, batch_stats=True)
        present = counts > 0
        # no return_model: the model never goes up, only each present class's prototype and label
        self.channel.up("prototypes", protos[present], torch.nonzero(present).flatten())
        return self.result(routed, module, fit, payload=Prototypes(protos, present.float()))


class FedGH(FedAvg):
    """Generalized global header (Yi et al., 2023).

    Each round the cohort receives the global header (the final linear classifier) and puts it
    on its own feature extractor (the body, kept per client, never aggregated); it trains the
    whole local model on its shard, then sends the per-class mean of the representations that
    enter the header, computed with the trained body over its shard (batch norm on batch
    statistics, as in local training; classes it does not hold are not sent). The server
    trains the global header on those (prototype, class) pairs with cross-entropy and SGD, one
    step per prototype in cohort order and class order by default, and the clients adopt it.

    Bodies live in the server's per-client store (a client never seen keeps the common initial
    body). Evaluation: the mean over clients that have trained of the accuracy (and loss) of
    their body with the current global header on the server split; before any client has
    trained, or without the store (``fl_lightning evaluate``), the global model (initial body,
    global header). Details: docs/fl_baselines.md.
    """

    def __init__(self, server_lr: Optional[PositiveFloat] = None, server_epochs: PositiveInt = 1,
                 server_batch_size: PositiveInt = 1):
        """
        Args:
            server_lr: the server's SGD step size for the global header (None: the round's
                client learning rate, as the original code steps the header with the clients'
                optimizer settings).
            server_epochs: passes over the round's prototypes.
            server_batch_size: prototypes per server step (1: one step per prototype, the
                original's loop).
        """
        self.server_lr = server_lr
        self.server_epochs = server_epochs
        self.server_batch_size = server_batch_size

    def prepare(self, ctx):
        super().prepare(ctx)
        self.head_keys = head_keys(ctx.model)
        self.body_keys = [k for k in self.global_state if k not in self.head_keys]
        _, self.header = find_classifier(ctx.model)  # shares the global tensors
        _, self.worker_classifier = find_classifier(self.worker)
        self.feature_dim = self.header.in_features
        body = {k: self.global_state[k] for k in self.body_keys}
        self.store = self.keep(ClientStateStore(lambda: {**{k: torch.zeros_like(v) for k, v in body.items()},
                                                         TRAINED: torch.zeros((), device=ctx.fabric.device)}))

    def new_accumulator(self, plan):
        """No model is averaged: each cohort client's prototypes and class mask (zeros where
        it was not committed), so every rank trains the same header, and its body."""
        acc = RoundAccumulator(SparseAccumulator({}, dense=True))
        for client in plan.cohort:
            acc.declare(f"proto/{client}", torch.zeros(self.ctx.num_classes, self.feature_dim))
            acc.declare(f"has/{client}", torch.zeros(self.ctx.num_classes))
        acc.register("bodies", self.store)
        return acc

    # -- a round --------------------------------------------------------------------------------

    def route(self, task, plan):
        """The client's model: its own body (the initial one until it has trained) with the
        current global header."""
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        body = self.store.kept(task.client, TRAINED)
        if body is not None:
            local = self.worker.state_dict()
            with torch.no_grad():
                for key in self.body_keys:
                    local[key].copy_(body[key])
        return Routed(self.worker, self.worker_regions)

    def new_client(self, task, plan):
        return FedGHClient(self, task, plan, self.worker_classifier)

    def send_model(self, channel, routed, task) -> None:
        """The global header comes down (the body is the client's own)."""
        channel.send_state(DOWN, "model", self.global_state, self.head_keys)

    def commit(self, acc: RoundAccumulator, task: ClientTask, result: ClientResult[Prototypes], plan):
        local = result.update.module.state_dict()
        state = {k: local[k].detach().clone() for k in self.body_keys}
        state[TRAINED] = torch.ones((), device=self.ctx.fabric.device)
        acc.keep("bodies", task.client, state)
        acc.add_sum(f"proto/{task.client}", result.payload.means)
        acc.add_sum(f"has/{task.client}", result.payload.present)

    def finish_round(self, acc, plan):
        features, labels = [], []
        for client in plan.cohort:
            mask = acc[f"has/{client}"] > 0
            features.append(acc[f"proto/{client}"][mask])
            labels.append(torch.nonzero(mask).flatten())
        if features:
            self.train_header(torch.cat(features), torch.cat(labels), plan.lr)
        return {}

    def train_header(self, prototypes: torch.Tensor, labels: torch.Tensor, round_lr: float) -> None:
        """SGD on ``cross_entropy(header(prototype), class)`` over the prototypes in order."""
        lr = self.server_lr if self.server_lr is not None else round_lr
        params = list(self.header.parameters())
        with torch.enable_grad():
            for _ in range(self.server_epochs):
                for start in range(0, len(labels), self.server_batch_size):
                    p = prototypes[start:start + self.server_batch_size].to(params[0].dtype)
                    loss = F.cross_entropy(self.header(p), labels[start:start + self.server_batch_size])
                    grads = torch.autograd.grad(loss, params)
                    with torch.no_grad():
                        for param, grad in zip(params, grads):
                            param.sub_(grad, alpha=lr)

    # -- evaluation -----------------------------------------------------------------------------
    def client_models(self, split):
        """Each client that has trained serves its own body under the global header."""
        def personal(client: int):
            self.route(ClientTask(client), None)
            return self.worker

        return ClientModels(self.store.holding(TRAINED), personal)
