"""Regions: which positions of a global tensor a client's local tensor stands for.

A region maps between a global tensor (the server's full parameter) and the physical local
tensor a client trains. Three kinds cover the sub-model literature:

- :class:`LeadingSlice`  ``global[:n0, :n1, ...]`` (HeteroFL, FjORD, FEAST, slimmable nets)
- :class:`RollingSlice`  per dimension a window of consecutive indices that wraps around
  (FedRolex)
- :class:`Mask`          an arbitrary boolean mask; the local tensor has the global shape and
  only masked positions count (FIARSE)

Every region can ``gather`` a copy of its positions, ``scatter`` values back, and add
(weighted) values or counts into accumulators of the global shape; aggregation and routing are
written against this interface only.
"""

from __future__ import annotations

from typing import Sequence

import torch


class Region:
    """Positions of a global tensor covered by a local tensor."""

    global_shape: torch.Size
    local_shape: torch.Size  # shape of the client's tensor

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """A new tensor in the local layout holding ``full`` at the covered positions."""
        raise NotImplementedError

    def read_into(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Copy ``full`` at the covered positions into ``local`` (in the local layout), in place."""
        local.copy_(self.gather(full))

    def scatter(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` into ``full`` at the covered positions."""
        raise NotImplementedError

    def scatter_add(self, full: torch.Tensor, local: torch.Tensor, alpha: float = 1.0) -> None:
        """``full[covered] += alpha * local``."""
        raise NotImplementedError

    def fill_add(self, full: torch.Tensor, value: float) -> None:
        """``full[covered] += value`` (count accumulators)."""
        raise NotImplementedError

    def numel(self) -> int:
        """Number of covered positions (what a client receives and sends)."""
        raise NotImplementedError

    def covers_all(self) -> bool:
        return self.numel() == self.global_shape.numel()


class LeadingSlice(Region):
    """``global[:s0, :s1, ...]``; dimensions not listed are taken whole."""

    def __init__(self, global_shape: Sequence[int], local_shape: Sequence[int]):
        self.global_shape = torch.Size(global_shape)
        local_shape = tuple(local_shape) + tuple(self.global_shape[len(local_shape):])
        if len(local_shape) != len(self.global_shape) or any(
            not 0 <= n <= g for n, g in zip(local_shape, self.global_shape)
        ):
            raise ValueError(f"local shape {local_shape} is not a leading slice of {tuple(self.global_shape)}")
        self.local_shape = torch.Size(local_shape)
        self.index = tuple(slice(0, n) for n in local_shape)

    def gather(self, full):
        return full[self.index].clone()

    def read_into(self, local, full):
        local.copy_(full[self.index])  # from the view: one copy, not a clone and a copy

    def scatter(self, full, local):
        full[self.index].copy_(local)

    def scatter_add(self, full, local, alpha=1.0):
        full[self.index].add_(local, alpha=alpha)

    def fill_add(self, full, value):
        full[self.index].add_(value)

    def numel(self):
        return self.local_shape.numel()

    def contains(self, other: "LeadingSlice") -> bool:
        """Whether every position of ``other`` is also covered here."""
        return all(a >= b for a, b in zip(self.local_shape, other.local_shape))

    def __repr__(self):
        return f"LeadingSlice({tuple(self.local_shape)} of {tuple(self.global_shape)})"


def union_numel(shapes: Sequence[Sequence[int]]) -> int:
    """Positions of one tensor covered by at least one of the leading slices ``shapes``
    (``global[:s0, :s1, ...]`` each, of equal rank): rows ``[lo, hi)`` between two consecutive
    distinct first sizes are covered by exactly the slices reaching ``hi``, so the count is a
    sum over those bands of the band's height times the union of their remaining dimensions."""
    shapes = [tuple(s) for s in shapes]
    if not shapes:
        return 0
    if not shapes[0]:  # a scalar: covered once
        return 1
    cuts = sorted({s[0] for s in shapes}, reverse=True)
    total = 0
    for hi, lo in zip(cuts, cuts[1:] + [0]):
        total += (hi - lo) * union_numel([s[1:] for s in shapes if s[0] >= hi])
    return total


class RollingSlice(Region):
    """Per dimension ``d``, indices ``(start_d + j) mod size_d`` for ``j < length_d`` (FedRolex)."""

    def __init__(self, global_shape: Sequence[int], starts: Sequence[int], local_shape: Sequence[int]):
        self.global_shape = torch.Size(global_shape)
        ndim = len(self.global_shape)
        starts = tuple(starts) + (0,) * (ndim - len(starts))
        local_shape = tuple(local_shape) + tuple(self.global_shape[len(local_shape):])
        self.local_shape = torch.Size(local_shape)
        self.indices = [
            (torch.arange(n) + s) % g for s, n, g in zip(starts, local_shape, self.global_shape)
        ]

    def _grid(self, device):
        return torch.meshgrid(*[i.to(device) for i in self.indices], indexing="ij")

    def gather(self, full):
        out = full
        for dim, idx in enumerate(self.indices):
            out = out.index_select(dim, idx.to(full.device))
        return out

    def scatter(self, full, local):
        full.index_put_(self._grid(full.device), local.to(full.dtype))

    def scatter_add(self, full, local, alpha=1.0):
        full.index_put_(self._grid(full.device), local.to(full.dtype) * alpha, accumulate=True)

    def fill_add(self, full, value):
        full.index_put_(self._grid(full.device), torch.full(self.local_shape, float(value), dtype=full.dtype, device=full.device), accumulate=True)

    def numel(self):
        return self.local_shape.numel()


class Mask(Region):
    """Arbitrary covered positions; the local tensor keeps the global shape."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()
        self.global_shape = self.local_shape = self.mask.shape
        self._numel = None

    def gather(self, full):
        return torch.where(self.mask.to(full.device), full, torch.zeros((), dtype=full.dtype, device=full.device))

    def scatter(self, full, local):
        m = self.mask.to(full.device)
        full[m] = local[m].to(full.dtype)

    def scatter_add(self, full, local, alpha=1.0):
        # A product with the 0/1 mask in full's dtype, not torch.where: the same values for a
        # finite ``local`` (the loop commits finite updates only) at a fraction of where's time.
        local = local.to(full.device, full.dtype, copy=True)
        local.mul_(self.mask.to(full.device, full.dtype))
        full.add_(local, alpha=alpha)

    def fill_add(self, full, value):
        full.add_(self.mask.to(full.device, full.dtype), alpha=value)

    def numel(self):
        if self._numel is None:  # the mask never changes; routing and traffic ask every client
            self._numel = int(self.mask.sum())
        return self._numel


class Full(LeadingSlice):
    """The whole tensor (dense FedAvg)."""

    def __init__(self, global_shape: Sequence[int]):
        super().__init__(global_shape, global_shape)
