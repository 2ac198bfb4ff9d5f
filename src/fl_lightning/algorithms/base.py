"""Server-side policy interface, and FedAvg as its plainest implementation.

The round loop asks an algorithm four things, in order, for every client of a round:
``route`` (what physical model the client gets), ``client_module`` (the LightningModule
that trains it), ``after_client`` (per-client state updates), ``accumulate`` (merge into
the round's accumulators); then once per round ``finish_round``. Everything an algorithm
keeps across rounds is returned by ``state_dict`` and checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import lightning as L
import torch
from torch import nn

from fl_lightning.config import LocalTrainConfig
from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.routing import Routed, full_region_map, load_routed_state
from fl_lightning.federation.client_store import ClientStateStore
from fl_lightning.federation.evaluation import evaluate
from fl_lightning.federation.local_training import ClientResult
from fl_lightning.modules.supervised import SupervisedClient


@dataclass
class RunContext:
    """What the loop hands an algorithm at set-up."""

    fabric: object
    model: nn.Module
    """The global model (on the rank's device); its state dict is the server's tensors."""
    make_model: Callable[[], nn.Module]
    """Builds a fresh instance of the architecture (used for per-rank worker models)."""
    num_clients: int
    client_sizes: List[int]
    train: LocalTrainConfig
    seed: int
    budgets: Optional[torch.Tensor] = None
    extras: Dict[str, object] = field(default_factory=dict)


class Algorithm:
    """Base policy: every client trains the whole model; dense sample-weighted averaging.

    This is FedAvg; other algorithms override the hooks they change.
    """

    dense = True

    def check(self, train: LocalTrainConfig) -> None:
        """Refuse configurations the algorithm does not define (raise ConfigError)."""

    def setup(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.global_state = ctx.model.state_dict()
        # One reusable worker per rank: clients train one after another, and loading the
        # global tensors into it copies values without allocating a model per client.
        self.worker = ctx.make_model().to(ctx.fabric.device)
        self.worker_regions = full_region_map(self.worker.state_dict())
        self.store: Optional[ClientStateStore] = None

    def route(self, client: int, round_idx: int) -> Routed:
        load_routed_state(self.worker, self.global_state, self.worker_regions)
        return Routed(self.worker, self.worker_regions)

    def client_module(self, routed: Routed, client: int, round_idx: int, lr: float) -> L.LightningModule:
        t = self.ctx.train
        return SupervisedClient(routed.module, lr, t.momentum, t.weight_decay)

    def after_client(self, client: int, module: L.LightningModule, routed: Routed,
                     result: ClientResult, lr: float) -> None:
        """Per-client bookkeeping after local training (nothing for FedAvg)."""

    def new_accumulator(self) -> SparseAccumulator:
        return SparseAccumulator(self.global_state, dense=self.dense)

    def accumulate(self, acc: SparseAccumulator, routed: Routed, module: L.LightningModule,
                   result: ClientResult) -> None:
        acc.add(routed.module.state_dict(), float(result.num_samples), routed.regions)

    def round_tensors(self) -> Dict[str, torch.Tensor]:
        """Extra per-round sums to all-reduce across ranks (besides the accumulators)."""
        return {}

    def round_metrics(self, sums: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Extra per-round figures for the metrics file and TensorBoard (from the reduced sums)."""
        return {}

    def finish_round(self, new_state: Dict[str, torch.Tensor], sums: Dict[str, torch.Tensor],
                     cohort: List[int], owned: List[int]) -> None:
        """Apply the aggregated tensors to the global model."""
        with torch.no_grad():
            for key, value in new_state.items():
                self.global_state[key].copy_(value)

    def evaluate(self, fabric, split: str, batch_size: int) -> Dict[str, float]:
        """Metrics of the global model on a server split ('val' or 'test'); ``acc`` is the
        figure that selects checkpoints on 'val'."""
        data = self.ctx.extras["data"]
        dataset, indices = data.split(split)
        return evaluate(fabric, self.ctx.model, dataset, indices, data.bundle.num_classes, batch_size)

    def report(self, summary: dict) -> str:
        """Text printed at the end of a run (tables of the final evaluation); empty by default."""
        return ""

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Server state beyond the global model (empty for FedAvg)."""
        return {}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        pass


class FedAvg(Algorithm):
    """Federated averaging (McMahan et al., 2017): dense models, sample-weighted mean."""
