"""Datasets, partitions and server-held splits.

The datasets are chosen in a config by ``class_path`` (``fl_lightning.data.CIFAR10``, ...): see
:mod:`fl_lightning.data.sources`.
"""

from fl_lightning.data.sources import (CIFAR10, CIFAR100, CINIC10, EMNIST, DatasetSource, Digits, DomainNet,
                                       MNISTSubset, Shakespeare, Synthetic, TinyImageNet)

__all__ = ["CIFAR10", "CIFAR100", "CINIC10", "DatasetSource", "Digits", "DomainNet", "EMNIST", "MNISTSubset",
           "Shakespeare", "Synthetic", "TinyImageNet"]
