"""Where a refused command line goes wrong, found from the command's options (``schema.py``).

jsonargparse refuses a bad value with a nested text tree and no structured fields, so its text
is not read here. Instead the command line is assembled again as a plain tree (``--config``
files and texts in order, then each option) and walked against the command's dataclass:
sections by their dataclass fields, ``class_path`` sections by the class's ``__init__``, and
each given value checked alone against its annotation by a one-option parser. The first key the
walk refuses is the key of the error, and its problem is said from the annotation (``describe``):
``fabric.devices: must be an integer >= 1 or auto, got 0``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import importlib
import inspect
import os
import typing
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, get_args, get_origin

import yaml
from jsonargparse import ArgumentParser

from fl_lightning import data
from fl_lightning.cli.config_files import read_config_file
from fl_lightning.cli.schema import COMMANDS, default, options
from fl_lightning.elastic import models
from fl_lightning.option_types import OutOfRange

Refusal = Tuple[str, str]
"""``(key, problem)``: what a command line's first bad key is and why."""


@dataclasses.dataclass(frozen=True)
class Typed:
    """A value as typed on the command line: text the parser reads by the option's type."""

    text: str

    def loaded(self) -> Any:
        """The text as YAML reads it (``[8, 16]`` a list, ``0.5`` a number, ``abc`` text)."""
        try:
            return yaml.safe_load(self.text)
        except yaml.YAMLError:
            return self.text


def locate(argv: List[str], error: BaseException) -> Refusal:
    """``(key, problem)`` for a command line the parser refused with ``error``."""
    words = [a for a in argv if not a.startswith("-")]
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None:
        if words:
            return "command", f"unknown subcommand {words[0]!r}; choose one of {', '.join(COMMANDS)}"
        return "command", f"choose a subcommand: {', '.join(COMMANDS)}"
    tree = given_tree(argv[argv.index(command) + 1:])
    for name, default in class_defaults(command).items():  # options given alone go to the default class
        if isinstance(tree.get(name), dict) and "class_path" not in tree[name]:
            tree[name] = {**default, **tree[name]}
    found = _walk_fields("", tree, command_options(command))
    if found is not None:
        return found
    missing = [name for name in required_options(command) if name not in tree]
    if missing:
        return missing[0], "required"
    return "config", " ".join(str(error).split())  # a refusal no single key explains


# ---------------------------------------------------------------------------------------------
# The command line as a tree
# ---------------------------------------------------------------------------------------------


def given_tree(args: List[str]) -> Dict[str, Any]:
    """What a command's arguments give, as one nested mapping: each ``--config`` (a file or
    YAML text) merged in order, each ``--a.b value`` set at ``a.b`` as ``Typed`` text."""
    tree: Dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg in ("--help", "--print_config"):
            i += 1
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        if name == "config":
            _merge(tree, _config_text(value))
        elif name.rpartition(".")[2] != "help":  # --model.help CLASS asks, it does not set
            _set(tree, name.split("."), Typed(value))
        i += 1
    return tree


def _config_text(value: str) -> dict:
    if os.path.exists(value):
        return read_config_file(value)
    loaded = Typed(value).loaded()
    return loaded if isinstance(loaded, dict) else {}


def _merge(into: dict, given: dict) -> None:
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _set(tree: dict, parts: List[str], value: Any) -> None:
    for part in parts[:-1]:
        node = tree.get(part)
        if not isinstance(node, dict):
            mapping = _as_mapping(node)
            if mapping is None and isinstance(node, Typed):
                return  # a section typed as something else keeps it: the walk names it
            node = tree[part] = mapping if mapping is not None else {}  # an option under a file's value
        tree = node
    before = _as_mapping(tree.get(parts[-1]))
    if isinstance(value, Typed) and isinstance(value.loaded(), str) and not os.path.isfile(value.text) \
            and before and "class_path" not in before:
        value = {**before, "class_path": value.loaded()}  # options given before their class stay
    tree[parts[-1]] = value


def _as_mapping(node: Any) -> Optional[dict]:
    """A section given whole: the mapping it spells or its file holds, or a class name; None
    when it is none of these (``--data null``)."""
    if node is None:
        return {}
    if isinstance(node, Typed):
        if os.path.isfile(node.text):
            return _config_text(node.text)
        node = node.loaded()
    if isinstance(node, dict):
        return node
    return {"class_path": node} if isinstance(node, str) else None


# ---------------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def command_options(command: str) -> Dict[str, Any]:
    """``{option: annotation}`` of a subcommand."""
    hints = typing.get_type_hints(COMMANDS[command], localns=_class_bases())
    return {f.name: hints[f.name] for f in options(command)}


def class_defaults(command: str) -> Dict[str, dict]:
    """``{option: {class_path: ...}}`` of a subcommand's class sections that have a default class."""
    found = {f.name: default(f) for f in options(command)}
    return {name: value for name, value in found.items() if isinstance(value, dict) and "class_path" in value}


