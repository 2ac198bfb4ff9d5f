"""Mini-batches of one client's shard, made on the host or on the device (``data.augment_on``).

- :class:`HostBatches`: the dataset's own per-example transform in a DataLoader in this process
  (in-memory datasets without a transform are batched by tensor indexing); pinned memory when
  the device is a GPU, so the copy to it does not wait.
- :class:`DeviceBatches`: the uint8 images kept on the device once per rank, each mini-batch
  gathered there and augmented there by the batched form of the same torchvision pipeline
  (:mod:`fl_lightning.data.batch_augment`: the same distribution, other random draws), so the
  host only dispatches kernels while the device trains.

Either way the order comes only from the generator passed to :meth:`ClientData.epoch` and the
augmentation from torch's global generator, which the loop seeds per (seed, round, client): a
client's batches depend on (seed, round, client) and nothing else.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from fl_lightning.config import AugmentOn
from fl_lightning.data.base import ArrayDataset
from fl_lightning.errors import ConfigError


class HostBatches:
    """Batches made on the host: tensor indexing, or the per-example transform in a DataLoader."""

    def __init__(self, dataset: Dataset, device: Optional[torch.device] = None, num_workers: int = 0):
        self.dataset, self.device, self.num_workers = dataset, device, num_workers
        self.indexed = isinstance(dataset, ArrayDataset) and dataset.transform is None
        self.pinned = device is not None and device.type == "cuda"

    def batches(self, order: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.indexed:
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                yield self._to_device(self.dataset.data[idx], self.dataset.targets[idx])
            return
        loader = DataLoader(Subset(self.dataset, order.tolist()), batch_size=batch_size, shuffle=False,
                            num_workers=self.num_workers, pin_memory=self.pinned)
        for x, y in loader:
            yield self._to_device(x, y)

    def _to_device(self, x, y):
        if self.device is None:
            return x, y
        # never waits for the device: from pinned memory the copy is queued, from pageable
        # memory it is staged at once
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class DeviceBatches:
    """Batches gathered and augmented on the device from its uint8 images (one copy per rank,
    shared by every client's shard)."""

    def __init__(self, dataset: ArrayDataset, device: torch.device, pipeline):
        self.dataset, self.device, self.pipeline = dataset, device, pipeline
        self._stored = None

    def batches(self, order: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        images, targets = self.stored()
        order = order.to(self.device, non_blocking=True)  # pageable: staged at once, nothing waited for
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            yield self.pipeline(images.index_select(0, idx)), targets.index_select(0, idx)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and targets on the device, copied there on first use."""
        if self._stored is None:
            self._stored = self.dataset.data.to(self.device), self.dataset.targets.to(self.device)
        return self._stored


def batched_form(dataset: Dataset, augment_on: AugmentOn):
    """The batched pipeline of ``dataset``'s transform, or None where it has none; a ConfigError
    when ``augment_on`` is device and there is none."""
    from fl_lightning.data.batch_augment import batched_pipeline

    in_memory = isinstance(dataset, ArrayDataset)
    pipeline = batched_pipeline(dataset.transform) if in_memory else None
    if augment_on == "device" and pipeline is None:
        why = ("the dataset is read from files on access; load it into memory (data.dataset.in_memory: true)"
               if not in_memory else f"its transform has a step without a batched form ({dataset.transform})")
        raise ConfigError("data.augment_on", f"device, but {why}; use host or auto")
    return pipeline


def training_batches(dataset: Dataset, device: torch.device, augment_on: AugmentOn = "auto"):
    """The batch maker of a rank's training data: on the device where ``augment_on`` says so
    (auto: on a GPU, when the data is in memory and its transform has a batched form)."""
    pipeline = batched_form(dataset, augment_on)
    if augment_on == "device" or (augment_on == "auto" and pipeline is not None and device.type != "cpu"):
        return DeviceBatches(dataset, device, pipeline)
    return HostBatches(dataset, device)


class ClientData:
    """A client's shard of a dataset, iterated in epochs of shuffled mini-batches.

    ``source`` makes the batches (default: :class:`HostBatches` of ``dataset``); the order comes
    only from the generator passed in.
    """

    def __init__(self, dataset: Dataset, indices: torch.Tensor, batch_size: int,
                 device: Optional[torch.device] = None, num_workers: int = 0, source=None):
        self.dataset = dataset
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.device = device
        self.num_workers = num_workers
        self.source = source if source is not None else HostBatches(dataset, device, num_workers)

    def __len__(self) -> int:
        return len(self.indices)

    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def epoch(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the shard in a random order."""
        order = self.indices[torch.randperm(len(self.indices), generator=generator)]
        yield from self.source.batches(order, self.batch_size)

    def steps(self, num_steps: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Exactly ``num_steps`` mini-batches, reshuffling at each epoch boundary."""
        done = 0
        while done < num_steps:
            for batch in self.epoch(generator):
                yield batch
                done += 1
                if done == num_steps:
                    return


def eval_batches(dataset: Dataset, indices: Optional[torch.Tensor], batch_size: int,
                 device: Optional[torch.device] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed-order batches for evaluation and BN calibration."""
    if indices is None:
        indices = torch.arange(len(dataset))
    yield from HostBatches(dataset, device).batches(torch.as_tensor(indices, dtype=torch.long), batch_size)
