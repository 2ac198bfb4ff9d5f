"""Where a run writes: config, metrics, TensorBoard events, checkpoints.

Also the checks that keep a run inside its ``out_dir``, refuse an output folder that cannot be
written before any work starts, and refuse to resume a run under a different configuration.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path, PurePath
from typing import Iterable, List, Optional

import yaml

from fl_lightning.errors import ConfigError
from fl_lightning.runtime.output_files import append_line, write_file

LAST, BEST = "last.ckpt", "best.ckpt"

# Keys that may differ between a run's saved config.yaml and the command that resumes it: where
# and how it runs, when it evaluates and checkpoints, where the same data files lie, what it logs to.
# Everything else (data, partition, model, algorithm, train, federation, seed) changes what
# the remaining rounds compute, so a resume with another value is refused.
RESUME_SAFE_KEYS = ("fabric.*", "eval.*", "checkpoint_every", "stop_after", "name", "out_dir", "resume",
                    "data.root", "data.download", "data.dataset.init_args.skip_integrity_check", "loggers")


class RunDir:
    """``<out_dir>/<name>/`` with ``config.yaml``, ``metrics.jsonl``, ``clients.jsonl``,
    ``tensorboard/`` (and each other logger's folder, named in ``loggers.json``),
    ``checkpoints/{last,best}.ckpt``, ``partition.pt`` and ``summary.json``."""

    def __init__(self, out_dir: str, name: str):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / name
        self.checkpoints = self.path / "checkpoints"
        self.last = self.checkpoints / LAST
        self.best = self.checkpoints / BEST
        self.metrics = self.path / "metrics.jsonl"
        self.clients = self.path / "clients.jsonl"
        self.summary = self.path / "summary.json"
        self.loggers = self.path / "loggers.json"

    def resolve_resume(self, resume: Optional[str]) -> Optional[Path]:
        """The checkpoint to continue from, or None for a fresh run; refuses to overwrite."""
        if resume is None:
            if self.last.exists():
                raise ConfigError("name", f"{self.path} already holds a run; pass --resume auto to continue it "
                                          "or choose another --name")
            return None
        if resume == "auto":
            return self.last if self.last.exists() else None
        path = Path(resume)
        if not path.is_file():
            raise ConfigError("resume", f"no checkpoint file at {path}")
        return path

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)

    def check_writable(self) -> None:
        """Refuse, before any work and leaving nothing behind, an output location that cannot
        be written: ``out_dir`` (or a folder above it) is a file or read-only, or the run's own
        folder or its files cannot be replaced."""
        check_path_limits(self.out_dir, "out_dir")
        check_path_limits(self.path, "name")
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise ConfigError("out_dir", f"{self.path.parent} is a file, not a folder; choose another --out_dir")
        check_writable(self.path, "name" if self.path.exists() else "out_dir")
        if self.path.is_dir():
            for folder in (self.checkpoints, self.path / "tensorboard"):
                check_writable(folder, "name")
            for file in (self.last, self.best, self.metrics, self.clients, self.summary, self.loggers,
                         self.path / "config.yaml"):
                check_writable(file, "name", folder=False)


def check_writable(path: Path, key: str, folder: bool = True) -> None:
    """ConfigError unless ``path`` (a folder, or a file with ``folder=False``) can be created or
    replaced: it is of that kind and writable if it exists, else the nearest existing folder
    above it is a writable folder in which folders can be made (not /proc or /sys), and no
    step of the path is a symbolic link that leads nowhere. Leaves nothing behind."""
    path = Path(path)
    check_path_limits(path, key)
    _check_links(path, key)
    if path.exists():
        if folder and not path.is_dir():
            raise ConfigError(key, f"{path} is a file, not a folder; choose another --{key}")
        if not folder and path.is_dir():
            raise ConfigError(key, f"{path} is a folder, not a file; choose another --{key}")
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise ConfigError(key, f"{path} is not writable; choose another --{key}")
        if folder:
            _probe(path, key)
            return
    existing = path.parent
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, f"{existing} is a file, not a folder; choose another --{key}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{existing} is not writable; choose another --{key}")
    _probe(existing, key)


def check_path_limits(path: Path, key: str) -> None:
    """The file system's limits on one name (usually 255 bytes) and on a whole path (4096)."""
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.isdir(existing) and existing.parent != existing:
        existing = existing.parent
    name_max, path_max = _limit(existing, "PC_NAME_MAX", 255), _limit(existing, "PC_PATH_MAX", 4096)
    for part in path.parts[1:]:
        if len(os.fsencode(part)) > name_max:
            raise ConfigError(key, f"a folder name of {len(os.fsencode(part))} bytes ({part[:20]}...) is longer than "
                                   f"the {name_max} bytes this file system allows; choose a shorter --{key}")
    if len(os.fsencode(str(path))) >= path_max:
        raise ConfigError(key, f"{str(path)[:40]}... is {len(os.fsencode(str(path)))} bytes long, past the "
                               f"{path_max} bytes this file system allows; choose a shorter --{key}")


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return default


def _check_links(path: Path, key: str) -> None:
    """Refuse a path through a symbolic link loop or a link whose target is missing."""
    for step in [Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents]:
        if not os.path.islink(step):
            continue
        try:
            os.stat(step)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise ConfigError(key, f"{step} is a symbolic link loop; choose another --{key}") from None
            raise ConfigError(key, f"{step} is a symbolic link to {os.readlink(step)}, which cannot be reached "
                                   f"({error.strerror}); choose another --{key}") from None


def _probe(folder: Path, key: str) -> None:
    """Make and remove a folder in ``folder``: what permission bits cannot tell (a read-only or
    virtual file system such as /proc or /sys) shows here."""
    probe = folder / f".fl_lightning-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        return
    except OSError as error:
        raise ConfigError(key, f"cannot create folders in {folder} ({error.strerror or error}); "
                               f"choose another --{key}") from None
    probe.rmdir()


def check_run_name(name: str, key: str = "name") -> None:
    """A run name is a relative folder below ``out_dir`` (``a`` or ``sweep/a``): not empty, not
    absolute, no ``..`` or ``.`` steps and no control characters, so a run stays inside its out_dir."""
    if not name or not name.strip():
        raise ConfigError(key, "must not be empty; outputs go to <out_dir>/<name>/")
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        raise ConfigError(key, f"must not hold control characters, got {name!r}")
    if os.path.isabs(name) or PurePath(name).anchor or name.startswith("~"):
        raise ConfigError(key, f"must be a relative name below out_dir, got {name!r}; set --out_dir for the parent")
    steps = name.replace("\\", "/").split("/")
    if any(step in ("..", ".") for step in steps) or name.endswith("/"):
        raise ConfigError(key, f"must be a plain name below out_dir (no '..', '.' or trailing '/'), got {name!r}")


def check_resume_compatible(saved_config_yaml: str, new_config_yaml: str, key: str = "resume") -> None:
    """Refuse to continue a run whose saved config differs from the new one anywhere but in
    ``RESUME_SAFE_KEYS``, naming the differing keys and both values.

    Both arguments are resolved configs as ``fit`` saves them (``config.yaml``). Algorithm
    options are compared as ``algorithm.<option>``; a key that only one side holds counts as a
    difference unless its value there is null or empty (an option added by a newer version).
    """
    saved, new = flat_config(saved_config_yaml, "saved"), flat_config(new_config_yaml, "new")
    differing = []
    for name in sorted(set(saved) | set(new), key=_config_order(new, saved)):
        if _resume_safe(name):
            continue
        old_value, new_value = saved.get(name, _ABSENT), new.get(name, _ABSENT)
        if old_value is _ABSENT and new_value in (None, {}, []) or new_value is _ABSENT and old_value in (None, {}, []):
            continue
        if old_value != new_value:
            differing.append(f"{name} ({_show(old_value)} -> {_show(new_value)})")
    if differing:
        shown = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
        raise ConfigError(key, f"the run was trained with another configuration: {shown}; a resume may change only "
                               f"{', '.join(RESUME_SAFE_KEYS)} (start a new run with another --name instead)")


_ABSENT = object()


def flat_config(text: str, which: str = "saved") -> dict:
    """A resolved config (YAML) as ``{dotted key: value}``, algorithm and model options as
    ``algorithm.<option>`` (as on the command line); ConfigError (``resume``) if it is not one."""
    try:
        tree = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as error:
        detail = " ".join(str(error).split())[:120]
        raise ConfigError("resume", f"the {which} config is not valid YAML ({detail})") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError("resume", f"the {which} config is not a mapping of sections")
    flat: dict = {}
    _flatten(tree, "", flat)
    return flat


def _flatten(tree, prefix: str, out: dict) -> None:
    for name, value in tree.items():
        if prefix in ("algorithm.", "model.") and name == "init_args" and isinstance(value, dict):
            _flatten(value, prefix, out)  # algorithm.<option>, as on the command line
            continue
        if prefix in ("algorithm.", "model.") and name == "class_path" and isinstance(value, str):
            value = value.rsplit(".", 1)[-1]  # Feast and fl_lightning.algorithms.Feast are one class
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            _flatten(value, dotted + ".", out)
        else:
            out[dotted] = value


def _resume_safe(name: str) -> bool:
    return any(name == safe or (safe.endswith(".*") and name.startswith(safe[:-1])) for safe in RESUME_SAFE_KEYS)


def _config_order(*configs: dict):
    order = {}
    for config in configs:
        for name in config:
            order.setdefault(name, len(order))
    return lambda name: order[name]


def _show(value) -> str:
    if value is _ABSENT:
        return "not set"
    text = json.dumps(value) if isinstance(value, (list, dict, str)) or value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


class JsonLines:
    """Append-only JSON-lines file; on resume, rows at or after the resumed round are dropped
    so the file reads as one uninterrupted run (``kept``: the rows left). Rows are appended
    whole or not at all, and the file is rewritten atomically (``output_files``)."""

    def __init__(self, path: Path, keep_before_round: Optional[int] = None):
        self.path = path
        self.kept: List[dict] = []
        if keep_before_round is not None and path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.kept = [r for r in rows if r.get("round", -1) < keep_before_round]
            self._rewrite(self.kept)
        elif path.exists():
            path.unlink()

    def _rewrite(self, rows: Iterable[dict]) -> None:
        write_file(self.path, "".join(json.dumps(r) + "\n" for r in rows), kept="the file is as it was", then=RESUME)

    def write(self, row: dict) -> None:
        append_line(self.path, json.dumps(row), then=RESUME)


RESUME = "run the same command with --resume auto"
