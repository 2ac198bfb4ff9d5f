"""Parameter slices kept across training steps, so that a multi-pass step does not slice.

Eager autograd charges a partial slice ``weight[:out, :in]`` three operations in every pass: the
slice, its backward (a zero-padded gradient of the full size) and that gradient's addition into
``weight.grad``. A step of several variants per batch (FEAST's three passes) pays them for most
layers of all but the widest pass. While :meth:`PersistentSlices.step` runs,
:func:`~fl_lightning.elastic.layers.leading.leading` hands out instead, per parameter and sizes,
one leaf tensor that shares the parameter's storage (the optimizer's in-place update shows
through it) and whose ``.grad`` is the same slice of the parameter's gradient: the pass's
gradient is added into that slice in place. The arithmetic is the slices': inside
the slice the same additions in the same order, outside none instead of additions of zeros.

Each pass is backpropagated by :meth:`PersistentSlices.backward`, which asks autograd for the
pass's gradients (``torch.autograd.grad``) instead of letting it add them into each parameter
and leaf one by one, and adds them into the kept gradients with one multi-tensor operation
for the dense ones and one for the strided ones (a GPU's multi-tensor kernel takes dense
tensors only). Where each parameter is reached at most once per pass (every elastic model
here), these are autograd's additions in the same order; a parameter reached several times in
one pass gets its gradients added one reach after another, where autograd may sum them first
(the same up to rounding).

The gradients must then outlive a step, so the client zeroes them in place
(``zero_grad(set_to_none=False)``), and the step drops the gradient of every parameter that no
pass reached, so that the optimizer and clipping still skip what a step did not train, as they
do with gradients allocated afresh. A dropped gradient is all zeros; it is kept and handed back
at the next step's start, so that its slices stay valid.

Batch-norm batch counters are deferred the same way: a layer with a momentum does not read its
counter, so the step adds each layer's count of forwards once at its end (one operation for
all layers) instead of once per layer and pass.
"""

from __future__ import annotations

import contextlib
import warnings
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

_ACTIVE: ContextVar[Optional["PersistentSlices"]] = ContextVar("persistent_slices", default=None)

# AccumulateGrad warns (once) that a sliced leaf's gradient is not laid out like a dense
# parameter's; it concerns DDP's gradient buckets, which client training does not use.
_LAYOUT_WARNING = "grad and param do not obey the gradient layout contract"


def active_slices() -> Optional["PersistentSlices"]:
    """The slices of the step now running, or None outside :meth:`PersistentSlices.step`."""
    return _ACTIVE.get()


@dataclass
class _Leaf:
    parameter: nn.Parameter
    storage: int  # the parameter's data pointer when the leaf was made
    grad: torch.Tensor  # the parameter's gradient the leaf's gradient is a slice of
    leaf: torch.Tensor


