"""Position-wise, sample-count-weighted aggregation with value and count accumulators.

For every global position ``u`` the new value is ``sum_i n_i theta_i[u] / sum_i n_i`` over the
clients whose region covers ``u``; positions that no participant covers keep their value
(FEAST Eq. 7, HAS-FL's coordinate-wise rule). Dense FedAvg is the special case where every
region is the whole tensor, and then each count is a single number.

Accumulators are plain tensors (:meth:`SparseAccumulator.tensors`), so the runtime sums them
across ranks with one all-reduce before calling :meth:`SparseAccumulator.result`.

The sums must not depend on the order of the clients or on how ranks split them (two ranks give
what one rank gives, bit for bit). A float32 value times an integer weight (a sample count) has
at most 24 + log2(n) significant bits, so float64 adds such terms exactly, in any order. A
non-integer weight (MaxNet's ``c`` and ``(1 - c) / (K - 1)``, FedAS's Fisher traces) gives
products with all 53 bits, whose sums round differently in different orders; so such a weight and
each weighted value are rounded to :data:`EXACT_BITS` significant bits first (a relative change
of at most 2^-33, far below float32's 2^-24), and their sums are exact again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Mapping, Optional

import torch

from fl_lightning.elastic.bn import variance_keys
from fl_lightning.elastic.regions import LeadingSlice, Region
from fl_lightning.elastic.routing import RegionMap


EXACT_BITS = 32
"""Significant bits kept of a non-integer weight and of each value it weights (float64 sums)."""
_SPLITTER = float(2 ** (53 - EXACT_BITS) + 1)


def exact_terms(x):
    """``x`` (a float or a float64 tensor) rounded to :data:`EXACT_BITS` significant bits, by
    Veltkamp's splitting: three separately rounded float64 operations."""
    c = x * _SPLITTER
    return c - (c - x)


def aggregated_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Floating-point entries are averaged; integer buffers (BN step counters) are kept."""
    return [k for k, v in state.items() if v.is_floating_point()]


class SparseAccumulator:
    """Accumulates weighted client values into global positions.

    Args:
        global_state: the server's state dict (names -> tensors); read, never written here.
        dense: every client returns whole tensors, so counts are scalars (FedAvg).
        dtype: accumulator precision (float64 keeps sums of many clients exact enough that
            the order of clients across ranks does not matter in float32 results).
        pooled_variances: batch-norm running variances are pooled as populations: each enters
            as its second moment ``var + mean^2`` and the result is ``E[x^2] - mean^2`` (the law
            of total variance), so the spread between the clients' means counts. Otherwise a
            variance is averaged like any other value.
    """

    def __init__(self, global_state: Mapping[str, torch.Tensor], dense: bool = False,
                 dtype: torch.dtype = torch.float64, pooled_variances: bool = False):
        self.global_state = global_state
        self.dense = dense
        self.dtype = dtype
        self.variances = {var: mean for mean, var in variance_keys(global_state)} if pooled_variances else {}
        """running-variance key -> its running-mean key, for the pooled variances"""
        self.keys = aggregated_keys(global_state)
        self.values: Dict[str, torch.Tensor] = {
            k: torch.zeros(global_state[k].shape, dtype=dtype, device=global_state[k].device) for k in self.keys
        }
        # Counts are built from the regions lazily: clients with identical regions add once.
        self._pending: Dict[str, Dict[tuple, list]] = defaultdict(dict)
        self.counts: Optional[Dict[str, torch.Tensor]] = None

    def add(self, local_state: Mapping[str, torch.Tensor], weight: float, regions: RegionMap) -> None:
        """Add one client's returned values with weight ``n_i``."""
        weight = float(weight)
        rounded = not weight.is_integer() and self.dtype == torch.float64
        if rounded:
            weight = exact_terms(weight)
        for local_key, (global_key, region) in regions.items():
            if global_key not in self.values:
                continue
            if self.dense and not region.covers_all():
                raise ValueError(f"dense aggregation got a partial region for {global_key}")
            value = local_state[local_key]
            if global_key in self.variances:  # its mean shares its region and local prefix
                mean = local_state[local_key[:-len("running_var")] + "running_mean"]
                value = value + mean.square()
            if rounded:
                region.scatter_add(self.values[global_key], exact_terms(value.to(torch.float64) * weight))
            else:
                region.scatter_add(self.values[global_key], value, alpha=weight)
            entry = self._pending[global_key].setdefault(_region_key(region), [region, 0.0])
            entry[1] += weight

    def _build_counts(self) -> Dict[str, torch.Tensor]:
        counts = {}
        for key in self.keys:
            value = self.values[key]
            pending = self._pending.get(key, {})
            if self.dense:
                counts[key] = value.new_tensor(sum(w for _, w in pending.values()))
                continue
            count = torch.zeros_like(value)
            for region, weight in pending.values():
                region.fill_add(count, weight)
            counts[key] = count
        return counts

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every accumulator, for a cross-rank sum (values under ``v/``, counts under ``c/``)."""
        if self.counts is None:
            self.counts = self._build_counts()
        out = {f"v/{k}": v for k, v in self.values.items()}
        out.update({f"c/{k}": c for k, c in self.counts.items()})
        return out

    def load_tensors(self, reduced: Mapping[str, torch.Tensor]) -> None:
        """Take back the cross-rank sums produced from :meth:`tensors`."""
        self.values = {k: reduced[f"v/{k}"] for k in self.keys}
        self.counts = {k: reduced[f"c/{k}"] for k in self.keys}

    def result(self) -> Dict[str, torch.Tensor]:
        """New global tensors: value / count where covered, the old value elsewhere."""
        if self.counts is None:
            self.counts = self._build_counts()
        out = {}
        for key in self.keys:
            old = self.global_state[key]
            value, count = self.values[key], self.counts[key]
            if self.dense:
                out[key] = (value / count).to(old.dtype) if count > 0 else old.clone()
                continue
            # 0/0 where nobody covered: where() keeps the old value there
            out[key] = torch.where(count > 0, value / count, old.to(value.dtype)).to(old.dtype)
        for var, mean in self.variances.items():  # second moments back to variances
            covered = self.counts[var] > 0
            pooled = self.values[var] / self.counts[var] - out[mean].to(self.values[var].dtype).square()
            out[var] = torch.where(covered, pooled.clamp_min(0.0), self.global_state[var].to(pooled.dtype)).to(
                self.global_state[var].dtype)
        return out


def _region_key(region: Region) -> tuple:
    if isinstance(region, LeadingSlice):
        return ("leading", tuple(region.local_shape))
    return ("id", id(region))
