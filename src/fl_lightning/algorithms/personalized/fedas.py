"""FedAS (Yang, Huang and Ye, CVPR 2024): federated parameter alignment before local training
and Fisher-information-weighted aggregation (client synchronization)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.personalized.head_body import (batch_statistics, class_prototypes, find_classifier, forward_features,
                                               head_keys, without_single_rows)
from fl_lightning.elastic.routing import Routed, load_routed_state
from fl_lightning.option_types import NonNegativeFloat, NonNegativeInt, PositiveInt
from fl_lightning.runtime.client_data import ClientData, eval_batches
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.evaluation import ClientModels
from fl_lightning.runtime.link import Downlink, Uplink
from fl_lightning.runtime.seeding import derive_seed

ALIGN_STREAM = 33  # seed stream of the alignment pass's batch order
TRAINED = "fedas/trained"  # per-client flag in the store: 1 once the client holds a trained model
FISHER = "fisher"  # what a client uploads beside its model: the trace of its Fisher information


def fisher_trace(model: nn.Module, dataset, indices: torch.Tensor, batch_size: int, device=None) -> float:
    """``sum_batches sum_params ||grad_theta NLL(batch)||^2``: the original's estimate of the
    trace of the empirical Fisher information, over every parameter, the batch NLL being the
    mean over the batch (batches in shard order, a one-row last batch joined to the one
    before). Batch norm on batch statistics, dropout off
    (:func:`batch_statistics`): with running statistics from a few local steps the traces of
    one round spanned five orders of magnitude, so the weights measured the statistics' lag,
    not the training."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    with batch_statistics(model):
        for x, y in without_single_rows(eval_batches(dataset, indices, batch_size, device)):
            nll = F.cross_entropy(model(x).float(), y)
            grads = torch.autograd.grad(nll, params, allow_unused=True)
            total += float(torch.stack([g.double().pow(2).sum() for g in grads if g is not None]).sum())
    return total


def alignment_loss(features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor,
                   present: torch.Tensor) -> torch.Tensor:
    """``sum_{c in batch, c known} mean_{i: y_i = c} mean_d (f_i,d - z_c,d)^2`` (the original's
    per-class ``MSELoss`` summed over the batch's classes)."""
    loss = features.new_zeros(())
    for c in labels.unique().tolist():
        if present[c]:
            f = features[labels == c]
            loss = loss + F.mse_loss(f, prototypes[c].to(f.dtype).expand_as(f))
    return loss


@dataclass(frozen=True)
class Alignment:
    """FedAS's parameter-alignment settings, as a client reads them (the method's options)."""

    lr: float
    epochs: int
    batch_size: int
    unseen: bool


@dataclass(frozen=True)
class PersonalModel:
    """The rank's worker a FedAS client trains in, split into the shared body and the
    personalized head."""

    worker: nn.Module
    regions: dict
    classifier: nn.Module
    head_keys: List[str]
    body_params: List[torch.Tensor]

    def load(self, state: Dict[str, torch.Tensor], keys) -> None:
        """Copy ``keys`` of ``state`` into the worker."""
        local = self.worker.state_dict()
        with torch.no_grad():
            for key in keys:
                local[key].copy_(state[key])


def align_body(model: PersonalModel, alignment: Alignment, shard: ClientData, prototypes: torch.Tensor,
               present: torch.Tensor, generator: torch.Generator, device=None) -> float:
    """Plain SGD (no momentum, no clipping, as the original) on the worker's body towards the
    prototypes, batch norm on batch statistics as the prototypes were read (in evaluation mode
    the alignment diverged: loss 2.2e27 in round 0); the running statistics stay the global
    model's. Returns the mean alignment loss."""
    optimizer = torch.optim.SGD(model.body_params, lr=alignment.lr)
    data = ClientData(shard.dataset, shard.indices, alignment.batch_size, device)
    losses = []
    with batch_statistics(model.worker):
        for _ in range(alignment.epochs):
            for x, y in without_single_rows(data.epoch(generator)):
                features, _ = forward_features(model.worker, model.classifier, x)
                loss = alignment_loss(features.reshape(-1, features.shape[-1]), y.reshape(-1), prototypes, present)
                if not loss.requires_grad:  # no class of the batch has a prototype
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)
    return sum(losses) / max(len(losses), 1)


class FedASClient(LocalClient):
    """A FedAS client's round: parameter alignment of the received body towards the prototypes
    of its previous local model (``held``: the common initial model until it has trained),
    local training with its own head, then the trace of its Fisher information (the aggregation
    weight); the whole trained model and the trace go up, and the client keeps its model.

    Given: whether it has trained before, the rank's worker (the downlink's module, split into
    body and head) and the alignment settings."""

    align_loss = 0.0
    """Mean loss of the round's alignment passes (0 when the client does not align)."""

    def __init__(self, round: ClientRound, seen: bool, model: PersonalModel, alignment: Alignment):
        super().__init__(round)
        self.seen, self.model, self.alignment = seen, model, alignment

    def objective(self, downlink: Downlink):
        """The received global body aligned to the client's prototypes, under its own head."""
        r, model, alignment, previous = self.round, self.model, self.alignment, downlink.held
        if alignment.epochs > 0 and (self.seen or alignment.unseen):
            received = {k: v.detach().clone() for k, v in model.worker.state_dict().items()}
            model.load(previous, received.keys())
            prototypes, counts = class_prototypes(model.worker, model.classifier, r.shard.dataset, r.shard.indices,
                                                  r.num_classes, alignment.batch_size, r.device, batch_stats=True)
            model.load(received, received.keys())
            generator = torch.Generator().manual_seed(derive_seed(r.seed, ALIGN_STREAM, r.round_idx, r.client))
            self.align_loss = align_body(model, alignment, r.shard, prototypes, counts > 0, generator, r.device)
        model.load(previous, model.head_keys)  # the personalized head
        return super().objective(downlink)

    def uplink(self, downlink: Downlink, module, fit) -> Uplink:
        """The trained model goes up with the trace of its Fisher information; the client keeps
        its model."""
        r, trained = self.round, downlink.model.module
        fisher = fisher_trace(trained, r.shard.dataset, r.shard.indices, r.train.batch_size, r.device)
        held = {k: v.detach().clone() for k, v in trained.state_dict().items()}
        return self.result(downlink, fit, model=downlink.model, tensors={FISHER: torch.tensor(fisher, dtype=torch.float64)},
                           held=held, figures={"fisher_trace": fisher, "align_loss": self.align_loss})


