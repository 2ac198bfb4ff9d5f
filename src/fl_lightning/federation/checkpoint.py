"""Atomic checkpoint files holding only tensors and plain Python values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch


def save_checkpoint(state: Mapping[str, Any], path: Path) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``.

    A kill mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        torch.save(dict(state), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, map_location: Any = "cpu", key: str = "checkpoint") -> dict:
    """Load with ``weights_only=True``: tensors and primitive containers, never arbitrary objects."""
    return torch.load(Path(path), map_location=map_location, weights_only=True)


def load_model_state(model, state: dict, path: Path, key: str = "checkpoint") -> None:
    model.load_state_dict(state["model"])
