"""Run configs saved by earlier versions, read as today's.

Until December 2026 a model was chosen by registry name (``model: {name: resnet18, kwargs:
{width: 0.125}}``) and a dataset likewise (``data: {name: synthetic, options: {num_classes: 5}}``);
both are now ``class_path`` sections like the algorithm's (``data: {dataset: {class_path:
fl_lightning.data.Synthetic, init_args: {num_classes: 5}}}``). ``evaluate``, ``extract``,
``--resume`` and the tools that read saved runs go through :func:`upgraded` /
:func:`upgrade_tree`, so runs written before the change open and continue as they were.
"""

from __future__ import annotations

import copy

import yaml

MODEL_NAMES = {"cnn": "CNN", "lstm": "CharLSTM", "ofa_resnet": "OFAResNet", "resnet18": "ResNet18",
               "scalefl_resnet18": "ScaleFLResNet18", "vit": "ViT"}
"""Registry name -> class in ``fl_lightning.elastic.models``, as the old configs spelled them."""
DATASET_NAMES = {"digits": "Digits", "mnist_subset": "MNISTSubset", "synthetic": "Synthetic", "cifar10": "CIFAR10",
                 "cifar100": "CIFAR100", "emnist": "EMNIST", "cinic10": "CINIC10", "tinyimagenet": "TinyImageNet",
                 "domainnet": "DomainNet", "shakespeare": "Shakespeare"}
"""Registry name -> class in ``fl_lightning.data``, as the old configs spelled them."""


def _section(module: str, names: dict, name: str, options) -> dict:
    section = {"class_path": f"{module}.{names.get(name, name)}"}
    if options:
        section["init_args"] = copy.deepcopy(options)
    return section


def upgrade_tree(tree):
    """``tree`` (a parsed config) with old-style model and data sections rewritten; None if it
    has neither."""
    if not isinstance(tree, dict):
        return None
    model, data = tree.get("model"), tree.get("data")
    old_model = isinstance(model, dict) and "name" in model and "class_path" not in model
    old_data = isinstance(data, dict) and ("name" in data or "options" in data)
    if not (old_model or old_data):
        return None
    upgraded = copy.deepcopy(tree)
    if old_model:
        upgraded["model"] = _section("fl_lightning.elastic.models", MODEL_NAMES, model["name"], model.get("kwargs"))
    if old_data:
        rest = {k: v for k, v in data.items() if k not in ("name", "options")}
        dataset = _section("fl_lightning.data", DATASET_NAMES, data.get("name", "digits"), data.get("options"))
        upgraded["data"] = {"dataset": dataset, **copy.deepcopy(rest)}
    return upgraded


def dataset_of(tree: dict):
    """The dataset (a ``DatasetSource``) of a saved config's parsed tree, of either form, with the
    data section's ``root``."""
    import importlib

    data = (upgrade_tree(tree) or tree).get("data") or {}
    section = data.get("dataset") or {"class_path": "fl_lightning.data.Digits"}
    module, _, name = section["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**(section.get("init_args") or {})), data.get("root", "data")


def upgraded(text: str):
    """The saved config ``text`` in today's form, or None when it already is (or is no mapping)."""
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # reported by whoever reads it
    new = upgrade_tree(tree)
    return None if new is None else yaml.safe_dump(new, sort_keys=False)
