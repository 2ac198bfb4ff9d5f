"""Command line: ``python -m fl_lightning <fit|evaluate|partition|models> --config file.yaml``.

Each subcommand is a function whose typed, documented parameters become its options
(jsonargparse), so ``--help`` lists every field with its docstring (and the choices of every
choice option) and ``--print_config`` prints a complete runnable config. A bad option, value
or config file ends the command with exit status 2 and one line ``error: <key>: <problem>``
on stderr, before anything is written.

This module imports neither torch nor Lightning at import time; the algorithm classes (which
do) are imported when the parser is built.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import stat
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, List, Literal, Optional

import yaml
from jsonargparse import ArgumentParser, set_parsing_settings

from fl_lightning.config import (DEFAULT_DATASET, DataConfig, EvalConfig, FabricConfig, FederationConfig,
                                 LocalTrainConfig, PartitionConfig)
from fl_lightning.errors import ConfigError, Interrupted, RunError
from fl_lightning.feast_protocol import EXTRACTION_POPULATION, SEARCH_GENERATIONS
from fl_lightning.option_types import PositiveFloat, PositiveInt, UnitFraction, number_type
from fl_lightning.parse_errors import Typed, command_options, given_tree, locate

if TYPE_CHECKING:
    from fl_lightning.algorithms import Algorithm
    from fl_lightning.elastic.models.base import ElasticModel

# unset_sentinel: an option nobody set holds jsonargparse's Unset, so a null written in a YAML
# file is a value like any other and its type refuses it (``lr: null`` -> "train.lr: must be a
# finite number > 0, got None"), as on the command line; by default a YAML null passes unchecked.
set_parsing_settings(docstring_parse_attribute_docstrings=True, unset_sentinel=True)

DEFAULT_ALGORITHM = {"class_path": "fl_lightning.algorithms.FedAvg"}
DEFAULT_MODEL = {"class_path": "fl_lightning.elastic.models.CNN"}
# Class sections a command may leave unnamed, and the class they then get (``_parse``).
DEFAULT_CLASSES = {"model": DEFAULT_MODEL["class_path"],
                   "data.dataset": f"fl_lightning.data.{DEFAULT_DATASET.__name__}"}
Seed = number_type(int, ge=0, lt=2**63)  # numpy's and torch's generators take any of these


def fit(
    data: DataConfig = DataConfig(),
    partition: PartitionConfig = PartitionConfig(),
    model: ElasticModel = DEFAULT_MODEL,
    algorithm: Algorithm = DEFAULT_ALGORITHM,
    train: LocalTrainConfig = LocalTrainConfig(),
    federation: FederationConfig = FederationConfig(),
    eval: EvalConfig = EvalConfig(),
    fabric: FabricConfig = FabricConfig(),
    name: str = "run",
    out_dir: str = "runs",
    seed: Seed = 0,
    resume: Optional[str] = None,
    checkpoint_every: PositiveInt = 1,
    stop_after: Optional[PositiveInt] = None,
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
    model: ElasticModel = DEFAULT_MODEL,
    data: DataConfig = DataConfig(),
    widths: List[UnitFraction] = [0.0625, 0.125, 0.25, 0.5, 0.75, 1.0],
    num_classes: Optional[PositiveInt] = None,
    input_shape: Optional[List[PositiveInt]] = None,
):
    """Print parameters and MACs (fvcore, one multiply-add = one MAC) per width tier.

    Args:
        model: architecture to inspect (as fit's model).
        data: dataset that fixes classes and input shape (unless both are given below).
        widths: uniform width multipliers to list.
        num_classes: classes of the head (default: the dataset's).
        input_shape: one example's shape, e.g. [3, 32, 32] (default: the dataset's).
    """


def extract(
    run: str,
    budget: str,
    checkpoint: str = "best",
    rho: Optional[PositiveFloat] = None,
    population: number_type(int, ge=2) = EXTRACTION_POPULATION,
    generations: PositiveInt = SEARCH_GENERATIONS,
    seed: Optional[Seed] = None,
    space: Literal["trained", "full"] = "trained",
    reuse_cache: bool = True,
    out: Optional[str] = None,
    fabric: FabricConfig = FabricConfig(),
):
    """Post-hoc extraction from a trained FEAST supernet: search, extract, recalibrate BN, score.

    Args:
        run: run directory of a FEAST run (config.yaml and checkpoints/).
        budget: MAC limit of the extracted subnet, e.g. 30M or 1.2G.
        checkpoint: best, last or a checkpoint path.
        rho: effectiveness ceiling of the search (default: the run's cache's ceiling at the
            budget, each search segment's from the cheapest variant it built; the paper's cache
            gives 0.40 below 50M MACs, else 0.31).
        population: genetic-search population (512 for extraction, Supp. E.3).
        generations: genetic-search generations.
        seed: search seed (default: the seed the run's cache was searched with).
        space: trained (each gene within the range the cached variants span, which the
            supernet trained) or full (the whole space, as the paper searches).
        reuse_cache: a cached variant answers a budget between its MACs and the target it was
            searched for, and the cached variants seed the search; false: random start only, as
            the paper states the search.
        out: write the extracted subnet's weights and architecture to this file.
        fabric: devices and precision for calibration and evaluation.
    """


COMMANDS = {"fit": fit, "evaluate": evaluate, "partition": partition, "models": models, "extract": extract}


def build_parser() -> ArgumentParser:
    global Algorithm
    from fl_lightning.algorithms import Algorithm  # noqa: F811 (torch and Lightning: only when parsing)
    from fl_lightning.elastic.models.base import ElasticModel

    parser = ArgumentParser(prog="python -m fl_lightning", description=__doc__.splitlines()[0],
                            exit_on_error=False)
    subcommands = parser.add_subcommands(dest="command")
    parser.subcommand_parsers = {}
    for name, function in COMMANDS.items():
        sub = ArgumentParser(exit_on_error=False)
        sub.add_argument("--config", action="config", help="YAML config file")
        for options in ([fit] if name == "partition" else []) + [function]:  # partition reads a fit config
            _add_function(sub, options, ElasticModel)
        subcommands.add_subcommand(name, sub, help=function.__doc__.splitlines()[0])
        parser.subcommand_parsers[name] = sub
    return parser


def _add_function(sub: ArgumentParser, command, model_base: type) -> None:
    """The options of ``command`` in signature order, its ``model`` as a subclass option."""
    names = list(inspect.signature(command).parameters)
    if "model" not in names:
        sub.add_function_arguments(command, as_group=False)
        return
    at = names.index("model")
    sub.add_function_arguments(command, as_group=False, skip=set(names[at:]))
    _add_model(sub, model_base, command)
    sub.add_function_arguments(command, as_group=False, skip=set(names[:at + 1]))


def _add_model(sub: ArgumentParser, base: type, command) -> None:
    """``--model``: any ElasticModel by ``class_path`` and ``init_args``, as the algorithm. The
    dataset gives the constructor's class count and input shape, so they are not options, and
    the section stays a description until the data is loaded (``build_model``)."""
    from fl_lightning.elastic.models import NOT_OPTIONS, __all__ as exported

    classes = ", ".join(name for name in exported if name[0].isupper())
    described = (f"{_parameter_help(command, 'model')} Classes in fl_lightning.elastic.models: {classes} "
                 f"(default {DEFAULT_MODEL['class_path']}); --model.help fl_lightning.elastic.models.CLASS "
                 "lists its options.")
    sub.add_subclass_arguments(base, "model", skip=set(NOT_OPTIONS), instantiate=False, help=described)


def _parameter_help(function, name: str) -> str:
    """The docstring text of ``function``'s parameter ``name``."""
    from docstring_parser import parse

    return next(p.description for p in parse(function.__doc__).params if p.arg_name == name).replace("\n", " ")


@functools.lru_cache(maxsize=1)
def shared_parser() -> ArgumentParser:
    """One parser per process: building it reads every docstring (about 0.3 s), parsing with it
    again is cheap and leaves no state behind."""
    return build_parser()


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        command, args, resolved = parse_command(argv)
        from fl_lightning.commands import COMMANDS as RUNNERS

        RUNNERS[command](args, resolved)
    except ConfigError as error:
        return _fail(str(error))
    except Interrupted as error:
        return _fail(str(error), status=130)
    except RunError as error:
        return _fail(str(error), status=1)
    except KeyboardInterrupt:  # before the first round or after the last one
        return _fail("interrupted; run the same command again (with --resume auto once a checkpoint exists)",
                     status=130)
    return 0


def parse_command(argv: List[str]):
    """``(command, arguments with their objects built, resolved config as YAML)`` for a command
    line; ConfigError naming the key for anything its types or the config files refuse."""
    argv = join_negative_values(argv)
    check_argument_files(argv)
    check_config_files(argv)
    parser = shared_parser()
    cfg = _parse(parser, argv)
    command = cfg.command
    args = _instantiate(parser, cfg)[command]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skip_none's deprecation; unset keys must still print
        resolved = parser.subcommand_parsers[command].dump(cfg[command], skip_none=False)
    return command, args, resolved


def _parse(parser: ArgumentParser, argv: List[str]):
    """Parse ``argv``; a command that names no class for the model or the dataset (none at all,
    or only options of it) gets the default class (``DEFAULT_CLASSES``) named where it is first
    needed (``_with_default_classes``). As a parser default, a class's options would carry over
    to a class_path that accepts them, such as CNN's channels to a config's ResNet18. A refusal
    is located by walking the command line against the command's signature (``parse_errors``)."""
    argv = _with_default_classes(argv, _classless_sections(argv))
    try:
        return parser.parse_args(argv)
    except Exception as error:  # jsonargparse reports bad keys and values as ArgumentError
        if type(error).__name__ in ("ArgumentError", "NSKeyError") or _from_jsonargparse(error):
            raise ConfigError(*locate(argv, error)) from None
        raise


def _classless_sections(argv: List[str]) -> List[str]:
    """Sections of ``DEFAULT_CLASSES`` that the command takes and ``argv`` names no class for."""
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None or any(a in ("-h", "--help") or a.endswith(".help") for a in argv):
        return []  # help prints before any default would matter
    options = command_options(command)
    tree = given_tree(argv[argv.index(command) + 1:])
    out = []
    for key in DEFAULT_CLASSES:
        head, *rest = key.split(".")
        if head not in options:
            continue
        node = tree.get(head)
        for part in rest:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, Typed):
            node = node.loaded()  # --model null names no class
        if node is None or (isinstance(node, dict) and "class_path" not in node):
            out.append(key)
    return out


def _with_default_classes(argv: List[str], keys: List[str]) -> List[str]:
    """``argv`` naming the default class of each section in ``keys`` before its first option,
    or at its end."""
    for key in keys:
        first = next((i for i, a in enumerate(argv) if a.startswith(f"--{key}.")), len(argv))
        argv = [*argv[:first], f"--{key}", DEFAULT_CLASSES[key], *argv[first:]]
    return argv


def load_fit_config(path, key: str = "run"):
    """A saved run's ``config.yaml`` parsed and instantiated exactly as ``fit`` parsed it (one
    written by an earlier version read as today's, ``saved_configs``); any problem with the file
    is a ConfigError under ``key`` naming it (for evaluate and extract)."""
    return _load_saved(path, key)[0]


def resolved_saved_config(path, key: str = "resume") -> str:
    """A saved run's ``config.yaml`` as today's ``fit`` resolves it (for comparing on resume):
    the file's text, or for one written by an earlier version its upgraded, resolved form."""
    from fl_lightning.saved_configs import upgraded

    text = Path(path).read_text()
    return text if upgraded(text) is None else _load_saved(path, key)[1]


def _load_saved(path, key: str):
    from fl_lightning.saved_configs import upgraded

    try:
        check_config_files(["fit", "--config", str(path)])
        parser = shared_parser()
        new_text = upgraded(Path(path).read_text())  # --config takes a file or YAML text
        cfg = _parse(parser, ["fit", "--config", new_text or str(path)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # skip_none's deprecation
            resolved = parser.subcommand_parsers["fit"].dump(cfg["fit"], skip_none=False)
        return _instantiate(parser, cfg).fit, resolved
    except ConfigError as error:
        raise ConfigError(key, f"{path}: {error}") from None


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _from_jsonargparse(error: BaseException) -> bool:
    return type(error).__module__.startswith("jsonargparse")


def _instantiate(parser: ArgumentParser, cfg):
    """Build the configured objects; the config files were checked, so what can still fail here is
    an algorithm's constructor refusing its arguments."""
    try:
        return parser.instantiate(cfg)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError("algorithm", " ".join(str(error).split())) from None


# ----------------------------------------------------------------------------------------
# Config files: checked before jsonargparse reads them, so the error names the file and key
# ----------------------------------------------------------------------------------------


def join_negative_values(argv: List[str]) -> List[str]:
    """``--train.lr -inf`` as ``--train.lr=-inf``: argparse reads a value that starts with '-' and
    is not a plain negative integer (-inf, -1e-3, -.5) as an option of its own."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("--") and "=" not in arg and following is not None and following.startswith("-") \
                and _is_number(following):
            arg, i = f"{arg}={following}", i + 1
        out.append(arg)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_argument_files(argv: List[str]) -> None:
    """An option's value that names a fifo or socket would be opened as a YAML file and wait
    forever (``--train some_fifo``): refused at once, naming the option."""
    for option, value in zip(argv, argv[1:]):
        if not option.startswith("--") or "=" in option or option == "--config":
            continue
        try:
            mode = os.stat(value).st_mode
        except (OSError, ValueError):
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise ConfigError(option[2:], f"{value} is {_file_kind(mode)}, not a YAML file or a value")


def _config_paths(argv: List[str]) -> List[str]:
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def _sections(function) -> dict:
    """``{key: dataclass}`` of every config section of a subcommand, nested ones included
    (``partition.budgets``)."""
    out = {}

    def walk(prefix: str, cls) -> None:
        out[prefix] = cls
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
                walk(f"{prefix}.{f.name}", f.default_factory)

    for p in inspect.signature(function).parameters.values():
        if dataclasses.is_dataclass(p.default):
            walk(p.name, type(p.default))
    return out


def check_config_files(argv: List[str]) -> None:
    """Every ``--config`` file exists, is UTF-8 YAML text holding a mapping, and gives each
    config section (``train:``, ``partition.budgets:``...) a mapping of its fields."""
    command = next((a for a in argv if a in COMMANDS), None)
    sections = {}
    if command is not None:
        sections = _sections(COMMANDS[command])
        if command == "partition":
            sections.update(_sections(fit))
    for path in _config_paths(argv):
        tree = read_config_file(path)
        for key, cls in sections.items():
            node, parts = tree, key.split(".")
            for part in parts:
                node = node.get(part) if isinstance(node, dict) else None
            if node is None and _holds_key(tree, parts):
                raise ConfigError(key, f"is empty in {path}; give its fields (or remove the line '{parts[-1]}:')")
            if node is not None and not isinstance(node, dict):
                fields = ", ".join(f.name for f in dataclasses.fields(cls)[:3])
                raise ConfigError(key, f"must be a mapping of its fields ({fields}, ...), got {node!r} in {path}")


def _holds_key(tree: dict, parts: List[str]) -> bool:
    for part in parts[:-1]:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return False
    return parts[-1] in tree


MAX_CONFIG_BYTES = 4 * 2**20  # a config is a page or two of YAML; more is the wrong file


def read_config_file(path: str) -> dict:
    """The YAML mapping in ``path``; ConfigError (key ``config``) for anything else: a missing
    file, something that is not a regular file (a folder, /dev/zero, a fifo: read at once, never
    waited on), a file of megabytes, bytes that are not text, invalid YAML, a key given twice."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {path}") from None
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError("config", f"{path} is a folder, not a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError("config", f"{path} is {_file_kind(info.st_mode)}, not a regular YAML file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is {info.st_size / 2**20:.0f} MiB, not a config file "
                                    f"(at most {MAX_CONFIG_BYTES // 2**20} MiB of YAML)")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError("config", f"cannot read {path}: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError("config", f"{path} is not a YAML text file (byte {error.start} is not UTF-8)") from None
    if "\x00" in text:
        raise ConfigError("config", f"{path} is not a YAML text file (it holds NUL bytes)")
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as error:
        raise ConfigError(error.key, f"is given twice in {path} (lines {error.lines[0]} and {error.lines[1]}); "
                                     "keep one") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError("config", f"{path} is not valid YAML{where}: {problem}") from None
    if tree is None:
        raise ConfigError("config", f"{path} is empty; a config is a YAML mapping of sections "
                                    "(data:, partition:, model:, ...), see configs/quickstart.yaml")
    if not isinstance(tree, dict):
        raise ConfigError("config", f"{path} holds a YAML {type(tree).__name__}, not a mapping of sections "
                                    "(data:, partition:, model:, ...)")
    return tree


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo (pipe)"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, lines: tuple):
        super().__init__(key)
        self.key, self.lines = key, lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a mapping holding one key twice (PyYAML keeps the last),
    naming the dotted key (``train.lr``) and both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    path = ".".join(self._path_to(node) + [str(key)])
                    raise _DuplicateKey(path, (seen[key], key_node.start_mark.line + 1))
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def _path_to(self, target) -> list:
        """Keys from the document's root mapping down to the mapping node ``target``."""
        def walk(node, trail):
            if node is target:
                return trail
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    found = walk(value_node, trail + [str(key_node.value)])
                    if found is not None:
                        return found
            elif isinstance(node, yaml.SequenceNode):
                for i, item in enumerate(node.value):
                    found = walk(item, trail[:-1] + [f"{trail[-1]}[{i}]"] if trail else [f"[{i}]"])
                    if found is not None:
                        return found
            return None
        return walk(self._root, []) or []

    def compose_document(self):
        self._root = super().compose_document()
        return self._root
