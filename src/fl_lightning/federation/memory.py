"""Refuse a model that would not fit in memory, with the figure, before it is allocated.

The model is built once on the meta device (shapes only, no storage) to count its bytes. A run
holds about ``COPIES`` of them on a rank: the global model, the client worker, its gradients
and the optimizer's momentum (algorithms with more server state hold more). A model width of
1000 is then refused in a line instead of an attempt to allocate tens of gigabytes.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import torch

from fl_lightning.errors import ConfigError

COPIES = 4


def model_bytes(model, num_classes: int, input_shape: Sequence[int]) -> int:
    """Bytes of the parameters and buffers of ``model`` (a config section), counted without
    allocating them."""
    from fl_lightning.elastic.models import build_model

    with torch.device("meta"):
        model = build_model(model, num_classes, input_shape)
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def available_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (a CUDA GPU's free memory, else the machine's available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_fits(model, num_classes: int, input_shape: Sequence[int], device: torch.device) -> None:
    """ConfigError under ``model`` when about COPIES times the bytes of ``model`` (a
    config section) exceed what ``device`` has free."""
    from fl_lightning.elastic.models import model_class, model_options

    try:
        nbytes = model_bytes(model, num_classes, input_shape)
    except ConfigError:
        raise
    except Exception:  # a model that cannot be built on the meta device is not estimated
        return
    needed, free = COPIES * nbytes, available_bytes(device)
    if needed > free:
        shown = f"{model_class(model).__name__} with {model_options(model)}"
        raise ConfigError("model", f"{shown} holds {_gb(nbytes)} of weights, and a run holds about {COPIES} "
                               f"copies ({_gb(needed)}), more than the {_gb(free)} free on {device.type}; "
                               "choose a smaller model")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
