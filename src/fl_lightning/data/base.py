"""What every dataset loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset


class ArrayDataset(Dataset):
    """An in-memory dataset of stacked examples ``data[i]`` with integer ``targets[i]``.

    With ``transform=None`` the federation loop batches it by plain tensor indexing (no
    DataLoader, no per-example Python), which is what keeps small-model rounds cheap.
    A ``transform`` is applied per example, as torchvision datasets do.
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, transform: Optional[Callable] = None):
        if len(data) != len(targets):
            raise ValueError(f"data has {len(data)} examples but targets has {len(targets)}")
        self.data = data
        self.targets = torch.as_tensor(targets, dtype=torch.long)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        x = self.data[index]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[index]

    def with_transform(self, transform: Optional[Callable]) -> "ArrayDataset":
        """The same storage seen through another transform (e.g. evaluation vs. training)."""
        return ArrayDataset(self.data, self.targets, transform)


@dataclass
class DatasetBundle:
    """A loaded dataset: training pool, test set and what models need to know about them.

    ``train`` is seen through the training transform, ``train_eval`` is the same examples
    through the evaluation transform (server-held validation and BN-calibration splits are
    carved out of the training pool and must not be augmented).
    ``groups`` is the natural partition when the data has one (Shakespeare: one group of
    training indices per speaking role), else None.
    """

    name: str
    train: Dataset
    train_eval: Dataset
    test: Dataset
    train_targets: torch.Tensor
    num_classes: int
    input_shape: tuple
    groups: Optional[Sequence[Sequence[int]]] = None
    group_names: Optional[Sequence[str]] = None
    task: str = "classification"
    extras: dict = field(default_factory=dict)
