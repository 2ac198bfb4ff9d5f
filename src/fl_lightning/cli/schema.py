"""What each command takes: one dataclass per command, whose fields are its options.

``fit`` takes the run itself (:class:`~fl_lightning.federation.run_spec.RunSpec`), ``partition``
the same with two options of its own; a field's docstring is its ``--help`` text and its type
carries its range and choices. Everything else in this package reads these classes: the parser
(``parser.py``), the checks of config files (``config_files.py``) and the error locator
(``parse_errors.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Literal, Optional

from fl_lightning.config import DataConfig, FabricConfig
from fl_lightning.feast_protocol import EXTRACTION_POPULATION, SEARCH_GENERATIONS
from fl_lightning.federation.run_spec import DEFAULT_MODEL, RESOLVED, RunSpec, Seed
from fl_lightning.option_types import PositiveFloat, PositiveInt, UnitFraction, number_type

if TYPE_CHECKING:  # resolved by the parser when it is built (it imports torch)
    from fl_lightning.elastic.models.base import ElasticModel


@dataclass
class EvaluateOptions:
    """Evaluate a finished run's checkpoint on the test set and the server validation split."""

    run: str
    """Run directory (holding config.yaml and checkpoints/)."""
    checkpoint: str = "best"
    """best, last or a checkpoint path."""
    fabric: FabricConfig = field(default_factory=FabricConfig)
    """Devices and precision for evaluation."""


@dataclass
class PartitionOptions(RunSpec):
    """Print and save a partition's per-client sizes, label histograms and TV distances.

    Takes the same experiment config as ``fit`` (only data, partition and seed matter)."""

    out: Optional[str] = None
    """Directory for partition.json and partition.png (default: <out_dir>/<name>-partition)."""
    show_budgets: Optional[bool] = None
    """List and plot each client's MAC budget (partition.budgets) beside its labels (default:
    with partition.method gamma_dirichlet, whose data shares follow them)."""


@dataclass
class ModelsOptions:
    """Print parameters and MACs (fvcore, one multiply-add = one MAC) per width tier."""

    model: ElasticModel = field(default_factory=lambda: {"class_path": DEFAULT_MODEL})
    """Architecture to inspect (as fit's model)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset that fixes classes and input shape (unless both are given below)."""
    widths: List[UnitFraction] = field(default_factory=lambda: [0.0625, 0.125, 0.25, 0.5, 0.75, 1.0])
    """Uniform width multipliers to list."""
    num_classes: Optional[PositiveInt] = None
    """Classes of the head (default: the dataset's)."""
    input_shape: Optional[List[PositiveInt]] = None
    """One example's shape, e.g. [3, 32, 32] (default: the dataset's)."""


@dataclass
class ExtractOptions:
    """Post-hoc extraction from a trained FEAST supernet: search, extract, recalibrate BN, score."""

    run: str
    """Run directory of a FEAST run (config.yaml and checkpoints/)."""
    budget: str
    """MAC limit of the extracted subnet, e.g. 30M or 1.2G."""
    checkpoint: str = "best"
    """best, last or a checkpoint path."""
    rho: Optional[PositiveFloat] = None
    """Effectiveness ceiling of the search (default: the run's cache's ceiling at the budget,
    each search segment's from the cheapest variant it built; the paper's cache gives 0.40
    below 50M MACs, else 0.31)."""
    population: number_type(int, ge=2) = EXTRACTION_POPULATION
    """Genetic-search population (512 for extraction, Supp. E.3)."""
    generations: PositiveInt = SEARCH_GENERATIONS
    """Genetic-search generations."""
    seed: Optional[Seed] = None
    """Search seed (default: the seed the run's cache was searched with)."""
    space: Literal["trained", "full"] = "trained"
    """trained (each gene within the range the cached variants span, which the supernet
    trained) or full (the whole space, as the paper searches)."""
    reuse_cache: bool = True
    """A cached variant answers a budget between its MACs and the target it was searched for,
    and the cached variants seed the search; false: random start only, as the paper states the
    search."""
    out: Optional[str] = None
    """Write the extracted subnet's weights and architecture to this file."""
    fabric: FabricConfig = field(default_factory=FabricConfig)
    """Devices and precision for calibration and evaluation."""


COMMANDS = {"fit": RunSpec, "evaluate": EvaluateOptions, "partition": PartitionOptions,
            "models": ModelsOptions, "extract": ExtractOptions}
"""Every subcommand and the dataclass its options parse into (``commands.py`` runs each)."""

DEFAULT_CLASSES = {"model": DEFAULT_MODEL, "data.dataset": "fl_lightning.data.Digits"}
"""Class sections a command may leave unnamed, and the class they then get (``parser.py``)."""


def options(command: str) -> List[dataclasses.Field]:
    """The fields of ``command``'s dataclass that are options, in order (a run's resolved
    checkpoint and config text are filled in by ``fit``, not given)."""
    return [f for f in dataclasses.fields(COMMANDS[command]) if f.name not in RESOLVED]


def default(option: dataclasses.Field):
    """An option's default value (a fresh one where it is made by a factory)."""
    if option.default_factory is not dataclasses.MISSING:
        return option.default_factory()
    return option.default


def sections(cls: type, prefix: str = "") -> Dict[str, type]:
    """``{key: dataclass}`` of every config section among ``cls``'s fields, nested ones included
    (``data``, ``partition``, ``partition.budgets``, ...)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            key = f"{prefix}{f.name}"
            out[key] = f.default_factory
            out.update(sections(f.default_factory, f"{key}."))
    return out
