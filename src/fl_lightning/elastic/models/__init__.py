"""Model registry: ``build_model("resnet18", num_classes=100, input_shape=(3, 32, 32), width=1.0)``.

Model modules register their class with ``@register_model(name)``; the constructor signature is
``cls(num_classes, input_shape, **kwargs)`` and every keyword is a documented config option.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

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


def build_model(name: str, num_classes: int, input_shape: Sequence[int], **kwargs: Any):
    """Construct a registered model, failing with a ConfigError that names the bad key."""
    if name not in MODELS:
        raise ConfigError("model.name", f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    known = model_kwargs(name)
    for key in kwargs:
        if key not in known:
            raise ConfigError(f"model.kwargs.{key}",
                              f"not an option of model {name!r}; options: {', '.join(known) or 'none'}")
    return MODELS[name](num_classes=num_classes, input_shape=tuple(input_shape), **kwargs)


# Model modules register themselves on import.
from fl_lightning.elastic.models import cnn, lstm, ofa_resnet, resnet, vit  # noqa: E402,F401