def required_options(command: str) -> List[str]:
    """Options of a subcommand without a default (``evaluate``'s run)."""
    return [f.name for f in options(command)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


@functools.lru_cache(maxsize=1)
def _class_bases() -> Dict[str, type]:
    """The bases of the sections chosen by ``class_path``, by name. Imported when a refusal is
    located, not with the command line: the algorithms and models import torch."""
    from fl_lightning.algorithms import Algorithm
    from fl_lightning.elastic.models.base import ElasticModel

    return {"Algorithm": Algorithm, "ElasticModel": ElasticModel, "DatasetSource": data.DatasetSource}


def _walk_fields(prefix: str, given: dict, hints: Dict[str, Any]) -> Optional[Refusal]:
    for name, value in given.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in hints:
            return key, _unknown_key(key, value, [f"{prefix}.{h}" if prefix else h for h in hints])
        found = _walk(key, value, hints[name])
        if found is not None:
            return found
    return None


def _walk(key: str, value: Any, hint: Any) -> Optional[Refusal]:
    inner = _without_none(hint)
    if dataclasses.is_dataclass(inner):
        if value is None or (isinstance(value, Typed) and value.loaded() is None):
            return None if inner is not hint else (key, f"must be a mapping of its fields, got {_shown(value)}")
        if isinstance(value, Typed):
            value = _config_text(value.text) if os.path.isfile(value.text) else value.loaded()
        if not isinstance(value, dict):
            return key, f"expected a mapping of its fields or a YAML file, got {_shown_text(value)!r}"
        return _walk_fields(key, value, _hints(inner))
    base = _class_base(inner)
    if base is not None:
        if value is None and inner is not hint:
            return None
        return _walk_class(key, value, base)
    if isinstance(value, dict) and _typed_anywhere(value) and get_origin(inner) is not dict and inner is not dict:
        name = next(iter(value))  # --federation.rounds.x: an option under one that has none
        return f"{key}.{name}", f"unknown option ({key} takes a value, not options)"
    return check_value(key, value, hint)


def _walk_class(key: str, value: Any, base: type) -> Optional[Refusal]:
    """A section chosen by ``class_path``: the class must exist, and each init argument is walked
    against its annotation."""
    if isinstance(value, Typed) and isinstance(value.loaded(), (str, dict)):
        value = _as_mapping(value)
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        return key, _unknown_class(key, base, _shown_text(value))
    path, given = value.get("class_path"), value.get("init_args")
    init_args = given.loaded() if isinstance(given, Typed) else given  # typed null is not a mapping
    if given is None:
        init_args = {}  # a config file's empty init_args: the class's defaults
    if not isinstance(init_args, dict):
        return f"{key}.init_args", f"must be a mapping of the class's options, got {_shown_text(given)!r}"
    args = {**init_args,
            **{k: v for k, v in value.items() if k not in ("class_path", "init_args", "dict_kwargs")}}
    if key == "model" and "name" in args:  # no model has a name option: the form before class paths
        return key, ("models are chosen by class_path and init_args (as algorithms), e.g. {class_path: "
                     "fl_lightning.elastic.models.CNN, init_args: {channels: [16, 32]}}; the name/kwargs "
                     "form is read only from saved runs")
    if path is None:
        example = "fl_lightning.elastic.models.CNN" if key == "model" else "FedProx"
        return key, f"its options need its class first, e.g. --{key} {example} --{key}.<option> <value>"
    cls = resolve_class(base, _shown_text(path))
    if cls is None:
        return key, _unknown_class(key, base, _shown_text(path))
    hints = _hints(cls)
    for name, item in args.items():
        if name not in hints or name in _not_options(base):
            return f"{key}.{name}", f"not an option of {cls.__name__}"
        found = _walk(f"{key}.{name}", item, hints[name])
        if found is not None:
            return found
    return None


def check_value(key: str, value: Any, hint: Any) -> Optional[Refusal]:
    """``(key, problem)`` when ``hint`` refuses ``value``, read as the parser reads it: text
    from the command line by the option's type, a config file's value as YAML gave it."""
    parser = _one_option_parser(hint)
    if parser is None:
        return None
    try:
        if isinstance(value, Typed):
            parser.parse_args([f"--value={value.text}"])
        else:
            parser.parse_object({"value": value})
    except Exception as error:  # the parser's refusal: its text is not read, only its cause's type
        ours = next((e for e in _chain(error) if isinstance(e, OutOfRange)), None)
        if ours is not None and get_origin(hint) is not Union:
            where = "an element " if get_origin(hint) in (list, tuple, collections.abc.Sequence) else ""
            return key, f"{where}{ours}"
        given = str(ours).rsplit(", got ", 1)[-1] if ours is not None else _shown(value)
        return key, f"must be {describe(hint)}, got {given}"
    return None


@functools.lru_cache(maxsize=None)
def _one_option_parser(hint: Any):
    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_argument("--value", type=hint)
    except Exception:  # an annotation the parser takes only inside a class: nothing to check alone
        return None
    return parser


def _chain(error: BaseException) -> List[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__ or getattr(error, "parent", None)
    return out


def _shown(value: Any) -> str:
    """A refused value as it reads: what YAML made of the typed text, else the value, quoted."""
    return repr(value.loaded() if isinstance(value, Typed) else value)


def _shown_text(value: Any) -> str:
    return value.text if isinstance(value, Typed) else str(value)


def _without_none(hint: Any) -> Any:
    """``X`` of ``Optional[X]``; any other hint as it is."""
    if get_origin(hint) is Union:
        rest = [a for a in get_args(hint) if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(get_args(hint)):
            return rest[0]
    return hint


def _class_base(hint: Any) -> Optional[type]:
    return next((base for base in _class_bases().values() if isinstance(hint, type) and issubclass(hint, base)),
                None)


def _not_options(base: type) -> frozenset:
    """Constructor arguments a section does not take (a model's class count and input shape)."""
    if base is _class_bases()["ElasticModel"]:
        return models.NOT_OPTIONS
    return frozenset()


def _hints(owner) -> Dict[str, Any]:
    """Annotated init arguments of a class (following ``**kwargs`` to the parent's ``__init__``,
    as the parser does) or a dataclass's fields, resolved."""
    if dataclasses.is_dataclass(owner):
        return typing.get_type_hints(owner)
    out: Dict[str, Any] = {}
    for cls in reversed(owner.__mro__):
        init = cls.__dict__.get("__init__")
        if init is None or cls is object:
            continue
        parameters = inspect.signature(init).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            out = {}
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # an annotation that does not resolve names nothing to check
            hints = {}
        out.update({p.name: hints.get(p.name, Any) for p in parameters
                    if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)})
    return out


def resolve_class(base: type, path: str) -> Optional[type]:
    """The subclass of ``base`` that ``path`` names: a dotted import path, or a class name
    exported by the package of its kind; None if there is none."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module or _PACKAGES[base.__name__]), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


_PACKAGES = {"Algorithm": "fl_lightning.algorithms", "ElasticModel": "fl_lightning.elastic.models",
             "DatasetSource": "fl_lightning.data"}
_KINDS = {"Algorithm": "algorithm", "ElasticModel": "model", "DatasetSource": "dataset"}


# ---------------------------------------------------------------------------------------------
# The words of a refusal
# ---------------------------------------------------------------------------------------------


def _unknown_key(key: str, value: Any, known: List[str]) -> str:
    if key.split(".")[:2] in (["data", "name"], ["data", "options"]):
        return OLD_DATA
    where = "unknown option" if _typed_anywhere(value) else "unknown key in the config"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return where + (f" (did you mean {close[0]}?)" if close else "")


def _typed_anywhere(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_typed_anywhere(v) for v in value.values())
    return isinstance(value, Typed)


def _unknown_class(key: str, base: type, given: str) -> str:
    kind = _KINDS[base.__name__]
    names = {"algorithm": algorithm_names, "model": model_paths, "dataset": dataset_paths}[kind]()
    return f"unknown {kind} {given!r}; choose one of {', '.join(names)} or give {{class_path: ..., init_args: ...}}"


def describe(hint: Any) -> str:
    """What values of a type hint look like, in words: ``an integer >= 1 or auto``."""
    if hint is type(None):
        return "null"
    wanted = getattr(hint, "wanted", None)  # option_types.number_type
    if wanted is not None:
        return wanted
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        names = list(dict.fromkeys(str(a) for a in args))  # 16 and "16" read alike
        return names[0] if len(names) == 1 else "one of " + ", ".join(names)
    if origin is Union:
        choices = [c for a in args if get_origin(a) is Literal for c in get_args(a)]
        others = [describe(a) for a in args if a is not type(None) and get_origin(a) is not Literal]
        if choices:
            others.append(describe(Literal[tuple(dict.fromkeys(choices))]))
        return " or ".join(others) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, collections.abc.Sequence) or hint in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} ({', '.join(describe(a) for a in args)})"
        return f"a list ({describe(args[0])} each)" if args else "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in words:
        return words[hint]
    if dataclasses.is_dataclass(hint):
        return "a mapping of its fields"
    return getattr(hint, "__name__", str(hint))


OLD_DATA = ("datasets are chosen by class_path and init_args under data.dataset, e.g. data: {dataset: "
            "{class_path: fl_lightning.data.Synthetic, init_args: {num_classes: 10}}}; the name/options form is "
            "read only from saved runs")


def dataset_paths() -> List[str]:
    """Class paths of every dataset in the package."""
    return [f"{data.__name__}.{name}" for name in data.__all__ if name != "DatasetSource"]


def model_paths() -> List[str]:
    """Class paths of every model in the package."""
    return [f"{models.__name__}.{name}" for name in models.__all__ if name[0].isupper()]


def algorithm_names() -> List[str]:
    """Class names of every algorithm in the package."""
    names, todo = [], list(_class_bases()["Algorithm"].__subclasses__())
    while todo:
        cls = todo.pop(0)
        public = cls.__module__.startswith("fl_lightning.") and not cls.__name__.startswith("_")
        if public and cls.__name__ not in names:
            names.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names
