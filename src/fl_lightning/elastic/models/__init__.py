"""Model registry: ``build_model("resnet18", num_classes=100, input_shape=(3, 32, 32), width=1.0)``.

Model modules register their class with ``@register_model(name)``; the constructor signature is
``cls(num_classes, input_shape, **kwargs)`` and every keyword is a documented config option.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from fl_lightning.option_types import check_numbers, is_finite_number
from fl_lightning.errors import ConfigError

MODELS: dict[str, type] = {}


def register_model(name: str) -> Callable[[type], type]:
    """Class decorator adding a model to :data:`MODELS` under ``name``."""
    def add(cls: type) -> type:
        if name in MODELS and MODELS[name] is not cls:
            raise ValueError(f"model name {name!r} is already registered by {MODELS[name].__qualname__}")
        MODELS[name] = cls
        return cls
    return add


def model_kwargs(name: str) -> list[str]:
    """The keyword options a registered model accepts besides num_classes and input_shape."""
    params = inspect.signature(MODELS[name]).parameters
    return [p for p in params if p not in ("self", "num_classes", "input_shape")
            and params[p].kind is not inspect.Parameter.VAR_KEYWORD]


# Architecture options several models share, checked before any model is built.
_POSITIVE_INTS = ("embedding_dim", "hidden_size", "num_layers", "stem_channels", "vocab_size", "depth",
                  "num_heads", "embed_dim", "patch_size", "divisor")
_POSITIVE_NUMBERS = ("width", "width_scale")
_RATIOS = ("min_width",)
_INT_LISTS = ("channels", "stage_channels")


def check_model_kwargs(name: str, kwargs: dict) -> None:
    """Unknown options and out-of-range values of the shared options, as ConfigErrors naming
    ``model.kwargs.<option>`` (cheap: nothing is built, no data is needed)."""
    if name not in MODELS:
        raise ConfigError("model.name", f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    known = model_kwargs(name)
    for key, value in kwargs.items():
        where = f"model.kwargs.{key}"
        if key not in known:
            raise ConfigError(where, f"not an option of model {name!r}; options: {', '.join(known) or 'none'}")
        if key in _POSITIVE_INTS and not (_is_int(value) and value >= 1):
            raise ConfigError(where, f"must be an integer >= 1, got {value!r}")
        if key in _POSITIVE_NUMBERS and not (is_finite_number(value) and value > 0):
            raise ConfigError(where, f"must be a finite number > 0, got {value!r}")
        if key in _RATIOS and not (is_finite_number(value) and 0 < value <= 1):
            raise ConfigError(where, f"must be in (0, 1], got {value!r}")
        if key in _INT_LISTS and not (isinstance(value, (list, tuple)) and value
                                      and all(_is_int(v) and v >= 1 for v in value)):
            raise ConfigError(where, f"must be a non-empty list of integers >= 1, got {value!r}")
    check_numbers("model.kwargs", kwargs)
    rules = getattr(MODELS[name], "check_options", None)  # a model's cross-option rules
    if rules is not None:
        rules(**kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_model(name: str, num_classes: int, input_shape: Sequence[int], **kwargs: Any):
    """Construct a registered model, failing with a ConfigError that names the bad key."""
    check_model_kwargs(name, kwargs)
    try:
        return MODELS[name](num_classes=num_classes, input_shape=tuple(input_shape), **kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError, AssertionError) as error:  # a combination of options the constructor refuses
        raise ConfigError("model.kwargs", f"{name} cannot be built with {kwargs}: {' '.join(str(error).split())}") from None


# Model modules register themselves on import.
from fl_lightning.elastic.models import cnn, lstm, ofa_resnet, resnet, scalefl_resnet, vit  # noqa: E402,F401
