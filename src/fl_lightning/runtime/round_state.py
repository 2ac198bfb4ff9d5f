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
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping

import torch

from fl_lightning.elastic.aggregation import SparseAccumulator
from fl_lightning.runtime.client_store import ClientStateStore
from fl_lightning.runtime.collectives import all_reduce_sum

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
        tensors = {**self.model.tensors(), **{f"sum/{k}": v.to(device) for k, v in self.sums.items()},
                   COMMITTED: torch.tensor(float(self.committed), dtype=torch.float64, device=device)}
        if fabric.world_size > 1:
            for name, store in self.stores.items():
                for client in cohort:
                    entry = self._entry(name, store, client) if client in owned else store.initial()
                    tensors.update({f"store/{name}/{client}/{k}": v for k, v in entry.items()})
        reduced = all_reduce_sum(fabric, tensors)
        self.model.load_tensors(reduced)
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
            self.sums.update({k: v.to(torch.float64) for k, v in all_reduce_sum(fabric, late).items()})

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
