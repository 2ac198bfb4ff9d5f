"""Pretrained weights from a local file: reading a state dict and copying what fits.

Nothing is ever downloaded (the machines running this code reach no model hub): the
``pretrained`` option of a model names a file already on disk. A model maps the file's names
to its own and copies every tensor whose name and shape match; what does not fit is skipped and
reported in one warning line, so loading ImageNet weights into a CIFAR-sized model (another
stem, another number of classes) keeps everything that can be kept and says what was not.
A missing or unreadable file is a ConfigError under ``model.pretrained``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable, Mapping

import torch

from fl_lightning.errors import ConfigError

KEY = "model.pretrained"


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save``d state dict at ``path`` (on the CPU).

    Accepts a plain mapping of names to tensors or one under a ``"state_dict"`` or ``"model"``
    entry (training checkpoints); a ``"module."`` prefix on every name (DataParallel) is
    dropped. Loads with ``weights_only=True``: a file that would need arbitrary code to unpickle
    is refused.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(KEY, f"no such file: {path}")
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for a file that is not its format
        raise ConfigError(KEY, f"{path} is not a torch state dict file (torch.load failed with "
                               f"{type(error).__name__}: {_one_line(error)})") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
    if not (isinstance(obj, Mapping) and obj
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())):
        raise ConfigError(KEY, f"{path} holds no state dict (a mapping of names to tensors, "
                               f"possibly under 'state_dict' or 'model'), got {type(obj).__name__}")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def shape_text(tensor: torch.Tensor) -> str:
    """``(64,3,7,7)``: a tensor's shape as the warnings print it."""
    return "(" + ",".join(map(str, tensor.shape)) + ")"


def _listed(items: list[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def copy_matching(target: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Copy ``source[k]`` into ``target[k]`` in place wherever both have ``k`` at the same shape.

    ``target`` is a module's ``state_dict()`` (its tensors share storage with the module).
    Returns the keys by outcome: ``loaded``, ``mismatched`` (as ``"key (file shape) vs (model
    shape)"``), ``unused`` (only in the file) and ``missing`` (only in the model).
    """
    outcome: dict[str, list[str]] = {"loaded": [], "mismatched": [], "unused": [], "missing": []}
    with torch.no_grad():
        for key, value in source.items():
            if key not in target:
                outcome["unused"].append(key)
            elif value.shape != target[key].shape:
                outcome["mismatched"].append(f"{key} {shape_text(value)} vs {shape_text(target[key])}")
            else:
                target[key].copy_(value)
                outcome["loaded"].append(key)
    outcome["missing"] = [key for key in target if key not in source]
    return outcome


def warn_skipped(path: str, outcome: Mapping[str, list[str]], kinds: Iterable[str] = ("mismatched", "unused", "missing")) -> None:
    """One warning line naming what of ``path`` was not loaded (nothing when all fitted)."""
    labels = {"mismatched": "skipped for their shape (file vs model)", "unused": "in the file only",
              "missing": "not in the file (left as initialised)"}
    parts = [f"{len(outcome[k])} {labels[k]}: {_listed(outcome[k])}" for k in kinds if outcome.get(k)]
    if parts:
        warnings.warn(f"{KEY}: loaded {len(outcome['loaded'])} tensors of {path}; " + "; ".join(parts),
                      stacklevel=3)
