"""From a command line (or a saved run's ``config.yaml``) to a command's options dataclass.

Each subcommand's options are the fields of its dataclass (``schema.py``), added to one
jsonargparse parser, so ``--help`` lists every field with its docstring (and the choices of
every choice option) and ``--print_config`` prints a complete runnable config. A bad option,
value or config file is a ConfigError naming its key (``parse_errors.py`` finds which),
before anything is written.

Building the parser resolves the ``Algorithm`` and ``ElasticModel`` annotations, which imports
torch; importing this module does not.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from pathlib import Path
from typing import List, Tuple

from docstring_parser import parse_from_object
from jsonargparse import ArgumentParser, set_parsing_settings

from fl_lightning.cli.config_files import check_argument_files, check_config_files, join_negative_values
from fl_lightning.cli.parse_errors import Typed, command_options, given_tree, locate
from fl_lightning.cli.schema import COMMANDS, DEFAULT_CLASSES, options
from fl_lightning.elastic import models
from fl_lightning.errors import ConfigError
from fl_lightning.federation.run_spec import RESOLVED, RunSpec
from fl_lightning.saved_configs import upgraded

# unset_sentinel: an option nobody set holds jsonargparse's Unset, so a null written in a YAML
# file is a value like any other and its type refuses it (``lr: null`` -> "train.lr: must be a
# finite number > 0, got None"), as on the command line; by default a YAML null passes unchecked.
set_parsing_settings(docstring_parse_attribute_docstrings=True, unset_sentinel=True)

USAGE = f"python -m fl_lightning <{'|'.join(COMMANDS)}> --config file.yaml"


def build_parser() -> ArgumentParser:
    # allow_abbrev=False: argparse would take a typo such as --federation.round for --federation.rounds
    parser = ArgumentParser(prog="python -m fl_lightning", description=f"Command line: {USAGE}",
                            exit_on_error=False, allow_abbrev=False)
    subcommands = parser.add_subcommands(dest="command")
    parser.subcommand_parsers = {}
    for name, cls in COMMANDS.items():
        # a short usage line, so that --help opens with the description rather than every option
        sub = ArgumentParser(exit_on_error=False, description=inspect.getdoc(cls),
                             usage=f"python -m fl_lightning {name} [--config FILE.yaml] [--OPTION VALUE ...]")
        sub.add_argument("--config", action="config", help="YAML config file")
        _add_options(sub, name)
        subcommands.add_subcommand(name, sub, help=inspect.getdoc(cls).splitlines()[0])
        parser.subcommand_parsers[name] = sub
    return parser


def _add_options(sub: ArgumentParser, command: str) -> None:
    """The options of ``command`` in field order, its ``model`` as a subclass option."""
    cls, names = COMMANDS[command], [f.name for f in options(command)]
    if "model" not in names:
        sub.add_class_arguments(cls, as_group=False, skip=set(RESOLVED))
        return
    at = names.index("model")
    sub.add_class_arguments(cls, as_group=False, skip={*RESOLVED, *names[at:]})
    _add_model(sub, cls, command)
    sub.add_class_arguments(cls, as_group=False, skip={*RESOLVED, *names[:at + 1]})


def _add_model(sub: ArgumentParser, cls: type, command: str) -> None:
    """``--model``: any ElasticModel by ``class_path`` and ``init_args``, as the algorithm. The
    dataset gives the constructor's class count and input shape, so they are not options, and
    the section stays a description until the data is loaded (``build_model``)."""
    classes = ", ".join(name for name in models.__all__ if name[0].isupper())
    described = (f"{_field_help(cls, 'model')} Classes in fl_lightning.elastic.models: {classes} "
                 f"(default {DEFAULT_CLASSES['model']}); --model.help fl_lightning.elastic.models.CLASS "
                 "lists its options.")
    base = command_options(command)["model"]
    sub.add_subclass_arguments(base, "model", skip=set(models.NOT_OPTIONS), instantiate=False, help=described)


def _field_help(cls: type, name: str) -> str:
    """The docstring of field ``name`` of dataclass ``cls`` (or of the base that declares it)."""
    owner = next(c for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))
    return next(p.description for p in parse_from_object(owner).params if p.arg_name == name).replace("\n", " ")


@functools.lru_cache(maxsize=1)
def shared_parser() -> ArgumentParser:
    """One parser per process: building it reads every docstring (about 0.3 s), parsing with it
    again is cheap and leaves no state behind."""
    return build_parser()


def parse_command(argv: List[str]) -> Tuple[str, object, str]:
    """``(command, its options dataclass with their objects built, resolved config as YAML)``
    for a command line; ConfigError naming the key for anything its types or the config files
    refuse."""
    argv = join_negative_values(argv)
    check_argument_files(argv)
    check_config_files(argv)
    parser = shared_parser()
    cfg = _parse(parser, argv)
    return cfg.command, _options(parser, cfg), _resolved(parser, cfg)


def _options(parser: ArgumentParser, cfg):
    """The command's dataclass, from the parsed options with their objects built. The config
    files were checked, so what can still fail here is an algorithm's constructor refusing its
    arguments."""
    command = cfg.command
    try:
        given = parser.instantiate(cfg)[command]
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError("algorithm", " ".join(str(error).split())) from None
    return COMMANDS[command](**{f.name: given[f.name] for f in options(command)})


def _resolved(parser: ArgumentParser, cfg) -> str:
    """The command's options, every one of them, as YAML."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skip_none's deprecation; unset keys must still print
        return parser.subcommand_parsers[cfg.command].dump(cfg[cfg.command], skip_none=False)


