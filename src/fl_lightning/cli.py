"""Command line: ``python -m fl_lightning <fit|evaluate|partition|models> --config file.yaml``.

Each subcommand is a function whose typed, documented parameters become its options
(jsonargparse), so ``--help`` lists every field with its docstring and ``--print_config``
prints a complete runnable config. Config errors end with one line naming the key.
"""

from __future__ import annotations

import sys
import warnings
from typing import List, Optional

from jsonargparse import ArgumentParser, lazy_instance, set_parsing_settings

from fl_lightning.algorithms import Algorithm, FedAvg
from fl_lightning.config import (DataConfig, EvalConfig, FabricConfig, FederationConfig, LocalTrainConfig,
                                 ModelConfig, PartitionConfig)
from fl_lightning.errors import ConfigError, RunError

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def fit(
    data: DataConfig = DataConfig(),
    partition: PartitionConfig = PartitionConfig(),
    model: ModelConfig = ModelConfig(),
    algorithm: Algorithm = lazy_instance(FedAvg),
    train: LocalTrainConfig = LocalTrainConfig(),
    federation: FederationConfig = FederationConfig(),
    eval: EvalConfig = EvalConfig(),
    fabric: FabricConfig = FabricConfig(),
    name: str = "run",
    out_dir: str = "runs",
    seed: int = 0,
    resume: Optional[str] = None,
    checkpoint_every: int = 1,
    stop_after: Optional[int] = None,
):
    """Train a federation and write runs/<name>/ (config, metrics, TensorBoard, checkpoints).

    Args:
        data: dataset and server-held splits.
        partition: how training examples are split between clients.
        model: architecture of the global model.
        algorithm: server-side algorithm (FedAvg, FedProx, Scaffold, ...).
        train: local training of each client.
        federation: rounds and cohort size.
        eval: evaluation schedule.
        fabric: devices, precision and strategy passed to Lightning Fabric.
        name: run name; outputs go to <out_dir>/<name>/.
        out_dir: parent directory of runs.
        seed: seed of every random draw (partition, sampling, initialization, local training).
        resume: 'auto' continues <out_dir>/<name> from its last checkpoint, or a checkpoint path.
        checkpoint_every: save the last checkpoint every this many rounds (and at the end).
        stop_after: stop with a checkpoint once this many rounds are done (e.g. a job's time
            limit); the same command with --resume auto continues exactly.
    """


def evaluate(
    run: str,
    checkpoint: str = "best",
    fabric: FabricConfig = FabricConfig(),
):
    """Evaluate a finished run's checkpoint on the test set and the server validation split.

    Args:
        run: run directory (holding config.yaml and checkpoints/).
        checkpoint: 'best', 'last' or a checkpoint path.
        fabric: devices and precision for evaluation.
    """


def partition(out: Optional[str] = None):
    """Print and save a partition's per-client sizes, label histograms and TV distances.

    Takes the same experiment config as ``fit`` (only data, partition and seed matter).

    Args:
        out: directory for partition.json and partition.png (default: <out_dir>/<name>-partition).
    """


def models(
    model: ModelConfig = ModelConfig(),
    data: DataConfig = DataConfig(),
    widths: List[float] = [0.0625, 0.125, 0.25, 0.5, 0.75, 1.0],
    num_classes: Optional[int] = None,
    input_shape: Optional[List[int]] = None,
):
    """Print parameters and MACs (fvcore, one multiply-add = one MAC) per width tier.

    Args:
        model: architecture to inspect.
        data: dataset that fixes classes and input shape (unless both are given below).
        widths: uniform width multipliers to list.
        num_classes: classes of the head (default: the dataset's).
        input_shape: one example's shape, e.g. [3, 32, 32] (default: the dataset's).
    """


def extract(
    run: str,
    budget: str,
    checkpoint: str = "best",
    rho: Optional[float] = None,
    population: int = 512,
    generations: int = 512,
    seed: int = 0,
    out: Optional[str] = None,
    fabric: FabricConfig = FabricConfig(),
):
    """Post-hoc extraction from a trained FEAST supernet: search, extract, recalibrate BN, score.

    Args:
        run: run directory of a FEAST run (config.yaml and checkpoints/).
        budget: MAC limit of the extracted subnet, e.g. 30M or 1.2G.
        checkpoint: best, last or a checkpoint path.
        rho: effectiveness ceiling of the search (default: 0.40 below 50M MACs, else 0.31).
        population: genetic-search population (512 for extraction, Supp. E.3).
        generations: genetic-search generations.
        seed: search seed.
        out: write the extracted subnet's weights and architecture to this file.
        fabric: devices and precision for calibration and evaluation.
    """


COMMANDS = {"fit": fit, "evaluate": evaluate, "partition": partition, "models": models, "extract": extract}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m fl_lightning", description=__doc__.splitlines()[0],
                            exit_on_error=False)
    subcommands = parser.add_subcommands(dest="command")
    parser.subcommand_parsers = {}
    for name, function in COMMANDS.items():
        sub = ArgumentParser(exit_on_error=False)
        sub.add_argument("--config", action="config", help="YAML config file")
        if name == "partition":  # reads a fit config as it is
            sub.add_function_arguments(fit, as_group=False)
        sub.add_function_arguments(function, as_group=False)
        subcommands.add_subcommand(name, sub, help=function.__doc__.splitlines()[0])
        parser.subcommand_parsers[name] = sub
    return parser


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        cfg = parser.parse_args(argv)
        command = cfg.command
        args = parser.instantiate(cfg)[command]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # skip_none's deprecation; unset keys must still print
            resolved = parser.subcommand_parsers[command].dump(cfg[command], skip_none=False)
        from fl_lightning.commands import COMMANDS as RUNNERS

        RUNNERS[command](args, resolved)
    except ConfigError as error:
        return _fail(str(error))
    except RunError as error:
        return _fail(str(error), status=1)
    except Exception as error:  # jsonargparse reports bad keys and types as ArgumentError
        if type(error).__name__ in ("ArgumentError", "NSKeyError") or error.__class__.__module__.startswith("jsonargparse"):
            return _fail(_first_line(str(error)))
        raise
    return 0


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else message


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status
