"""Which method wrote a checkpoint, and the refusal to load one written by another.

Every run checkpoint carries a ``method`` entry: the algorithm's class path and its settings
(the ``init_args`` of the resolved config). A checkpoint of another method (FedAvg's into
HAS-FL, FedSGA's into SplitFed V2) or of the same method with other settings is refused with
one line naming both, instead of a ``KeyError`` deep in an algorithm or a silent load.
Checkpoints written before the entry existed carry none and are not compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.runtime.checkpoint import load_checkpoint

METHOD = "method"


def method_record(algorithm: Any, config_yaml: str = "") -> Dict[str, Any]:
    """``{"class_path": ..., "init_args": {...}}`` of the run's algorithm, in plain values."""
    cls = type(algorithm)
    init_args: Any = {}
    if config_yaml:
        section = (yaml.safe_load(config_yaml) or {}).get("algorithm")
        if isinstance(section, dict):
            init_args = section.get("init_args") or {}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": json.loads(json.dumps(init_args))}


def check_method(state: Mapping[str, Any], expected: Mapping[str, Any], path: Path, key: str) -> None:
    """ConfigError naming both methods (or the differing settings) unless the checkpoint ``state``
    was written by the method ``expected`` describes."""
    found = state.get(METHOD)
    if found is None:
        return
    if not isinstance(found, Mapping) or not isinstance(found.get("class_path"), str):
        raise ConfigError(key, f"{path}: its 'method' entry is not a method record")
    theirs, ours = _name(found["class_path"]), _name(expected["class_path"])
    if theirs != ours:
        raise ConfigError(key, f"{path} was written by {theirs}, and this run is {ours}; a checkpoint loads only "
                               f"into the method that wrote it")
    differing = _differences(_flat(found.get("init_args") or {}), _flat(expected.get("init_args") or {}))
    if differing:
        shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
        raise ConfigError(key, f"{path} was written by {theirs} with other settings ({shown}; checkpoint -> this run); "
                               f"a checkpoint loads only into the settings that wrote it")


def check_checkpoints(paths: Iterable[Path], expected: Mapping[str, Any], key: str,
                      required: Iterable[str] = ("model", "round")) -> None:
    """Read every checkpoint a command will load, before any work: each must be whole, hold the
    ``required`` entries and come from the ``expected`` method."""
    for path in paths:
        state = load_checkpoint(path, map_location="cpu", key=key, required=required)
        check_method(state, expected, path, key)


def load_algorithm_state(algorithm: Any, state: Any, path: Path, key: str) -> None:
    """``algorithm.load_state_dict(state)``, with a one-line ConfigError when the state lacks
    what the algorithm keeps (a checkpoint written by another method, without a method entry)."""
    try:
        algorithm.load_state_dict(state)
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "out of memory" in str(error).lower():
            raise
        detail = f"no {error.args[0]!r} entry" if isinstance(error, KeyError) and error.args else \
            " ".join(str(error).split())[:120]
        raise ConfigError(key, f"{path}: its algorithm state does not fit {type(algorithm).__name__} ({detail}); "
                               "it was written by another method") from None


def _name(class_path: str) -> str:
    return class_path.rsplit(".", 1)[-1]


def _flat(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: Dict[str, Any] = {}
        for name, value in tree.items():
            out.update(_flat(value, f"{prefix}{name}."))
        return out
    return {prefix[:-1]: tree} if prefix else {}


def _differences(theirs: Dict[str, Any], ours: Dict[str, Any]) -> list:
    out = []
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name), ours.get(name)
        if a != b:
            out.append(f"{name} {json.dumps(a)} -> {json.dumps(b)}")
    return out