def _parse(parser: ArgumentParser, argv: List[str]):
    """Parse ``argv``; a command that names no class for the model or the dataset (none at all,
    or only options of it) gets the default class (``DEFAULT_CLASSES``) named where it is first
    needed (``_with_default_classes``). As a parser default, a class's options would carry over
    to a class_path that accepts them, such as CNN's channels to a config's ResNet18. A refusal
    is located by walking the command line against the command's options (``parse_errors``)."""
    argv = _with_default_classes(argv, _classless_sections(argv))
    try:
        return parser.parse_args(argv)
    except Exception as error:  # jsonargparse reports bad keys and values as ArgumentError
        if type(error).__name__ in ("ArgumentError", "NSKeyError") or type(error).__module__.startswith("jsonargparse"):
            raise ConfigError(*locate(argv, error)) from None
        raise


def _classless_sections(argv: List[str]) -> List[str]:
    """Sections of ``DEFAULT_CLASSES`` that the command takes and ``argv`` names no class for."""
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None or any(a in ("-h", "--help") or a.endswith(".help") for a in argv):
        return []  # help prints before any default would matter
    taken = command_options(command)
    tree = given_tree(argv[argv.index(command) + 1:])
    out = []
    for key in DEFAULT_CLASSES:
        head, *rest = key.split(".")
        if head not in taken:
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


def load_fit_config(path, key: str = "run") -> RunSpec:
    """A saved run's ``config.yaml`` parsed and instantiated exactly as ``fit`` parsed it (one
    written by an earlier version read as today's, ``saved_configs``); any problem with the file
    is a ConfigError under ``key`` naming it (for evaluate and extract)."""
    return _load_saved(path, key)[0]


def resolved_saved_config(path, key: str = "resume") -> str:
    """A saved run's ``config.yaml`` as today's ``fit`` resolves it (for comparing on resume):
    the file's text, or for one written by an earlier version its upgraded, resolved form."""
    text = Path(path).read_text()
    return text if upgraded(text) is None else _load_saved(path, key)[1]


def _load_saved(path, key: str) -> Tuple[RunSpec, str]:
    try:
        check_config_files(["fit", "--config", str(path)])
        parser = shared_parser()
        new_text = upgraded(Path(path).read_text())  # --config takes a file or YAML text
        cfg = _parse(parser, ["fit", "--config", new_text or str(path)])
        return _options(parser, cfg), _resolved(parser, cfg)
    except ConfigError as error:
        raise ConfigError(key, f"{path}: {error}") from None
