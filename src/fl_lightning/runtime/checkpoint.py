"""Atomic checkpoint files holding only tensors and plain Python values.

Loading never runs code from the file (``torch.load(weights_only=True)``) and turns every way a
file can be wrong (missing, empty, truncated, not a checkpoint, holding Python objects,
lacking an entry, saved from another model) into a ``ConfigError`` that names the option the
path came from (``resume``, ``checkpoint``) and the file.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from fl_lightning.errors import ConfigError, RunError

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive format (the only one save_checkpoint writes)


def save_checkpoint(state: Mapping[str, Any], path: Path) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``.

    A kill mid-write leaves the previous checkpoint intact (rename is atomic on POSIX). A write
    that fails (disk full, Ctrl-C) removes the temporary file and keeps the previous checkpoint;
    an operating-system error becomes a one-line ``RunError`` that says how much space the
    save needs.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            torch.save(dict(state), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise RunError(_save_problem(error, state, path)) from None
        raise


def _save_problem(error: OSError, state: Mapping[str, Any], path: Path) -> str:
    kept = "the previous checkpoint is kept" if path.exists() else "no earlier checkpoint exists"
    needed = f"about {_megabytes(_state_bytes(state))}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_megabytes(shutil.disk_usage(path.parent).free)} are free"
        except OSError:
            free = "the free space is unknown"
        return (f"no space left on the device while saving {path}: the next save needs {needed} and {free}; "
                f"{kept}. Free some space and run the same command with --resume auto")
    return (f"cannot save {path} ({error.strerror or error}); the save needs {needed}; {kept}. "
            "Fix the folder and run the same command with --resume auto")


def _state_bytes(value: Any) -> int:
    """Bytes of the tensors in a checkpoint's state (what torch.save writes, less a little framing)."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_state_bytes(v) for v in value)
    return 0


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{max(nbytes, 1) / 2**10:.1f} KiB"


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
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ConfigError(key, f"{path}: its 'model' entry is not a state dict (names to tensors)")
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
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
    model.load_state_dict(state)


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
