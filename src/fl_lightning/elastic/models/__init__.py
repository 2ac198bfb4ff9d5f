"""The models, chosen in a config by ``class_path`` and ``init_args`` like algorithms::

    model:
      class_path: fl_lightning.elastic.models.ResNet18
      init_args: {width: 0.125}

Each model is an :class:`~fl_lightning.elastic.models.base.ElasticModel` whose constructor is
``cls(num_classes, input_shape, **options)``: the dataset gives the first two, and every typed,
documented keyword is a config option (``--model.help ResNet18`` lists them). The classes are
imported on first use, so that reading options (``--help``) does not import timm.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence, Union

from fl_lightning.errors import ConfigError

# Class name -> module, for ``fl_lightning.elastic.models.<Class>`` without importing them all.
_MODULES = {"CNN": "cnn", "CharLSTM": "lstm", "OFAResNet": "ofa_resnet", "ResNet18": "resnet",
            "ScaleFLResNet18": "scalefl_resnet", "ViT": "vit"}
__all__ = sorted(_MODULES) + ["build_model", "check_model", "model_class"]

# Constructor arguments that are not options: the dataset's, and those that build a client's
# reduced copy of a model (``extract``).
NOT_OPTIONS = frozenset({"num_classes", "input_shape", "elastic", "max_widths", "max_width", "max_depth"})
KEY = "model"


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_class(model: Union[type, str, Mapping, Any]) -> type:
    """The class of a model given as a class, a class path or a ``{class_path, init_args}``
    section (a mapping or a parsed namespace)."""
    from fl_lightning.elastic.models.base import ElasticModel

    if isinstance(model, type):
        found = model
    else:
        path = model if isinstance(model, str) else _section(model)[0]
        module, _, name = path.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(KEY, f"cannot import {path!r}; models: "
                              + ", ".join(f"{__name__}.{c}" for c in sorted(_MODULES))) from None
    if not (isinstance(found, type) and issubclass(found, ElasticModel)):
        raise ConfigError(KEY, f"{found!r} is not an ElasticModel")
    return found


def _section(model) -> tuple:
    """``(class_path, init_args)`` of a mapping or namespace section."""
    get = model.get if isinstance(model, Mapping) else (lambda key, default=None: getattr(model, key, default))
    init_args = get("init_args") or {}
    if not isinstance(init_args, Mapping):
        init_args = vars(init_args)  # a jsonargparse Namespace
    return get("class_path"), dict(init_args)


def model_options(model) -> dict:
    """The options (``init_args``) of a model section; none for a bare class or path."""
    return {} if isinstance(model, (type, str)) else _section(model)[1]


def check_model(model) -> None:
    """The class imports and its cross-option rules hold (each option's own range is its type's,
    checked while parsing); ConfigError naming ``model.<option>``. Builds nothing."""
    _check_rules(model_class(model), model_options(model))


def _check_rules(cls: type, options: dict) -> None:
    rules = getattr(cls, "check_options", None)  # a model's cross-option rules
    if rules is not None:
        rules(**options)


def build_model(model, num_classes: int, input_shape: Sequence[int], **options: Any):
    """The model of section ``model`` (or class / class path ``model`` with ``options``) for
    ``num_classes`` outputs and inputs of ``input_shape``; a constructor's refusal is a
    ConfigError under ``model``."""
    cls = model_class(model)
    options = {**model_options(model), **options}
    _check_rules(cls, options)
    try:
        return cls(num_classes=num_classes, input_shape=tuple(input_shape), **options)
    except ConfigError:
        raise
    except (TypeError, ValueError, AssertionError, OverflowError, RuntimeError) as error:
        # a combination of options the constructor refuses, or sizes past what a tensor can hold
        if isinstance(error, RuntimeError) and "overflow" not in str(error).lower():
            raise
        raise ConfigError(KEY, f"{cls.__name__} cannot be built with {options}: "
                          f"{' '.join(str(error).split())}") from None
