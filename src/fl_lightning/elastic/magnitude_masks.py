"""Unstructured magnitude masks over a model's convolution and linear parameters (FIARSE),
their threshold-controlled forward, and what a masked model costs.

**The mask family.** From one set of weights, a kept fraction ``f`` gives each *group* of
maskable tensors a threshold ``tau_g = `` the ``k``-th largest ``|w|`` of the group, with
``k = floor(f n_g)`` (at least 1), and the mask keeps ``|w| >= tau_g`` (Wu et al., 2024; the
authors' ``generate_mask``/``layer_wise_generate_mask``: ``torch.topk(scores, int(numel *
size))`` and ``scores >= threshold``). Without ties at the threshold exactly ``k`` entries of
the group are kept; tied entries are all kept, as in the original. Groups (``GROUPINGS``):

- ``global``: every maskable tensor together, one threshold for the model (the authors'
  ``fiarse/`` code);
- ``stage``: each top-level child module (``stem``, ``layer1`` .. ``layer4``, ``fc`` of the
  ResNet-18), the grouping of the authors' ``fiarse_layerwise/`` code (their README's CIFAR-100
  command);
- ``tensor``: each convolution or linear module on its own.

Maskable parameters are the weights and biases of every ``nn.Conv2d`` and ``nn.Linear``
(elastic subclasses included); normalization layers are never masked (the authors' masked
batch norms have ``size = 0``). :class:`MaskFamily` finds a threshold by selection or, once
sorted for a grid or a bisection, by indexing, and counts a mask's kept entries per tensor by
binary search. Selection in a large group reads one histogram of the magnitudes' float bits per
round (non-negative floats order as their bit patterns) and selects only within the bin that
holds the ``k``-th largest, so the many kept fractions of a round's clients cost one pass over
the group and a small ``kthvalue`` each, and every threshold equals ``kthvalue``'s exactly.

**The forward.** :func:`threshold_mask` returns ``w * 1{|w| >= tau}`` with ``tau`` fixed for
the round, so the mask is re-evaluated on the current weights at every step
(threshold-controlled). For float32/float64 weights it is ``hardshrink(w, lambda)`` with
``lambda`` the largest value below ``tau`` (keeps ``|w| > lambda``, i.e. ``|w| >= tau``): one
fused pass forward and one backward, where mask, product and masked gradient took five and kept
a boolean mask per tensor and step. Its backward is one of :data:`GRADIENTS`:

- ``masked``: ``dL/dw = g * m``, with ``g = dL/d(w m)``: what the authors' code computes (their
  ``Bern`` function returns a boolean mask, which autograd cannot differentiate, so its
  custom backward never runs and the product rule leaves ``g * m``);
- ``surrogate``: ``dL/dw = g * m * (1 + 2 tau |w| / (|w| + tau)^2)``: the gradient that custom
  backward describes (``d m / d|w| = 2 tau / (|w| + tau)^2`` on kept entries, the derivative of
  ``(|w| - tau) / (|w| + tau)``, chained through ``|w|``).

**Costs.** :class:`LayerMacs` holds fvcore's per-module count of every maskable module (one
input, eval mode, the conventions of :mod:`fl_lightning.elastic.macs`). A convolution's count
is ``numel(weight) x output positions`` and a linear layer's ``numel(weight) x rows``, so the
*logical* MACs of a mask (arithmetic on kept weights only) are the dense count minus
``(numel - kept) x positions`` summed over the layers; the *executed* MACs stay the dense
model's, since a dense kernel runs over the zeros. ``convention="paper"`` counts convolutions
and linear layers only (DeepFedNAS's counter, in which FEAST's budgets are set);
``"fvcore"`` adds fvcore's batch-norm and pooling terms, which no mask changes.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

GROUPINGS = ("global", "stage", "tensor")
GRADIENTS = ("masked", "surrogate")
CONVENTIONS = ("paper", "fvcore")
Grouping = Literal["global", "stage", "tensor"]
Gradient = Literal["masked", "surrogate"]
Convention = Literal["paper", "fvcore"]

MASKABLE = (nn.Conv2d, nn.Linear)
_EPS = 1e-9  # floor(f n) tolerance: 0.29 * 100 must give 29, not 28
# Binned selection: a float32 magnitude's bits >> 16 (8 exponent and 7 mantissa bits) name its
# bin, 2^15 bins in value order; below _BINNED_MIN entries a plain kthvalue is as cheap.
_BIN_SHIFT = 16
_BINS = 1 << (31 - _BIN_SHIFT)
_BINNED_MIN = 1 << 16


def maskable_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """Every convolution and linear module by name, in registration order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MASKABLE)}


