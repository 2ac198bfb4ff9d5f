"""The active part of a full parameter: its leading slice, or the parameter itself."""

from __future__ import annotations

import torch
from torch import nn

from fl_lightning.elastic.layers.persistent_slices import active_slices


def leading(tensor: torch.Tensor, *sizes: int) -> torch.Tensor:
    """``tensor[:s0, :s1, ...]`` (dimensions not listed whole), or ``tensor`` itself when the
    slice would be the whole tensor: then no view is made, autograd records nothing for it, and
    the backward pass hands the gradient straight to the parameter instead of through a view's
    node (a partial slice's backward builds a zero-padded full-size gradient). Inside a
    :meth:`~fl_lightning.elastic.layers.persistent_slices.PersistentSlices.step`, a parameter's
    partial slice is that step's kept leaf."""
    if all(size == full for size, full in zip(sizes, tensor.shape)):
        return tensor
    slices = active_slices()
    if slices is not None and isinstance(tensor, nn.Parameter):
        return slices.slice(tensor, sizes)
    return tensor[tuple(slice(0, size) for size in sizes)]
