"""Cross-rank sums in one collective, and a gather of small per-client objects."""

from __future__ import annotations

import traceback
from typing import Any, Dict, List, Optional

import torch


def all_reduce_sum(fabric, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Sum every tensor of ``tensors`` over ranks with a single all-reduce.

    One flat float64 buffer instead of one collective per tensor: a round's accumulators are
    tens to hundreds of tensors, and per-collective latency would otherwise dominate small models.
    """
    if fabric.world_size == 1:
        return dict(tensors)
    items = list(tensors.items())
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in items])
    flat = fabric.all_reduce(flat, reduce_op="sum")
    out, offset = {}, 0
    for key, t in items:
        n = t.numel()
        out[key] = flat[offset:offset + n].view(t.shape).to(t.dtype)
        offset += n
    return out


def all_gather_objects(fabric, items: Dict[int, Any]) -> Dict[int, Any]:
    """Merge every rank's ``{key: picklable}`` into one dict on every rank (small objects:
    the clients' log rows)."""
    if fabric.world_size == 1:
        return dict(items)
    gathered: List[Dict[int, Any]] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, items)
    merged: Dict[int, Any] = {}
    for part in gathered:
        merged.update(part)
    return merged


def lost_peer(error: BaseException) -> Optional[str]:
    """The reason, when ``error`` is a collective failing because another rank is gone (its
    process or node died: gloo's "Connection closed by peer", NCCL's errors, a timeout), else
    None. Recognized by where it was raised: inside ``torch.distributed``."""
    if not isinstance(error, RuntimeError) or "out of memory" in str(error).lower():
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or "torch/distributed/" not in frames[-1].filename.replace("\\", "/"):
        return None
    text = " ".join(str(error).split())
    text = text.split("] ", 1)[-1] if text.startswith("[") else text  # gloo's source position
    return text.split(". ", 1)[0][:160]
