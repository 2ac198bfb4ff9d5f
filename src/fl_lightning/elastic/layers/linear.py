"""Linear layer that holds the full weight and forwards a leading slice of it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.regions import LeadingSlice


class ElasticLinear(nn.Linear):
    """``nn.Linear`` with ``weight[:out, :in]`` active.

    The active input width is read from the input; the active output width is
    ``self.active_out`` (None = all). Fixed dimensions (e.g. a classifier's classes) simply
    stay at their maximum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.active_out: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.active_out or self.out_features
        in_ = x.shape[-1]
        bias = leading(self.bias, out) if self.bias is not None else None
        return F.linear(x, leading(self.weight, out, in_), bias)

    def extract(self, in_features: int, out_features: int) -> nn.Linear:
        """A plain ``nn.Linear`` holding a copy of the slice."""
        layer = nn.Linear(in_features, out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(self.weight[:out_features, :in_features])
            if self.bias is not None:
                layer.bias.copy_(self.bias[:out_features])
        return layer

    def regions(self, in_features: int, out_features: int) -> dict:
        """Local parameter name -> region of the same-named global parameter."""
        out = {"weight": LeadingSlice(self.weight.shape, (out_features, in_features))}
        if self.bias is not None:
            out["bias"] = LeadingSlice(self.bias.shape, (out_features,))
        return out
