"""jsonargparse's parse errors as one line, ``<key>: <problem>``.

A bad value's problem is said from the option's own type (``must be an integer >= 1 or auto,
got 0``): the key is read from the error's chain, the type from the option's signature. The rest
are the parser's structural refusals (unknown option, unknown algorithm, missing value), which
carry their own words.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib
import re
import typing
from typing import Any, List, Literal, Optional, Tuple, Union, get_args, get_origin

from fl_lightning.option_types import OutOfRange

_KEY = re.compile(r'^\s*(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '([^']+)':")
_VALUE = re.compile(r"(?:Got|Given) value: (.*)$", re.M)


def one_line(error: BaseException, parser) -> Tuple[str, str]:
    """``(key, problem)`` for a parse error raised by ``parser`` (the CLI's, with subcommands)."""
    text = str(error)
    key, owner = _key_and_owner(text)
    structural = _structural(text, key, parser)
    if structural is not None:
        return structural
    hint = _typehint(parser, key, owner)
    ours = next((e for e in reversed(_chain(error)) if isinstance(e, OutOfRange)), None)
    if ours is not None and (hint is None or get_origin(hint) is not Union):
        where = "an element " if hint is not None and get_origin(hint) in (list, tuple) else ""
        return key, f"{where}{ours}"
    if hint is None:
        return key or "config", " ".join(text.split())
    return key, f"must be {describe(hint)}, got {_given(text, ours)}"


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


def _chain(error: BaseException) -> List[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


def _key_and_owner(text: str) -> Tuple[str, Optional[str]]:
    """The dotted key through nested parsers (``algorithm`` then ``mu``: ``algorithm.mu``) and
    the class_path whose options the inner part names."""
    parts, owner = [], None
    for line in text.splitlines():
        key, owner_match = _KEY.match(line), _CLASS.search(line)
        if key and (not parts or not parts[-1].endswith(key.group(1))):
            parts.append(key.group(1))
        if owner_match:
            owner = owner_match.group(1)
    return ".".join(parts), owner


def _given(text: str, ours: Optional[BaseException]) -> str:
    if ours is not None:
        return str(ours).rsplit(", got ", 1)[-1]
    found = [v for v in _VALUE.findall(text)  # not the wrappers: options without class, the whole section
             if not v.startswith("NestedArg(") and not v.startswith("{'class_path'")]
    return repr(found[-1].strip()) if found else "?"


def _typehint(parser, key: str, owner: Optional[str]):
    """The declared type of ``key``: a subcommand option's, or an init argument of ``owner``
    (a class_path, such as an algorithm's) and the dataclass fields beneath it."""
    if owner is not None:
        module, _, name = owner.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)  # a package may export it lazily
        except (ImportError, AttributeError):
            return None
        parts = key.split(".")
        for start in range(1, len(parts)):  # the section is ``algorithm``, ``model`` or ``data.dataset``
            hint = cls
            for part in parts[start:]:
                hint = _hints(hint).get(part)
                if hint is None:
                    break
            if hint is not None:
                return hint
        return None
    for sub in getattr(parser, "subcommand_parsers", {}).values():
        for action in sub._actions:
            if action.dest == key and getattr(action, "_typehint", None) is not None:
                return action._typehint
    return None


def _hints(owner) -> dict:
    """Annotated names of a class's ``__init__`` (or a dataclass's fields), resolved."""
    target = owner if dataclasses.is_dataclass(owner) else getattr(owner, "__init__", owner)
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation that does not resolve names nothing to describe
        return {}


def _structural(text: str, key: str, parser) -> Optional[Tuple[str, str]]:
    """Refusals that are not about a value's type: unknown options, algorithms and subcommands."""
    from fl_lightning.cli import COMMANDS

    first = next((line.strip().removeprefix("- ") for line in text.splitlines() if line.strip()
                  and not _KEY.match(line) and not _CLASS.search(line)), "")
    if match := re.match(r"unrecognized arguments: (\S+)", first):
        name = match.group(1).lstrip("-").split("=", 1)[0]
        return name, OLD_DATA if _old_data_key(name) else "unknown option" + _did_you_mean(name, parser)
    if match := re.match(r"Subcommand '[^']+' does not accept option '([^']+)'", first):
        name = match.group(1)
        return name, OLD_DATA if _old_data_key(name) else \
            "unknown key in the config" + _did_you_mean(name, parser)
    if match := re.match(r"the following arguments are required: ([^,\s]+)", first):
        command, _, name = match.group(1).lstrip("-").partition(".")
        return (name if command in COMMANDS and name else match.group(1)), "required"
    if match := re.search(r"^\s*(?:- )?Option '([^']+)' is not accepted", text, re.M):
        owner = _CLASS.search(text)
        return f"{key}.{match.group(1)}", f"not an option of {owner.group(1).rsplit('.', 1)[-1] if owner else key}"
    if key == "model" and "{'name':" in text:
        return key, ("models are chosen by class_path and init_args (as algorithms), e.g. {class_path: "
                     "fl_lightning.elastic.models.CNN, init_args: {channels: [16, 32]}}; the name/kwargs form "
                     "is read only from saved runs")
    unknown_class = (r"(Expected a dot import path string|Not a valid subclass of|.*does not correspond to a subclass"
                     r"|Expected a path but|module '[^']+' has no attribute)")
    if re.match(unknown_class, first) or (key == "data.dataset" and re.search(unknown_class, text)):
        given = (_VALUE.findall(text) or re.findall(r"(?:string:|Expected a path but) (\S*)", first)
                 or _CLASS.findall(text))
        if key == "model":
            return key, (f"unknown model {given[-1].strip()!r}; choose one of {', '.join(model_paths())} "
                         "or give {class_path: ..., init_args: ...}")
        if key == "data.dataset":
            return key, (f"unknown dataset {given[-1].strip()!r}; choose one of {', '.join(dataset_paths())} "
                         "or give {class_path: ..., init_args: ...}")
        return key or "algorithm", (f"unknown algorithm {given[-1].strip()!r}; choose one of "
                                    f"{', '.join(algorithm_names())} or give {{class_path: ..., init_args: ...}}")
    if key in ("model", "algorithm") and "NestedArg(" in text and not _CLASS.search(text):
        return key, (f"its options need its class first, e.g. --{key} "
                     f"{'fl_lightning.elastic.models.CNN' if key == 'model' else 'FedProx'} --{key}.<option> <value>")
    if match := re.match(r"Unable to load config ['\"](.*)['\"]", first):
        return key, f"expected a mapping of its fields or a YAML file, got {match.group(1)!r}"
    if match := re.search(r"invalid choice: '([^']*)'", first):
        return "command", f"unknown subcommand {match.group(1)!r}; choose one of {', '.join(COMMANDS)}"
    if 'expected "command"' in first:
        return "command", f"choose a subcommand: {', '.join(COMMANDS)}"
    return None


OLD_DATA = ("datasets are chosen by class_path and init_args under data.dataset, e.g. data: {dataset: "
            "{class_path: fl_lightning.data.Synthetic, init_args: {num_classes: 10}}}; the name/options form is "
            "read only from saved runs")


def _old_data_key(name: str) -> bool:
    """``data.name`` or ``data.options[.x]``: the data section's form before datasets were classes."""
    return name.split(".")[:2] in (["data", "name"], ["data", "options"])


def dataset_paths() -> List[str]:
    """Class paths of every dataset in the package."""
    from fl_lightning import data

    return [f"{data.__name__}.{name}" for name in data.__all__ if name != "DatasetSource"]


def model_paths() -> List[str]:
    """Class paths of every model in the package."""
    from fl_lightning.elastic import models

    return [f"{models.__name__}.{name}" for name in models.__all__ if name[0].isupper()]


def algorithm_names() -> List[str]:
    """Class names of every algorithm in the package."""
    from fl_lightning.algorithms import Algorithm

    names, todo = [], list(Algorithm.__subclasses__())
    while todo:
        cls = todo.pop(0)
        public = cls.__module__.startswith("fl_lightning.") and not cls.__name__.startswith("_")
        if public and cls.__name__ not in names:
            names.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _did_you_mean(name: str, parser) -> str:
    known = set()
    for sub in getattr(parser, "subcommand_parsers", {}).values():
        for action in sub._actions:
            known.update(o.lstrip("-") for o in action.option_strings if o.startswith("--"))
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
