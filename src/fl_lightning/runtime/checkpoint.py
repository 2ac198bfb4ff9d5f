"""Atomic checkpoint files holding only tensors and plain Python values.

Loading never runs code from the file (``torch.load(weights_only=True)``) and turns every way a
file can be wrong (missing, empty, truncated, not a checkpoint, holding Python objects,
lacking an entry, saved from another model) into a ``ConfigError`` that names the option the
path came from (``resume``, ``checkpoint``) and the file.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from fl_lightning.errors import ConfigError
from fl_lightning.runtime.output_files import write_file

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive format (the only one save_checkpoint writes)


def save_checkpoint(state: Mapping[str, Any], path: Path) -> None:
    """Serialize ``state`` in memory, then write it atomically (``output_files.write_file``).

    A kill mid-write leaves the previous checkpoint intact (rename is atomic on POSIX). A write
    that fails (disk full) removes the temporary file, keeps the previous checkpoint and raises
    a one-line ``OutputError`` saying how much space the save needs and how much is free.
    Serializing first keeps torch's own writer, whose errors on a full disk are C++ messages
    about stream positions, away from the file.
    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    kept = f"the previous {path.name} is kept" if path.exists() else f"no earlier {path.name} exists"
    write_file(path, buffer.getbuffer(), kept=kept, then="run the same command with --resume auto")


def load_checkpoint(path: Path, map_location: Any = "cpu", key: str = "checkpoint",
                    required: Iterable[str] = ()) -> dict:
    """Load with ``weights_only=True``: tensors and primitive containers, never arbitrary objects.

    ``key`` is the option that named the file (``resume``, ``checkpoint``); ``required`` lists
    top-level entries the caller needs (e.g. ``("model", "round")``). Raises ``ConfigError``
    for a file that is missing, unreadable, empty, truncated, not a checkpoint, holds pickled
    Python objects (which could run code when loaded) or lacks a required entry.
    """
    path = Path(path)
    _check_file(path, key)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on pickle protocols is not the user's concern
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ConfigError(key, f"{path}: {_unpickling_problem(str(error))}") from None
    except (RuntimeError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError,
            UnicodeDecodeError, zipfile.BadZipFile, OSError) as error:
        if isinstance(error, RuntimeError) and "out of memory" in str(error).lower():
            raise
        raise ConfigError(key, f"{path}: not a readable checkpoint (truncated or corrupted: "
                               f"{_short(error)})") from None
    if not isinstance(state, dict):
        raise ConfigError(key, f"{path}: holds a {type(state).__name__}, not a checkpoint (a dict of entries)")
    missing = [name for name in required if name not in state]
    if missing:
        held = ", ".join(map(str, list(state)[:8])) or "nothing"
        raise ConfigError(key, f"{path}: not a checkpoint of this kind: no {', '.join(map(repr, missing))} "
                               f"entry (it holds {held})")
    return state


def load_model_state(model: torch.nn.Module, state: Any, path: Path, key: str = "checkpoint") -> None:
    """``model.load_state_dict(state)``, with a ``ConfigError`` naming a few differing entries when
    the checkpoint was saved from another architecture or size (missing or unexpected
    parameters, different shapes) instead of torch's multi-line error."""
    check_model_state(model.state_dict(), state, path, key)
    model.load_state_dict(state)


def check_model_state(expected: Mapping[str, torch.Tensor], state: Any, path: Path, key: str = "checkpoint",
                      names: bool = True) -> None:
    """The checks of ``load_model_state`` against the state dict ``expected`` (which may live on
    the meta device: only names and shapes are compared). ``names=False`` compares only the
    shapes of the entries both hold (a model an algorithm's set-up has yet to extend)."""
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ConfigError(key, f"{path}: its 'model' entry is not a state dict (names to tensors)")
    missing = [k for k in expected if k not in state] if names else []
    unexpected = [k for k in state if k not in expected] if names else []
    not_tensors = [k for k in state if k in expected and not isinstance(state[k], torch.Tensor)]
    shapes = [f"{k} (checkpoint {list(state[k].shape)}, model {list(expected[k].shape)})"
              for k in expected if isinstance(state.get(k), torch.Tensor) and state[k].shape != expected[k].shape]
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("not tensors", not_tensors),
                         ("different shapes", shapes)):
        if names:
            problems.append(f"{len(names)} {label}: {_few(names)}")
    if problems:
        raise ConfigError(key, f"{path} does not fit the model ({'; '.join(problems)}); it was saved from "
                               "another architecture or size (model.class_path, model, data classes)")


def _check_file(path: Path, key: str) -> None:
    if not path.exists():
        raise ConfigError(key, f"no checkpoint file at {path}")
    if not path.is_file():
        raise ConfigError(key, f"{path} is not a file")
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise ConfigError(key, f"{path}: cannot be read ({error.strerror or error})") from None
    if not head:
        raise ConfigError(key, f"{path} is empty (0 bytes): an interrupted copy or a failed save")
    if head == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        raise ConfigError(key, f"{path} is truncated (its archive has no end); an interrupted copy or save")
    if head != _ZIP_MAGIC and head[:1] != b"\x80":
        raise ConfigError(key, f"{path} is not a checkpoint file (torch.save writes a zip archive)")


def _unpickling_problem(message: str) -> str:
    if "GLOBAL" in message:
        named = re.search(r"GLOBAL ([\w.]+)", message)
        detail = f" (it calls {named.group(1)})" if named else ""
        return ("holds pickled Python objects besides tensors and plain values, and loading those could run "
                f"code; refused{detail}. Only checkpoints written by fl_lightning can be loaded")
    return "not a checkpoint file (its contents are not a torch.save archive of tensors and plain values)"


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _few(names: list, count: int = 3) -> str:
    shown = ", ".join(names[:count])
    return shown + (f", ... ({len(names) - count} more)" if len(names) > count else "")
