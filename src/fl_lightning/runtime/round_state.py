"""One round's state: everything the round learns, in one place, reduced over ranks once.

A method's ``commit`` writes what it learns from a client into the round's
:class:`RoundAccumulator` and nowhere else; the loop reduces it over ranks with a single
all-reduce; ``finish_round`` reads it. It holds:

- ``model``: the :class:`~fl_lightning.elastic.aggregation.SparseAccumulator` of the global
  tensors (weighted values and counts);
- named sums: float64 tensors a method declares when it makes the accumulator (:meth:`declare`,
  so every rank holds the same names and shapes) and adds to (:meth:`add_sum`);
- per-client state (:meth:`keep`): the new entries of the method's client stores
  (:meth:`register`); after the reduction every rank's stores hold every cohort client's entry
  (a client committed on no rank keeps its entry);
- deferred contributions (:meth:`before_reduce`): what can only be added once this rank's
  clients are all committed (SplitFed V2's server half, trained client after client);
- late sums (:meth:`after_reduce`): per-client figures that need the round's aggregate (HAS-FL's
  heterogeneity estimates, from client updates the rank holds, :meth:`hold`), summed in a second,
  small reduction of just those tensors;
- the number of committed clients.

The reduction sends only what some rank's clients touched: of each global tensor the leading
block that holds every region added this round on any rank (leading slices, as sub-model and
supernet methods route them; any other region counts as the whole tensor), of a tensor no client
touched nothing. Elsewhere every rank holds zeros, whose sum is zero, so the result is the full
reduction's bit for bit. The blocks are agreed on in a small gather of their shapes first.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.elastic.regions import LeadingSlice
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.collectives import all_gather_objects, all_reduce_sum

COMMITTED = "round/committed"


class RoundAccumulator:
    """What one round learns on this rank, then (after :meth:`reduce`) on all of them.

    Args:
        model: the accumulator of the global tensors.
    """

    def __init__(self, model: SparseAccumulator):
        self.model = model
        self.sums: Dict[str, torch.Tensor] = {}
        self.stores: Dict[str, ClientStateStore] = {}
        self.kept: Dict[str, Dict[int, Dict[str, torch.Tensor]]] = {}
        self.committed = 0
        self.held: Dict[str, Dict[int, object]] = {}
        self._deferred: List[Callable[["RoundAccumulator"], None]] = []
        self._late: List[Callable[["RoundAccumulator"], Dict[str, torch.Tensor]]] = []
        self._result = None
        self.touched: Dict[str, Tuple[int, ...]] = {}
        """Global key -> the leading block holding every region added on this rank (then, after
        :meth:`reduce`, on any rank)."""
        self.reduced_bytes = 0
        """Bytes this rank sent in the round's reductions (0 on one rank)."""

    # -- what the method declares when it makes the accumulator --------------------------------
    def declare(self, name: str, zeros: torch.Tensor) -> None:
        """A named sum, at ``zeros`` (kept in float64)."""
        self.sums[name] = zeros.to(torch.float64)

    def register(self, name: str, store: ClientStateStore) -> None:
        """A per-client store whose entries the round's commits replace (:meth:`keep`)."""
        self.stores[name] = store
        self.kept[name] = {}

    # -- what commit writes ---------------------------------------------------------------------
    def add(self, state: Mapping[str, torch.Tensor], weight: float, regions) -> None:
        """A client's tensors into the global tensors' weighted means."""
        self.model.add(state, weight, regions)
        for key, region in regions.values():
            self.touched[key] = union(self.touched.get(key), leading_block(region))

    def add_sum(self, name: str, value, at=None) -> None:
        """Add ``value`` to the declared sum ``name`` (summed over clients and ranks), or to its
        entry ``at`` (an index: a client's row)."""
        if name not in self.sums:
            raise KeyError(f"round sum {name!r} was not declared when the accumulator was made")
        total = self.sums[name] if at is None else self.sums[name][at]
        total += torch.as_tensor(value, dtype=torch.float64).to(total.device)

    def keep(self, store: str, client: int, state: Dict[str, torch.Tensor]) -> None:
        """The client's new entry in the registered store ``store``."""
        self.kept[store][client] = state

    def hold(self, name: str, client: int, value) -> None:
        """Something of the client's that stays on this rank until a late sum reads it."""
        self.held.setdefault(name, {})[client] = value

    def before_reduce(self, contribute: Callable[["RoundAccumulator"], None]) -> None:
        """Call ``contribute(self)`` once this rank's clients are all committed, before the
        reduction (registering the same callable again in a round is a no-op)."""
        if contribute not in self._deferred:
            self._deferred.append(contribute)

    def after_reduce(self, compute: Callable[["RoundAccumulator"], Dict[str, torch.Tensor]]) -> None:
        """``compute(self)`` runs after the reduction and returns further tensors (zeros where
        this rank holds nothing, the same names and shapes on every rank); they are summed over
        ranks in a second reduction into ``sums``."""
        self._late.append(compute)

    # -- the reduction --------------------------------------------------------------------------
    def reduce(self, fabric, cohort: Iterable[int], owned: Iterable[int]) -> None:
        """Sum everything over ranks in one all-reduce. Stores: a rank contributes its owned
        clients' entries (the kept one, else the current one) and zeros for the others, whose
        ``initial()`` is all zeros."""
        for contribute in self._deferred:
            contribute(self)
        cohort, owned = list(cohort), set(owned)
        device = fabric.device
        model = self.model.tensors()
        blocks = self._touched_blocks(fabric, model)
        tensors = {**{k: model[k][blocks[k]] for k in blocks},
                   **{f"sum/{k}": v.to(device) for k, v in self.sums.items()},
                   COMMITTED: torch.tensor(float(self.committed), dtype=torch.float64, device=device)}
        if fabric.world_size > 1:
            for name, store in self.stores.items():
                for client in cohort:
                    entry = self._entry(name, store, client) if client in owned else store.initial()
                    tensors.update({f"store/{name}/{client}/{k}": v for k, v in entry.items()})
            self.reduced_bytes += sum(t.numel() for t in tensors.values()) * 8  # float64 on the wire
        reduced = all_reduce_sum(fabric, tensors)
        if fabric.world_size > 1:  # on one rank the blocks are views of the accumulators themselves
            for key, block in blocks.items():
                model[key][block].copy_(reduced[key])
        self.model.load_tensors(model)
        self.sums = {k: reduced[f"sum/{k}"] for k in self.sums}
        self.committed = int(reduced[COMMITTED])
        for name, store in self.stores.items():
            for client in cohort:
                if fabric.world_size > 1:
                    store.set(client, {k: reduced[f"store/{name}/{client}/{k}"] for k in store.get(client)})
                elif client in self.kept[name]:
                    store.set(client, self.kept[name][client])
        late = {}
        for compute in self._late:
            late.update(compute(self))
        if late:
            self.reduced_bytes += sum(t.numel() for t in late.values()) * 8 if fabric.world_size > 1 else 0
            self.sums.update({k: v.to(torch.float64) for k, v in all_reduce_sum(fabric, late).items()})

    def _touched_blocks(self, fabric, model: Dict[str, torch.Tensor]) -> Dict[str, tuple]:
        """Per accumulator tensor (``v/<key>``, ``c/<key>``), the index of the block any rank
        touched (all of a scalar count); tensors no rank touched are left out."""
        if fabric.world_size > 1:
            merged: Dict[str, Tuple[int, ...]] = {}
            for touched in all_gather_objects(fabric, {fabric.global_rank: self.touched}).values():
                for key, block in touched.items():
                    merged[key] = union(merged.get(key), block)
            self.touched = merged
        blocks = {}
        for name, tensor in model.items():
            block = self.touched.get(name.split("/", 1)[1])
            if tensor.dim() == 0:
                blocks[name] = ()
            elif block is not None:
                blocks[name] = tuple(slice(0, n) for n in block)
        return blocks

    def _entry(self, name: str, store: ClientStateStore, client: int) -> Dict[str, torch.Tensor]:
        kept = self.kept[name].get(client)
        return kept if kept is not None else store.get(client)

    # -- what finish_round reads ----------------------------------------------------------------
    def result(self) -> Dict[str, torch.Tensor]:
        """The new global tensors (``SparseAccumulator.result``, computed once)."""
        if self._result is None:
            self._result = self.model.result()
        return dict(self._result)

    def counts(self, key: str) -> torch.Tensor:
        """How much weight covered each position of the global tensor ``key`` this round."""
        return self.model.counts[key]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums[name]


def leading_block(region) -> Tuple[int, ...]:
    """The shape of the leading block of its global tensor that holds ``region`` (the whole
    tensor for a region that is not a leading slice)."""
    return tuple(region.local_shape) if isinstance(region, LeadingSlice) else tuple(region.global_shape)


def union(held: Optional[Tuple[int, ...]], block: Tuple[int, ...]) -> Tuple[int, ...]:
    """The smallest leading block holding both (``held`` None: none yet)."""
    return block if held is None else tuple(map(max, held, block))
