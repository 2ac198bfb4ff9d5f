"""FedBABU (Oh et al., ICLR 2022): federated training of the body only; the head stays at its
random initialization, and is fine-tuned (with the body) on each client for personalization."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Literal, Optional, Tuple

import torch

from fl_lightning.algorithms.client import ClientRound, LocalClient
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.personalized.head_body import head_keys
from fl_lightning.option_types import NonNegativeFloat, NonNegativeInt, PositiveFloat
from fl_lightning.elastic.routing import Routed
from fl_lightning.runtime.evaluation import ClientModels
from fl_lightning.runtime.local_training import train_locally
from fl_lightning.runtime.seeding import derive_seed

FINETUNE_STREAM = 32  # seed stream of the personalization fine-tuning (batch order, dropout)

FinetunePart = Literal["full", "head"]


class BodyClient(LocalClient):
    """A FedBABU client: trains the received model (its head frozen in it) and sends back the
    body only: the head is fixed and known to everyone."""

    def __init__(self, round: ClientRound, body_keys: List[str]):
        super().__init__(round)
        self.body_keys = set(body_keys)

    def uplink(self, downlink, module, fit):
        routed = downlink.model
        body = Routed(routed.module, {k: v for k, v in routed.regions.items() if k in self.body_keys})
        return self.result(downlink, fit, model=body)


class FedBABU(FedAvg):
    """Body aggregation and body update (Oh et al., 2022).

    During federated training the head (the final linear classifier, found from the model's
    ``head_modules()``) is frozen at its random initialization: clients update only the body
    (learning rate 0 for the head), and only the body is aggregated (sample-weighted, as FedAvg).
    The global model is evaluated as it is (a random, fixed head on the learned body).

    Personalization (the paper's evaluation): each client fine-tunes the global model on its own
    shard for ``finetune_epochs`` epochs, the whole network by default as in the paper (SGD at a
    hundredth of the training rate with its momentum and no weight decay, as the authors), and the
    mean accuracy of the fine-tuned models on their clients' test shards (``eval.client_test``) is
    reported as ``ft_acc`` (and ``ft_loss``). It runs only where it is cheap enough: on the test split once the last round
    is done (the final and best-checkpoint figures) and in ``fl_lightning evaluate``.
    Details: docs/fl_baselines.md.
    """

    def __init__(self, finetune_epochs: NonNegativeInt = 5, finetune_part: FinetunePart = "full",
                 finetune_lr: Optional[PositiveFloat] = None, finetune_lr_scale: PositiveFloat = 0.01,
                 finetune_weight_decay: Optional[NonNegativeFloat] = 0.0, **kwargs):
        """
        Args:
            finetune_epochs: personalization epochs tau_f of each client's fine-tuning before
                the ``ft_acc`` figure (0: no personalization figures).
            finetune_part: what fine-tuning updates: full (body and head, the paper's default)
                or head (the head only).
            finetune_lr: fine-tuning learning rate; None: ``finetune_lr_scale * train.lr``.
            finetune_lr_scale: the fine-tuning rate as a fraction of train.lr when
                ``finetune_lr`` is None; 0.01 as the authors' personalization (lr 1e-3 after
                training at 0.1). Momentum is always train.momentum.
            finetune_weight_decay: weight decay while fine-tuning (0.0, as the authors' fine-tuning
                optimizer; None: train.weight_decay).
            **kwargs: FedAvg's served-statistics options of the global model (``bn``, ...).
        """
        super().__init__(**kwargs)
        self.finetune_epochs = finetune_epochs
        self.finetune_part = finetune_part
        self.finetune_lr = finetune_lr
        self.finetune_lr_scale = finetune_lr_scale
        self.finetune_weight_decay = finetune_weight_decay

    def finetune_optimizer(self, train) -> Tuple[float, float, float]:
        """``(lr, momentum, weight_decay)`` of the personalization SGD for training config ``train``."""
        lr = self.finetune_lr if self.finetune_lr is not None else self.finetune_lr_scale * train.lr
        wd = self.finetune_weight_decay if self.finetune_weight_decay is not None else train.weight_decay
        return lr, train.momentum, wd

    def prepare(self, ctx):
        super().prepare(ctx)
        self.head_keys = head_keys(self.worker)
        self.head_params = [p for n, p in self.worker.named_parameters() if n in self.head_keys]
        self.body_keys = [k for k in self.global_state if k not in self.head_keys]
        self._freeze_head()
        self.rounds_done = 0

    def _freeze_head(self) -> None:
        for p in self.worker.parameters():
            p.requires_grad_(True)
        for p in self.head_params:
            p.requires_grad_(False)  # no gradient: SGD (momentum, weight decay) leaves it bit-identical

    # -- a round --------------------------------------------------------------------------------
    def new_client(self, task, plan):
        return BodyClient(self.client_round(task, plan), self.body_keys)

    def finish_round(self, acc, plan):
        new_state = acc.result()
        self.apply({key: new_state[key] for key in self.body_keys if key in new_state})
        self.rounds_done = plan.round_idx + 1
        return {}

    # -- evaluation -----------------------------------------------------------------------------
    def client_models(self, split):
        """Every client's fine-tuned copy of the global model, as ``ft_*`` figures; only on the
        test split once the last round is done (and in ``fl_lightning evaluate``), where it is
        cheap enough. The figures of one global model are computed once (its fingerprint)."""
        ctx = self.ctx
        final = ctx.mode == "evaluate" or self.rounds_done >= ctx.rounds
        if self.finetune_epochs == 0 or split != "test" or not final:
            return None
        fingerprint = tuple(float(v.double().sum()) for v in self.global_state.values() if v.is_floating_point())
        return ClientModels(range(ctx.num_clients), self.finetuned, prefix="ft_", fingerprint=fingerprint)

    def finetuned(self, client: int):
        """The worker holding the global model fine-tuned on ``client``'s shard."""
        from fl_lightning.modules.supervised import SupervisedClient

        ctx = self.ctx
        cfg = replace(ctx.train, epochs=self.finetune_epochs, steps=None)
        lr, momentum, weight_decay = self.finetune_optimizer(ctx.train)
        self.worker.load_state_dict(self.global_state)
        for p in self.worker.parameters():
            p.requires_grad_(self.finetune_part == "full")
        for p in self.head_params:
            p.requires_grad_(True)
        try:
            torch.manual_seed(derive_seed(ctx.seed, FINETUNE_STREAM, client, 1))
            module = SupervisedClient(self.worker, lr, momentum, weight_decay)
            train_locally(ctx.fabric, module, ctx.shards[client], cfg,
                          torch.Generator().manual_seed(derive_seed(ctx.seed, FINETUNE_STREAM, client)))
        finally:
            self._freeze_head()
        return self.worker
