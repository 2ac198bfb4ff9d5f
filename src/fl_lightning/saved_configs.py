"""Run configs saved by earlier versions, read as today's.

Until December 2026 a model was chosen by registry name (``model: {name: resnet18, kwargs:
{width: 0.125}}``); it is now a ``class_path`` section like the algorithm's. ``evaluate``,
``extract`` and ``--resume`` read a run's saved ``config.yaml`` through :func:`upgraded`, so runs
written before the change open and continue as they were.
"""

from __future__ import annotations

import copy

import yaml

MODEL_NAMES = {"cnn": "CNN", "lstm": "CharLSTM", "ofa_resnet": "OFAResNet", "resnet18": "ResNet18",
               "scalefl_resnet18": "ScaleFLResNet18", "vit": "ViT"}
"""Registry name -> class in ``fl_lightning.elastic.models``, as the old configs spelled them."""


def upgrade_tree(tree):
    """``tree`` (a parsed config) with an old-style model section rewritten; None if it has none."""
    model = tree.get("model") if isinstance(tree, dict) else None
    if not (isinstance(model, dict) and "name" in model and "class_path" not in model):
        return None
    upgraded = copy.deepcopy(tree)
    name = model["name"]
    section = {"class_path": f"fl_lightning.elastic.models.{MODEL_NAMES.get(name, name)}"}
    if model.get("kwargs"):
        section["init_args"] = copy.deepcopy(model["kwargs"])
    upgraded["model"] = section
    return upgraded


def upgraded(text: str):
    """The saved config ``text`` in today's form, or None when it already is (or is no mapping)."""
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # reported by whoever reads it
    new = upgrade_tree(tree)
    return None if new is None else yaml.safe_dump(new, sort_keys=False)