class FedAS(FedAvg):
    """Federated parameter alignment and client synchronization (Yang et al., 2024).

    The model is a shared body and a personalized head (the final linear classifier, as in the
    original's ``BaseHeadSplit``); every client keeps its whole local model in the server's
    per-client store (a client never seen holds the common initial model).

    Parameter alignment, before a client trains: it computes the per-class mean representation
    (prototype) of its shard with its previous local model, then takes ``align_epochs`` SGD
    passes (learning rate ``align_lr``, batches of ``align_batch_size``) on the received global
    body to minimize the summed per-class MSE between the global body's representations and
    those prototypes. Its local model becomes the aligned global body with its own head.

    Client synchronization: after local training (the whole model), the client computes the
    trace of its empirical Fisher information, ``F_i = sum_batches ||grad NLL||^2`` over every
    parameter; the server averages the returned models with weights ``F_i / sum_j F_j`` over
    the round's clients (instead of FedAvg's sample counts).

    Prototypes, alignment and Fisher trace run batch norm on batch statistics, as local
    training does, and leave the running statistics untouched (the original's network has no
    batch norm; in evaluation mode these passes diverged here).

    Evaluation: ``acc``/``loss`` are the mean over clients that have trained of their stored
    local model's figures on the server split; ``global_acc``/``global_loss`` those of the
    aggregated global model (the figures before any client has trained, and in
    ``fl_lightning evaluate``). Details and every choice: docs/fl_baselines.md.
    """

    def __init__(self, align_lr: NonNegativeFloat = 0.01, align_epochs: NonNegativeInt = 1,
                 align_batch_size: PositiveInt = 16,
                 align_unseen: bool = True):
        """
        Args:
            align_lr: SGD step size of the parameter alignment (0.01 in the original code).
            align_epochs: alignment passes over the client's shard (1 in the original code; 0
                disables the alignment: clients start from the global body and their own head).
            align_batch_size: mini-batch size of the prototype and alignment passes (16 in the
                original code).
            align_unseen: also align a client that has never trained, towards the prototypes of
                the common initial model (the original code does; false: it starts from the
                global body unchanged).
        """
        super().__init__()
        self.alignment = Alignment(align_lr, align_epochs, align_batch_size, align_unseen)

    def prepare(self, ctx):
        super().prepare(ctx)
        keys = head_keys(self.worker)
        _, classifier = find_classifier(self.worker)
        head = set(keys)
        body_params = [p for n, p in self.worker.named_parameters() if n not in head]
        self.model = PersonalModel(self.worker, self.worker_regions, classifier, keys, body_params)
        # setup runs before a checkpoint is loaded: this is the common initial model
        self.init_state = {k: v.detach().clone() for k, v in self.global_state.items()}
        self.store = self.keep(ClientStateStore(lambda: {
            **{k: torch.zeros_like(v) for k, v in self.global_state.items()},
            TRAINED: torch.zeros((), device=ctx.fabric.device)}))

    # -- a round --------------------------------------------------------------------------------
    def downlink(self, task, plan):
        """The global model in the rank's worker (its body crosses; the head is the client's
        own) and the client's previous local model (the common initial one until it has
        trained), which the client holds."""
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        previous = self.store.kept(task.client, TRAINED)
        return Downlink(Routed(self.worker, self.worker_regions), held=previous if previous is not None else self.init_state,
                        held_keys=self.model.head_keys)

    def new_client(self, task, plan):
        return FedASClient(self.client_round(task, plan), self.store.kept(task.client, TRAINED) is not None,
                           self.model, self.alignment)

    def commit(self, acc, task, result, plan):
        """Fisher-weighted accumulation (the accumulator divides by the summed traces, so the
        weights are ``F_i / sum_j F_j``) and the client's local model into the store."""
        acc.add(result.model.module.state_dict(), float(result.tensors[FISHER]), result.model.regions)
        kept = dict(result.held)
        kept[TRAINED] = torch.ones((), device=self.ctx.fabric.device)
        acc.keep("models", task.client, kept)

    def new_accumulator(self, plan):
        acc = super().new_accumulator(plan)
        acc.register("models", self.store)  # each client's local model, served to it
        return acc

    # -- evaluation -----------------------------------------------------------------------------
    def client_models(self, split):
        """Each client that has trained serves its stored local model."""
        def personal(client: int):
            self.model.load(self.store.kept(client, TRAINED), self.global_state.keys())
            return self.worker

        return ClientModels(self.store.holding(TRAINED), personal)
