"""The run: every section and option of a training run in one dataclass.

``fit`` parses its command line straight into a :class:`RunSpec` (``cli/``), a saved run's
``config.yaml`` reopens into one, and the round loop reads it. The docstring under each field
is its ``--help`` text. Importing this module imports neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from fl_lightning.config import (DEFAULT_LOGGERS, DataConfig, EvalConfig, FabricConfig, FederationConfig,
                                 LocalTrainConfig, LoggerSpec, PartitionConfig)
from fl_lightning.option_types import PositiveInt, number_type

if TYPE_CHECKING:  # resolved by the command line's parser when it is built (they import torch)
    from fl_lightning.algorithms import Algorithm
    from fl_lightning.elastic.models.base import ElasticModel

Seed = number_type(int, ge=0, lt=2**63)  # numpy's and torch's generators take any of these
DEFAULT_MODEL = "fl_lightning.elastic.models.CNN"
DEFAULT_ALGORITHM = "fl_lightning.algorithms.FedAvg"
RESOLVED = ("resume_from", "config_yaml")
"""Fields ``fit`` fills in once the options are checked: not options themselves."""


@dataclass
class RunSpec:
    """Train a federation and write runs/<name>/ (config, metrics, TensorBoard, checkpoints)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and server-held splits."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """How training examples are split between clients."""
    # The model stays its section (class_path, init_args) until the data gives its class count
    # and input shape (``elastic.models.build_model``); the algorithm is built by the parser
    # from its section (a run made in Python gives the object).
    model: ElasticModel = field(default_factory=lambda: {"class_path": DEFAULT_MODEL})
    """Architecture of the global model."""
    algorithm: Algorithm = field(default_factory=lambda: {"class_path": DEFAULT_ALGORITHM})
    """Server-side algorithm (FedAvg, FedProx, Scaffold, ...)."""
    train: LocalTrainConfig = field(default_factory=LocalTrainConfig)
    """Local training of each client."""
    federation: FederationConfig = field(default_factory=FederationConfig)
    """Rounds and cohort size."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation schedule."""
    fabric: FabricConfig = field(default_factory=FabricConfig)
    """Devices, precision and strategy passed to Lightning Fabric."""
    name: str = "run"
    """Run name; outputs go to <out_dir>/<name>/."""
    out_dir: str = "runs"
    """Parent directory of runs."""
    seed: Seed = 0
    """Seed of every random draw (partition, sampling, initialization, local training)."""
    resume: Optional[str] = None
    """'auto' continues <out_dir>/<name> from its last checkpoint, or a checkpoint path."""
    checkpoint_every: PositiveInt = 1
    """Save the last checkpoint every this many rounds (and at the end)."""
    stop_after: Optional[PositiveInt] = None
    """Stop with a checkpoint once this many rounds are done (e.g. a job's time limit); the same
    command with --resume auto continues exactly."""
    loggers: List[LoggerSpec] = field(default_factory=lambda: list(DEFAULT_LOGGERS))
    """Lightning loggers the rounds are logged to, each a class (a name in
    lightning.fabric.loggers or lightning.pytorch.loggers: TensorBoardLogger, CSVLogger,
    WandbLogger, MLFlowLogger, ...; or an import path) or {class_path, init_args}; they write
    below <out_dir>/<name>/ unless their init_args say where (--loggers+ CSVLogger adds one;
    docs/usage.md, Loggers)."""
    resume_from: Optional[str] = None
    """The checkpoint the run continues from (``resume`` resolved by ``fit``); None: a fresh run."""
    config_yaml: str = ""
    """The resolved config as YAML, saved with the run and compared on resume."""

    @property
    def run_path(self) -> Path:
        return Path(self.out_dir) / self.name
