"""Batch norm over a leading slice of channels, sharing one set of full-size statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.elastic.layers.leading import leading
from fl_lightning.elastic.layers.persistent_slices import active_slices
from fl_lightning.elastic.regions import Full, LeadingSlice

_CHANNEL_TENSORS = ("weight", "bias", "running_mean", "running_var")


class ElasticBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that normalises the leading ``x.shape[1]`` channels.

    As Once-for-All's ``DynamicBatchNorm2d``: the affine parameters and the running statistics
    are sliced, and in training mode the running-statistic slice is updated in place (a leading
    slice of a 1-D buffer is a contiguous view, so the kernel writes into the full buffer).
    Channels outside the active slice keep their statistics. Statistics are shared by all widths;
    evaluate a width after :func:`fl_lightning.elastic.bn.recalibrate_bn` when that matters.

    At full width nothing is sliced. The statistics' views are made once per width and kept
    (buffers take no gradient, so one view serves every forward until a buffer is replaced),
    which spares two operations per layer and forward on the host.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._statistics_views: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        self._check_input_dim(x)
        # Same momentum bookkeeping as nn.BatchNorm (momentum=None -> cumulative average).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            slices = active_slices()
            if slices is not None and self.momentum is not None:
                slices.count_batch(self.num_batches_tracked)  # not read in this step: added at its end
            else:
                self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        mean, var = self._statistics(n) if not self.training or self.track_running_stats else (None, None)
        weight = leading(self.weight, n) if self.weight is not None else None
        bias = leading(self.bias, n) if self.bias is not None else None
        return F.batch_norm(x, mean, var, weight, bias, use_batch_stats, factor, self.eps)

    def _statistics(self, n: int) -> tuple:
        """The leading ``n`` channels of the running mean and variance (None without them)."""
        if self.running_mean is None or self.running_var is None or n == self.num_features:
            return self.running_mean, self.running_var
        views = self._statistics_views.get(n)
        if views is None or views[0]._base is not self.running_mean or views[1]._base is not self.running_var:
            views = self._statistics_views[n] = (self.running_mean[:n], self.running_var[:n])
        return views

    def extract(self, num_features: int) -> nn.BatchNorm2d:
        """A plain ``nn.BatchNorm2d`` holding copies of the parameter and statistic slices."""
        layer = nn.BatchNorm2d(num_features, eps=self.eps, momentum=self.momentum, affine=self.affine,
                               track_running_stats=self.track_running_stats,
                               device=self._device(), dtype=self._dtype())
        state = layer.state_dict()
        with torch.no_grad():
            for name, region in self.regions(num_features).items():
                region.read_into(state[name], getattr(self, name))
        return layer.train(self.training)

    def regions(self, num_features: int) -> dict:
        """Local state name (parameters and buffers) -> region of the same-named global tensor."""
        regions = {}
        for name in _CHANNEL_TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                regions[name] = LeadingSlice(tensor.shape, (num_features,))
        if self.num_batches_tracked is not None:
            regions["num_batches_tracked"] = Full(self.num_batches_tracked.shape)
        return regions

    def _device(self):
        return next(t for t in (self.weight, self.running_mean) if t is not None).device

    def _dtype(self):
        return next(t for t in (self.weight, self.running_mean) if t is not None).dtype