def _leading_view(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The leading block of ``shape`` as one view (one operation, where indexing makes one slice
    per dimension)."""
    return tensor.as_strided(shape, tensor.stride(), tensor.storage_offset())


class PersistentSlices:
    """The leaf slices and step bookkeeping of one model's local training.

    Make one per client fit (:meth:`close` after it), zero gradients in place between steps,
    run each step's passes inside :meth:`step` and backpropagate each pass by :meth:`backward`.
    """

    def __init__(self, model: nn.Module):
        self._leaves: dict[tuple[int, tuple[int, ...]], _Leaf] = {}
        self._pass_leaves: dict[tuple[int, tuple[int, ...]], _Leaf] = {}  # handed out since the last backward
        self._reached: set[int] = set()
        self._counters: dict[int, list] = {}  # id(counter) -> [counter, forwards this step]
        self._aliases: dict[int, torch.Tensor] = {}  # id(parameter) -> parameter.detach()
        self._dropped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (parameter, zero gradient)
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._marker(p)) for p in self._parameters]

    # A backward outside :meth:`backward` (plain ``loss.backward()``) accumulates through autograd
    # into the same kept gradients; these hooks then record what it reached.
    def _marker(self, parameter: torch.Tensor):
        key = id(parameter)

        def mark(_: torch.Tensor) -> None:
            self._reached.add(key)
        return mark

    @contextlib.contextmanager
    def step(self) -> Iterator["PersistentSlices"]:
        """One training step's passes: slices from the cache, counters deferred; on leaving,
        counters added and the gradients of parameters no pass reached dropped."""
        self._reached.clear()
        self._pass_leaves.clear()
        for parameter, zeros in self._dropped.values():
            if parameter.grad is None:
                parameter.grad = zeros
        self._dropped.clear()
        token = _ACTIVE.set(self)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_LAYOUT_WARNING)
                yield self
        finally:
            _ACTIVE.reset(token)
            self._add_counts()
            self._drop_unreached()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one pass's ``loss`` and add its gradients into the kept gradients of the
        parameters and of the partial slices this pass used.

        One multi-tensor addition takes the gradients whose kept tensor and gradient are both
        dense, one the others; a parameter the pass reaches more than once (whole and sliced, or
        at two widths) has its further gradients added by later calls, one per further reach,
        so that no call adds into overlapping memory (a GPU's multi-tensor kernel would race)."""
        leaves = list(self._pass_leaves.values())
        self._pass_leaves.clear()
        inputs = [*self._parameters, *(entry.leaf for entry in leaves)]
        owners = [*self._parameters, *(entry.parameter for entry in leaves)]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        dense: tuple[list, list] = ([], [])
        strided: tuple[list, list] = ([], [])
        further: list[tuple[list, list]] = []  # [k]: each parameter's (k + 2)-th reach in this pass
        reaches: dict[int, int] = {}  # id(parameter) -> reaches so far in this pass
        for tensor, owner, grad in zip(inputs, owners, grads):
            if grad is None:
                continue
            whole = tensor is owner
            if whole and owner.grad is None:
                owner.grad = torch.zeros_like(owner)
            sink = owner.grad if whole else tensor.grad
            reach = reaches.get(id(owner), 0)
            reaches[id(owner)] = reach + 1
            if reach:
                if len(further) < reach:
                    further.append(([], []))
                group = further[reach - 1]
            elif sink.is_contiguous() and grad.is_contiguous():
                group = dense
            else:
                group = strided
            group[0].append(sink)
            group[1].append(grad)
        self._reached.update(reaches)
        with torch.no_grad():
            for sinks, addends in (dense, strided, *further):
                if sinks:
                    torch._foreach_add_(sinks, addends)

    def _drop_unreached(self) -> None:
        """Set aside the (zero) gradient of every parameter no pass of this step reached."""
        for parameter in self._parameters:
            if parameter.grad is not None and id(parameter) not in self._reached:
                self._dropped[id(parameter)] = (parameter, parameter.grad)
                parameter.grad = None

    def slice(self, parameter: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """``parameter[:s0, :s1, ...]`` as a leaf whose gradient accumulates into the same slice
        of ``parameter.grad`` (allocated as zeros if absent); a plain slice when no gradient is
        recorded."""
        if not (torch.is_grad_enabled() and parameter.requires_grad):
            return parameter[tuple(slice(0, size) for size in sizes)]
        grad = parameter.grad
        if grad is None:
            grad = parameter.grad = torch.zeros_like(parameter)
        key = (id(parameter), sizes)
        entry = self._leaves.get(key)
        if (entry is None or entry.parameter is not parameter or entry.grad is not grad
                or entry.storage != parameter.data_ptr()):
            shape = (*sizes, *parameter.shape[len(sizes):])
            leaf = _leading_view(self._detached(parameter), shape).requires_grad_()
            leaf.grad = _leading_view(grad, shape)
            leaf.register_post_accumulate_grad_hook(self._marker(parameter))
            entry = self._leaves[key] = _Leaf(parameter, parameter.data_ptr(), grad, leaf)
        self._pass_leaves[key] = entry
        return entry.leaf

    def _detached(self, parameter: torch.Tensor) -> torch.Tensor:
        """``parameter.detach()``, made once per parameter and storage (it shares the
        parameter's version counter, so autograd still sees the optimizer's in-place updates)."""
        alias = self._aliases.get(id(parameter))
        if alias is None or alias.data_ptr() != parameter.data_ptr():
            alias = self._aliases[id(parameter)] = parameter.detach()
        return alias

    def count_batch(self, counter: torch.Tensor) -> None:
        """Add one to a batch-norm counter at the end of the step."""
        pending = self._counters.get(id(counter))
        if pending is None:
            self._counters[id(counter)] = [counter, 1]
        else:
            pending[1] += 1

    def _add_counts(self) -> None:
        by_count: dict[int, list[torch.Tensor]] = {}
        for counter, count in self._counters.values():
            by_count.setdefault(count, []).append(counter)
        self._counters.clear()
        with torch.no_grad():
            for count, counters in by_count.items():
                torch._foreach_add_(counters, count)  # one operation for all counters

    def close(self) -> None:
        """Remove the hooks and forget the leaves (the model no longer needs them)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._leaves.clear()
        self._pass_leaves.clear()
        self._aliases.clear()
        self._dropped.clear()
        self._parameters.clear()
