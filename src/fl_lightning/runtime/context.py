"""What an algorithm sees of the run it belongs to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Literal, Optional

import torch
from torch import nn

from fl_lightning.config import LocalTrainConfig

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fl_lightning.data.federated import FederatedData
    from fl_lightning.runtime.client_data import ClientData


@dataclass(frozen=True)
class Population:
    """What a method may check against before any rank starts: the clients' MAC budgets (None
    without a budget partition), the global model (on the meta device: shapes and costs, no
    values) and one example's shape."""

    budgets: Optional[torch.Tensor]
    model: nn.Module
    input_shape: tuple


@dataclass
class RunContext:
    """Handed to ``Algorithm.setup`` by the run builder (for fit, evaluate and extract alike)."""

    fabric: "Fabric"
    model: nn.Module
    """The global model on this rank's device; its state dict is the server's tensors."""
    make_model: Callable[[], nn.Module]
    """Builds a fresh instance of the architecture (per-rank worker models)."""
    data: "FederatedData"
    """Client shards (indices), server-held splits and client budgets."""
    shards: List["ClientData"]
    """Each client's mini-batch iterator over its shard."""
    train: LocalTrainConfig
    seed: int
    rounds: int
    """Rounds of the whole run."""
    clients_per_round: int
    run_dir: Path
    """Where the run's files live; algorithms write there only through ``Algorithm.artifacts``."""
    mode: Literal["fit", "evaluate"] = "fit"
    """``evaluate``: the context re-scores a saved checkpoint (evaluate, extract): no training."""
    resuming: bool = False
    """True when the run continues from a checkpoint (or re-scores one)."""

    @property
    def num_clients(self) -> int:
        return len(self.data.clients)

    @property
    def client_sizes(self) -> List[int]:
        return [len(c) for c in self.data.clients]

    @property
    def budgets(self) -> Optional[torch.Tensor]:
        return self.data.budgets

    @property
    def num_classes(self) -> int:
        return self.data.bundle.num_classes
