"""Mini-batches of one client's shard."""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from fl_lightning.data.base import ArrayDataset


class ClientData:
    """A client's shard of a dataset, iterated in epochs of shuffled mini-batches.

    In-memory datasets without a per-example transform are batched by tensor indexing; others
    go through a DataLoader. Either way the order comes only from the generator passed in, so
    a client's batches depend on (seed, round, client) and nothing else.
    """

    def __init__(self, dataset: Dataset, indices: torch.Tensor, batch_size: int,
                 device: Optional[torch.device] = None, num_workers: int = 0):
        self.dataset = dataset
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.device = device
        self.num_workers = num_workers
        self.fast = isinstance(dataset, ArrayDataset) and dataset.transform is None

    def __len__(self) -> int:
        return len(self.indices)

    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def epoch(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the shard in a random order."""
        order = self.indices[torch.randperm(len(self.indices), generator=generator)]
        if self.fast:
            for start in range(0, len(order), self.batch_size):
                idx = order[start:start + self.batch_size]
                yield self._to_device(self.dataset.data[idx], self.dataset.targets[idx])
            return
        loader = DataLoader(Subset(self.dataset, order.tolist()), batch_size=self.batch_size,
                            shuffle=False, num_workers=self.num_workers)
        for x, y in loader:
            yield self._to_device(x, y)

    def steps(self, num_steps: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Exactly ``num_steps`` mini-batches, reshuffling at each epoch boundary."""
        done = 0
        while done < num_steps:
            for batch in self.epoch(generator):
                yield batch
                done += 1
                if done == num_steps:
                    return

    def _to_device(self, x, y):
        if self.device is None:
            return x, y
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def eval_batches(dataset: Dataset, indices: Optional[torch.Tensor], batch_size: int,
                 device: Optional[torch.device] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed-order batches for evaluation and BN calibration."""
    if indices is None:
        indices = torch.arange(len(dataset))
    data = ClientData(dataset, indices, batch_size, device)
    if data.fast:
        for start in range(0, len(data.indices), batch_size):
            idx = data.indices[start:start + batch_size]
            yield data._to_device(dataset.data[idx], dataset.targets[idx])
        return
    loader = DataLoader(Subset(dataset, data.indices.tolist()), batch_size=batch_size, shuffle=False)
    for x, y in loader:
        yield data._to_device(x, y)
