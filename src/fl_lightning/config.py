"""Configuration dataclasses. The docstring under each field is its ``--help`` text.

Every experiment is one YAML file in ``configs/`` whose sections match these classes; the
resolved configuration is saved next to each run. ``validate`` checks what types alone cannot
(ranges, cross-field constraints) before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fl_lightning.errors import ConfigError


@dataclass
class DataConfig:
    name: str = "digits"
    """Dataset: digits, synthetic, cifar10, cifar100, emnist, cinic10, tinyimagenet, domainnet, shakespeare."""
    root: str = "data"
    """Directory holding (or receiving, with ``download``) the dataset files."""
    download: bool = False
    """Download through torchvision when the files are missing (CIFAR, EMNIST only)."""
    augment: bool = True
    """Apply the dataset's training augmentation (random crop and flip for images)."""
    options: Dict[str, Any] = field(default_factory=dict)
    """Dataset-specific options, e.g. ``{num_classes: 10, image_size: 32}`` for synthetic."""
    randaugment: Optional[List[int]] = None
    """RandAugment [num_ops, magnitude] ahead of the training transform, e.g. [2, 6] (FEAST);
    uint8 image datasets only."""
    server_source: str = "train"
    """Where the server-held validation and calibration splits come from: train (carved out of
    the training pool before partitioning) or valid (the dataset's separate validation split,
    e.g. CINIC-10's valid/, so every training example goes to clients)."""
    val_size: int = 0
    """Server-held examples for validation and checkpoint selection."""
    calib_size: int = 0
    """Server-held examples for batch-norm recalibration."""


@dataclass
class BudgetConfig:
    zipf_s: float = 1.2
    """Zipf exponent of client budget ranks (FEAST Supp. A, Eq. 1)."""
    b_min: float = 25e6
    """Smallest client budget in MACs (FEAST Supp. A, Eq. 2)."""
    b_max: float = 1500e6
    """Largest client budget in MACs."""
    b_cap: float = 600e6
    """Allocation cap: budgets above it get no more allocation weight (FEAST Eq. 1)."""


@dataclass
class PartitionConfig:
    method: str = "dirichlet"
    """How training examples go to clients: iid, dirichlet, natural, gamma_dirichlet."""
    num_clients: int = 20
    """Number of clients N."""
    alpha: float = 0.3
    """Dirichlet concentration (alpha_data for gamma_dirichlet)."""
    alpha_eff: Optional[float] = None
    """If set, alpha (alpha_data) is chosen so that alpha_eff = alpha_data N_train / (K N)
    (FEAST Supp. Eq. 8; the paper matches alpha_eff = 0.45 across datasets)."""
    gamma: float = 1.0
    """gamma_dirichlet: expected data share proportional to min(budget, b_cap)^gamma."""
    min_size: int = 10
    """A partition is redrawn while any client holds fewer examples than this."""
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    """Client MAC budgets (used by gamma_dirichlet and budget-aware algorithms)."""


@dataclass
class ModelConfig:
    name: str = "cnn"
    """Architecture from the model registry: cnn, resnet18, lstm, vit, ofa_resnet."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra constructor arguments of the architecture."""


@dataclass
class LocalTrainConfig:
    epochs: int = 1
    """Local epochs per round (ignored when ``steps`` is set)."""
    steps: Optional[int] = None
    """Fixed number of local optimizer steps per round instead of epochs."""
    batch_size: int = 32
    """Local mini-batch size."""
    lr: float = 0.05
    """Initial local learning rate."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """SGD weight decay."""
    grad_clip: Optional[float] = None
    """Clip the gradient's global L2 norm to this value before each step (None: no clipping)."""
    lr_schedule: str = "constant"
    """Learning rate over rounds: constant, exponential (lr * decay^round), cosine (over all rounds)."""
    lr_decay: float = 0.995
    """Per-round factor of the exponential schedule."""


@dataclass
class FederationConfig:
    rounds: int = 50
    """Number of communication rounds."""
    clients_per_round: int = 10
    """Clients m sampled uniformly without replacement each round."""


