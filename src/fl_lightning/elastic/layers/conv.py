"""2-D convolution that holds the full kernel and forwards a leading slice of its channels."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.regions import LeadingSlice


class ElasticConv2d(nn.Conv2d):
    """``nn.Conv2d`` with ``weight[:out, :in]`` active (Once-for-All's ``DynamicConv2d``).

    The active input width is read from the input; the active output width is
    ``self.active_out`` (None = all). Two channel layouts are supported: dense (``groups=1``)
    and depthwise (``groups == in_channels == out_channels``), where the active groups follow
    the input width and ``active_out`` is ignored. Other group counts have no unambiguous
    leading slice and are refused.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: Optional[int] = None, groups: int = 1, bias: bool = False,
                 dilation: int = 1):
        if groups != 1 and not (groups == in_channels == out_channels):
            raise ValueError("ElasticConv2d supports groups=1 or depthwise (groups == in == out), "
                             f"got groups={groups}, in={in_channels}, out={out_channels}")
        if padding is None:
            padding = dilation * (kernel_size // 2)  # "same" size at stride 1 for odd kernels
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias)
        self.active_out: Optional[int] = None

    @property
    def depthwise(self) -> bool:
        return self.groups > 1

    def _widths(self, in_channels: int, out_channels: Optional[int]) -> tuple[int, int]:
        """(active in, active out); a depthwise layer's output width is its input width."""
        if self.depthwise:
            return in_channels, in_channels
        return in_channels, out_channels or self.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_, out = self._widths(x.shape[1], self.active_out)
        if self.depthwise:
            weight, groups = leading(self.weight, in_), in_
        else:
            weight, groups = leading(self.weight, out, in_), 1
        bias = leading(self.bias, out) if self.bias is not None else None
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def extract(self, in_channels: int, out_channels: int) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` holding a copy of the slice."""
        in_, out = self._widths(in_channels, out_channels)
        layer = nn.Conv2d(in_, out, self.kernel_size, stride=self.stride, padding=self.padding,
                          dilation=self.dilation, groups=in_ if self.depthwise else 1,
                          bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            for name, region in self.regions(in_channels, out_channels).items():
                region.read_into(getattr(layer, name), getattr(self, name))
        return layer

    def regions(self, in_channels: int, out_channels: int) -> dict:
        """Local parameter name -> region of the same-named global parameter."""
        in_, out = self._widths(in_channels, out_channels)
        local = (in_,) if self.depthwise else (out, in_)
        regions = {"weight": LeadingSlice(self.weight.shape, local)}
        if self.bias is not None:
            regions["bias"] = LeadingSlice(self.bias.shape, (out,))
        return regions
