"""Counts for tests, written out from layer shapes instead of taken from the code under test:
forward hooks on plain modules (they run on the meta device too, so the 55.68M-parameter
supernet costs nothing to count) and closed-form sums over a network's channel list.

MAC conventions: ``paper`` counts convolutions (``H_out W_out c_in c_out k^2 / groups``) and
linear layers (``in x out``) only, as DeepFedNAS's counter and FEAST's budgets do; ``fvcore``
adds 2 per batch-norm output element and 1 per input element of the global average pool.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def hooked_macs(module: nn.Module, input_shape: Sequence[int]) -> dict:
    """``{"paper": ..., "fvcore": ...}`` MACs of one forward pass of a single input."""
    counts = {"conv_linear": 0, "bn_elements": 0}
    last_conv = []

    def hook(layer, inputs, output):
        if isinstance(layer, nn.Conv2d):
            kh, kw = layer.kernel_size
            counts["conv_linear"] += output.numel() * layer.in_channels // layer.groups * kh * kw
            last_conv[:] = [output.numel()]
        elif isinstance(layer, nn.Linear):
            counts["conv_linear"] += output.numel() * layer.in_features
        else:
            counts["bn_elements"] += output.numel()

    handles = [m.register_forward_hook(hook) for m in module.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d))]
    device = next(module.parameters()).device
    with torch.no_grad():
        module.eval()(torch.zeros(1, *input_shape, device=device))
    for h in handles:
        h.remove()
    # The last convolution of a ResNet (a block's last conv or its projection) gives the
    # feature map that the global average pool reads.
    pool = last_conv[0]
    return {"paper": counts["conv_linear"], "fvcore": counts["conv_linear"] + 2 * counts["bn_elements"] + pool}


def make_divisible(value: float, divisor: int = 8) -> int:
    """Once-for-All's channel rounding, as OFA and DeepFedNAS publish it: the nearest multiple
    of ``divisor`` (at least ``divisor``), one more ``divisor`` where rounding lost over 10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def basic_pair_params(stem: int, stages: Sequence[tuple], num_classes: int, in_channels: int = 3) -> int:
    """Parameters of the DeepFedNAS construction: 3x3 stem + BN; per block a 3x3 conv
    (in -> mid) + BN and a 3x3 conv (mid -> out) + BN; a 1x1 projection + BN on each stage's
    first block; a linear head with bias. ``stages``: ``(out, mid, blocks)`` per stage."""
    total, c_in = in_channels * stem * 9 + 2 * stem, stem
    for out, mid, blocks in stages:
        for b in range(blocks):
            total += c_in * mid * 9 + 2 * mid + mid * out * 9 + 2 * out
            if b == 0:
                total += c_in * out + 2 * out
            c_in = out
    return total + c_in * num_classes + num_classes


def bottleneck_params(stem: int, stages: Sequence[tuple], num_classes: int, in_channels: int = 3) -> int:
    """Parameters of the bottleneck construction: 3x3 stem + BN; per block 1x1 (in -> mid),
    3x3 (mid -> mid), 1x1 (mid -> out), each + BN; a 1x1 projection + BN on each stage's
    first block; a linear head with bias."""
    total, c_in = in_channels * stem * 9 + 2 * stem, stem
    for out, mid, blocks in stages:
        for b in range(blocks):
            total += c_in * mid + 2 * mid + mid * mid * 9 + 2 * mid + mid * out + 2 * out
            if b == 0:
                total += c_in * out + 2 * out
            c_in = out
    return total + c_in * num_classes + num_classes


def basic_pair_paper_macs(stem: int, stages: Sequence[tuple], strides: Sequence[int], num_classes: int,
                          size: int = 32, in_channels: int = 3) -> int:
    """Convolution and classifier MACs of the DeepFedNAS construction at a square input with a
    stride-1 stem: the first 3x3 conv and the projection of a stage's first block run at the
    stage's output resolution (the stride is theirs), everything else at it too."""
    total, c_in, hw = size * size * in_channels * stem * 9, stem, size
    for (out, mid, blocks), stride in zip(stages, strides):
        hw //= stride
        for b in range(blocks):
            total += hw * hw * (c_in * mid * 9 + mid * out * 9 + (c_in * out if b == 0 else 0))
            c_in = out
    return total + c_in * num_classes
