"""FedGH (Yi et al., ACM MM 2023): a generalized global header trained by the server on the
clients' class-averaged representations; clients keep their own feature extractors."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.personalized.head_body import class_prototypes, find_classifier, head_keys
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.option_types import PositiveFloat, PositiveInt
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.evaluation import ClientModels
from fl_lightning.runtime.link import Downlink, Uplink, held_state
from fl_lightning.runtime.plan import ClientTask
from fl_lightning.runtime.round_state import RoundAccumulator

TRAINED = "fedgh/trained"  # per-client flag in the store: 1 once the client holds a trained body
MEANS, CLASSES = "prototypes/means", "prototypes/classes"  # what a client uploads


class FedGHClient(LocalClient):
    """A FedGH client's round: its own body under the received global header, trained locally;
    what goes up is each present class's prototype and label, never the model, and the client
    keeps its trained body. Given: the classifier of the module it trains (the header, whose
    input is the representation) and the body's keys."""

    def __init__(self, round: ClientRound, classifier: torch.nn.Module, body_keys: List[str]):
        super().__init__(round)
        self.classifier, self.body_keys = classifier, body_keys

    def uplink(self, downlink: Downlink, module, fit) -> Uplink:
        """Prototypes of the trained body over the client's shard go up."""
        r, trained = self.round, downlink.model.module
        # batch statistics: the representations the header sees in local training; with running
        # statistics from a few local steps, evaluation-mode ones were up to 100x larger and the
        # server's header steps diverged
        protos, counts = class_prototypes(trained, self.classifier, r.shard.dataset, r.shard.indices,
                                          r.num_classes, r.train.batch_size, r.device, batch_stats=True)
        present = counts > 0
        return self.result(downlink, fit, tensors={MEANS: protos[present], CLASSES: torch.nonzero(present).flatten()},
                           held=held_state(trained, self.body_keys))


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
        super().__init__()
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

    def downlink(self, task, plan):
        """The global header comes down; the body in the client's model is its own."""
        return Downlink(self.route(task, plan), held_keys=self.body_keys)

    def new_client(self, task, plan):
        return FedGHClient(self.client_round(task, plan), self.worker_classifier, self.body_keys)

    def commit(self, acc: RoundAccumulator, task: ClientTask, result: Uplink, plan):
        """The client's body into the store, its prototypes (at their classes' rows) and class
        mask into the round's sums."""
        state = dict(result.held)
        state[TRAINED] = torch.ones((), device=self.ctx.fabric.device)
        acc.keep("bodies", task.client, state)
        classes = result.tensors[CLASSES]
        means = torch.zeros(self.ctx.num_classes, self.feature_dim, dtype=result.tensors[MEANS].dtype,
                            device=classes.device)
        means[classes] = result.tensors[MEANS]
        present = torch.zeros(self.ctx.num_classes, device=classes.device)
        present[classes] = 1.0
        acc.add_sum(f"proto/{task.client}", means)
        acc.add_sum(f"has/{task.client}", present)

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