def maskable_keys(model: nn.Module) -> List[str]:
    """State-dict keys of the maskable parameters: each conv/linear weight, then its bias."""
    keys = []
    for name, module in maskable_modules(model).items():
        prefix = f"{name}." if name else ""
        keys.append(prefix + "weight")
        if module.bias is not None:
            keys.append(prefix + "bias")
    return keys


def group_keys(model: nn.Module, grouping: Grouping) -> Dict[str, List[str]]:
    """Group name -> maskable keys sharing a threshold (see the module docstring)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    groups: Dict[str, List[str]] = {}
    for name, module in maskable_modules(model).items():
        keys = [f"{name}.weight" if name else "weight"]
        if module.bias is not None:
            keys.append(f"{name}.bias" if name else "bias")
        group = {"global": "all", "stage": name.split(".")[0], "tensor": name}[grouping]
        groups.setdefault(group, []).extend(keys)
    return groups


def kept_count(numel: int, fraction: float) -> int:
    """``floor(fraction * numel)`` with a float tolerance, at least 1 and at most ``numel``."""
    return min(numel, max(1, math.floor(fraction * numel + _EPS)))


def _magnitudes(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.abs().flatten().to(torch.promote_types(tensor.dtype, torch.float32))


class MaskFamily:
    """The magnitude masks of one set of weights, for every kept fraction.

    Args:
        state: name -> tensor (a state dict); only ``groups``' keys are read.
        groups: group name -> keys sharing a threshold (:func:`group_keys`).
    """

    def __init__(self, state: Mapping[str, torch.Tensor], groups: Mapping[str, Sequence[str]]):
        self.groups = {g: list(keys) for g, keys in groups.items()}
        self.group_of = {k: g for g, keys in self.groups.items() for k in keys}
        self.keys = [k for keys in self.groups.values() for k in keys]
        with torch.no_grad():
            # One flat |w| per group (at least float32: a float64 model's threshold is not rounded);
            # each key's entries are a view into it.
            self._group_abs = {g: torch.cat([_magnitudes(state[k]) for k in keys]) for g, keys in self.groups.items()}
            self._abs = {}
            for g, keys in self.groups.items():
                sizes = [state[k].numel() for k in keys]
                self._abs.update(zip(keys, self._group_abs[g].split(sizes)))
        self.numel = {k: v.numel() for k, v in self._abs.items()}
        self.total = sum(self.numel.values())
        self._sorted_group: Optional[Dict[str, torch.Tensor]] = None
        self._sorted_key: Dict[str, torch.Tensor] = {}
        self._taus: Dict[tuple, torch.Tensor] = {}
        self._bins: Dict[str, tuple] = {}

    def presort(self) -> "MaskFamily":
        """Sort every group's magnitudes once: worth it before asking for many fractions (a
        grid, a bisection); a few thresholds are cheaper by selection (``kthvalue``)."""
        if self._sorted_group is None:
            with torch.no_grad():
                self._sorted_group = {g: v.sort(descending=True).values for g, v in self._group_abs.items()}
        return self

    @property
    def sorted_key(self) -> Dict[str, torch.Tensor]:
        """Ascending magnitudes per key (sorted on first use): kept counts for any threshold."""
        if not self._sorted_key:
            with torch.no_grad():
                self._sorted_key = {k: v.sort().values for k, v in self._abs.items()}
        return self._sorted_key

    def _tau(self, group: str, k: int) -> torch.Tensor:
        """The ``k``-th largest magnitude of ``group``."""
        if self._sorted_group is not None:
            return self._sorted_group[group][k - 1]
        if (group, k) not in self._taus:
            values = self._group_abs[group]
            if values.numel() < _BINNED_MIN or values.dtype != torch.float32:
                self._taus[(group, k)] = torch.kthvalue(values, values.numel() - k + 1).values
            else:
                self._taus[(group, k)] = self._binned_tau(group, k)
        return self._taus[(group, k)]

    def _binned_tau(self, group: str, k: int) -> torch.Tensor:
        """``_tau`` by the bin holding the ``k``-th largest magnitude (module docstring): the
        same value as ``kthvalue`` over the whole group."""
        values = self._group_abs[group]
        with torch.no_grad():
            if group not in self._bins:
                # |w| has its sign bit clear, so the int32 bits are >= 0 and ordered like the values
                bins = values.view(torch.int32) >> _BIN_SHIFT
                counts = torch.bincount(bins, minlength=_BINS)
                # at_least[b]: entries in bins >= b (one host read per group and round)
                at_least = counts.flip(0).cumsum(0).flip(0).tolist() + [0]
                self._bins[group] = (bins, at_least)
            bins, at_least = self._bins[group]
            # the highest bin with at least k entries at or above it holds the k-th largest
            lo, hi = 0, _BINS - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if at_least[mid] >= k else (lo, mid - 1)
            above = at_least[lo + 1]
            inside = values[bins == lo]
            return torch.kthvalue(inside, inside.numel() - (k - above) + 1).values

    def thresholds(self, fraction: float) -> Dict[str, torch.Tensor]:
        """Key -> its group's threshold (a 0-dim tensor) for kept fraction ``fraction``."""
        taus = {g: self._tau(g, kept_count(v.numel(), fraction)) for g, v in self._group_abs.items()}
        return {k: taus[self.group_of[k]] for k in self.keys}

    def kept(self, thresholds: Mapping[str, torch.Tensor]) -> Dict[str, int]:
        """Key -> number of entries with ``|w| >= tau`` (ties at the threshold are kept)."""
        out = {}
        for k in self.keys:
            s = self.sorted_key[k]
            below = torch.searchsorted(s, thresholds[k].reshape(1).to(s.dtype), right=False)
            out[k] = s.numel() - int(below)
        return out

    def kept_fraction(self, thresholds: Mapping[str, torch.Tensor]) -> float:
        return sum(self.kept(thresholds).values()) / self.total

    def masks(self, state: Mapping[str, torch.Tensor], thresholds: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Key -> boolean mask ``|w| >= tau`` of ``state``'s tensor (same shape and device)."""
        with torch.no_grad():
            return {k: state[k].abs() >= thresholds[k].to(state[k].device, state[k].dtype) for k in self.keys}

    def fraction_for_macs(self, macs: "LayerMacs", budget: float, low: float, convention: Convention = "paper",
                          iterations: int = 60) -> float:
        """The largest fraction in ``[low, 1]`` whose logical MACs stay within ``budget``
        (``low`` when even it does not). Logical MACs never decrease with the fraction."""
        self.presort()

        def cost(f):
            return macs.logical(self.kept(self.thresholds(f)), convention)

        if cost(1.0) <= budget:
            return 1.0
        if cost(low) > budget:
            return low
        lo, hi = low, 1.0
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
        return lo


def shrink_bound(tau: torch.Tensor, dtype: torch.dtype) -> Optional[float]:
    """``lambda`` with ``|w| > lambda`` exactly when ``|w| >= tau`` in ``dtype`` (the largest
    ``dtype`` value below ``tau``; a negative one for ``tau = 0``, which keeps everything), or
    None where no such bound is safe (other dtypes, a subnormal or non-finite ``tau``). A host
    read: take it once per threshold, not per step."""
    if dtype not in (torch.float32, torch.float64):
        return None
    t = tau.detach().to("cpu", dtype)
    if float(t) == 0.0:
        return -1.0
    if not (torch.finfo(dtype).tiny <= float(t) < math.inf):
        return None
    return float(torch.nextafter(t, torch.zeros_like(t)))


class ThresholdMask(torch.autograd.Function):
    """``w * 1{|w| >= tau}`` with the backward of :data:`GRADIENTS` (module docstring); with a
    ``bound`` (:func:`shrink_bound`) the mask is hardshrink's and no boolean mask is kept."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, tau: torch.Tensor, surrogate: bool, bound: Optional[float] = None):
        ctx.surrogate, ctx.bound = surrogate, bound
        if bound is not None:
            ctx.save_for_backward(weight, tau)
            return F.hardshrink(weight, bound)
        mask = weight.abs() >= tau
        ctx.save_for_backward(weight, tau, mask)
        return weight * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.bound is not None:
            weight, tau = ctx.saved_tensors
            out = torch.ops.aten.hardshrink_backward(grad, weight, ctx.bound)
        else:
            weight, tau, mask = ctx.saved_tensors
            out = grad * mask
        if ctx.surrogate:
            a = weight.abs()
            denom = (a + tau).pow(2)
            factor = 2 * tau * a / torch.where(denom > 0, denom, torch.ones_like(denom))
            out = out * (1 + factor)
        return out, None, None, None


def threshold_mask(weight: torch.Tensor, tau: torch.Tensor, gradient: Gradient = "masked",
                   bound: Union[float, None, Literal["auto"]] = "auto") -> torch.Tensor:
    """The masked tensor a FIARSE client computes with (differentiable in ``weight``).

    ``bound``: :func:`shrink_bound` of ``tau`` in ``weight``'s dtype, precomputed by a caller
    that masks every step (None: the boolean-mask path); "auto" finds it here (a host read).
    """
    if gradient not in GRADIENTS:
        raise ValueError(f"gradient must be one of {GRADIENTS}, got {gradient!r}")
    tau = tau.to(weight.device, weight.dtype)
    if isinstance(bound, str):
        bound = shrink_bound(tau, weight.dtype)
    if bound is not None and gradient == "masked":
        # hardshrink's own backward is the masked gradient: one fused kernel each way
        return F.hardshrink(weight, bound)
    return ThresholdMask.apply(weight, tau, gradient == "surrogate", bound)


@dataclass
class LayerMacs:
    """fvcore's MACs of a dense model, split by maskable module.

    ``weight_macs[k]`` is the count of the module owning weight ``k`` (batch size 1, eval
    mode); ``total`` is fvcore's total (batch norm and pooling included).
    """

    weight_macs: Dict[str, int]
    weight_numel: Dict[str, int]
    total: int

    @property
    def conv_linear(self) -> int:
        return sum(self.weight_macs.values())

    def executed(self, convention: Convention = "paper") -> int:
        """The dense model's MACs: what a masked model executes with dense kernels."""
        return self.conv_linear if convention == "paper" else self.total

    def positions(self, key: str) -> float:
        """MACs per weight entry of ``key``'s module (output positions for a convolution)."""
        n = self.weight_numel[key]
        macs = self.weight_macs[key]
        return macs // n if macs % n == 0 else macs / n

    def logical(self, kept: Mapping[str, int], convention: Convention = "paper"):
        """MACs on kept weights only: the dense count less ``(numel - kept) x positions`` per
        layer (biases are not MACs; keys missing from ``kept`` count as fully kept)."""
        dropped = sum((self.weight_numel[k] - kept.get(k, self.weight_numel[k])) * self.positions(k)
                      for k in self.weight_macs)
        return self.executed(convention) - dropped


@torch.no_grad()
def layer_macs(model: nn.Module, input_shape: Sequence[int], input_dtype: Optional[torch.dtype] = None) -> LayerMacs:
    """Count ``model`` once with fvcore and keep each maskable module's share."""
    from fl_lightning.elastic.macs import EXTRA_HANDLES, FlopCountAnalysis  # imported there without fvcore's warnings

    reference = next(iter(model.state_dict().values()), torch.zeros(()))
    float_dtype = reference.dtype if reference.is_floating_point() else torch.get_default_dtype()
    dtype = input_dtype or getattr(model, "input_dtype", None) or float_dtype
    x = torch.zeros(1, *input_shape, device=reference.device, dtype=dtype)
    training = model.training
    model.eval()
    try:
        analysis = FlopCountAnalysis(model, x).set_op_handle(**EXTRA_HANDLES)
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        analysis.tracer_warnings("none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            by_module = analysis.by_module()
            total = int(analysis.total())
    finally:
        model.train(training)
    weight_macs, weight_numel = {}, {}
    for name, module in maskable_modules(model).items():
        key = f"{name}.weight" if name else "weight"
        weight_macs[key] = int(by_module.get(name, 0))
        weight_numel[key] = module.weight.numel()
    return LayerMacs(weight_macs, weight_numel, total)


__all__ = ["GROUPINGS", "GRADIENTS", "CONVENTIONS", "maskable_modules", "maskable_keys", "group_keys", "kept_count",
           "MaskFamily", "ThresholdMask", "shrink_bound", "threshold_mask", "LayerMacs", "layer_macs"]