@dataclass
class EvalConfig:
    every: int = 5
    """Evaluate every this many rounds (and after the last round)."""
    batch_size: int = 512
    """Evaluation batch size."""
    test: str = "every"
    """When to score the test set: every (at each evaluation, for curves; it never selects) or
    final (once, at the end, on the best-validation and the last model)."""


@dataclass
class FabricConfig:
    accelerator: str = "auto"
    """cpu, cuda, mps or auto (a GPU when present)."""
    devices: int = 1
    """Processes (ranks) on this node; each rank trains a share of every round's clients."""
    num_nodes: int = 1
    """Number of nodes."""
    strategy: str = "auto"
    """Fabric strategy; auto picks ddp when devices > 1. Client models are never wrapped."""
    precision: str = "32-true"
    """Fabric precision, e.g. 32-true, bf16-mixed (GPU)."""
    threads_per_rank: Optional[int] = 1
    """torch intra-op CPU threads per rank. The default 1 makes results independent of the
    number of ranks (a run's numbers depend on its thread count); more threads speed up a
    single CPU rank with large layers. None leaves Lightning's default (cores / ranks)."""


SCHEDULES = ("constant", "exponential", "cosine")


def validate(data: DataConfig, partition: PartitionConfig, train: LocalTrainConfig,
             federation: FederationConfig, evaluation: EvalConfig, fabric: FabricConfig) -> None:
    """Range and cross-field checks; raise ConfigError naming the first bad key."""
    checks = [
        ("partition.num_clients", partition.num_clients >= 1, "must be >= 1"),
        ("partition.alpha", partition.alpha > 0, "must be > 0"),
        ("partition.gamma", partition.gamma >= 0, "must be >= 0"),
        ("partition.alpha_eff", partition.alpha_eff is None or partition.alpha_eff > 0, "must be > 0 or null"),
        ("partition.min_size", partition.min_size >= 0, "must be >= 0"),
        ("federation.rounds", federation.rounds >= 1, "must be >= 1"),
        ("federation.clients_per_round", federation.clients_per_round >= 1, "must be >= 1"),
        ("federation.clients_per_round", federation.clients_per_round <= partition.num_clients,
         f"must be <= partition.num_clients ({partition.num_clients})"),
        ("train.epochs", train.epochs >= 1, "must be >= 1"),
        ("train.steps", train.steps is None or train.steps >= 1, "must be >= 1 or null"),
        ("train.batch_size", train.batch_size >= 1, "must be >= 1"),
        ("train.lr", train.lr > 0, "must be > 0"),
        ("train.momentum", 0 <= train.momentum < 1, "must be in [0, 1)"),
        ("train.weight_decay", train.weight_decay >= 0, "must be >= 0"),
        ("train.grad_clip", train.grad_clip is None or train.grad_clip > 0, "must be > 0 or null"),
        ("train.lr_schedule", train.lr_schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}"),
        ("train.lr_decay", 0 < train.lr_decay <= 1, "must be in (0, 1]"),
        ("eval.every", evaluation.every >= 1, "must be >= 1"),
        ("eval.batch_size", evaluation.batch_size >= 1, "must be >= 1"),
        ("eval.test", evaluation.test in ("every", "final"), "must be every or final"),
        ("data.val_size", data.val_size >= 0, "must be >= 0"),
        ("data.server_source", data.server_source in ("train", "valid"), "must be train or valid"),
        ("data.randaugment", data.randaugment is None or (len(data.randaugment) == 2 and data.randaugment[0] >= 1
                                                          and 0 <= data.randaugment[1] <= 30),
         "must be [num_ops >= 1, magnitude in 0..30]"),
        ("data.calib_size", data.calib_size >= 0, "must be >= 0"),
        ("fabric.devices", fabric.devices >= 1, "must be >= 1"),
        ("fabric.num_nodes", fabric.num_nodes >= 1, "must be >= 1"),
        ("fabric.threads_per_rank", fabric.threads_per_rank is None or fabric.threads_per_rank >= 1,
         "must be >= 1 or null"),
    ]
    for key, ok, problem in checks:
        if not ok:
            raise ConfigError(key, problem)
