"""Subnet specifications: frozen dataclasses naming one operating point of an elastic model.

A spec is hashable (it keys MAC memoization and per-spec state) and ordered coordinate-wise:
``spec_le(a, b)`` means every field of ``a`` is at most the same field of ``b``, so the
subnet of ``a`` is nested inside the subnet of ``b`` for leading-slice models.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Type, TypeVar

S = TypeVar("S")


def _le(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_le(x, y) for x, y in zip(a, b))
    return a <= b


def spec_le(a: Any, b: Any) -> bool:
    """Coordinate-wise ``a <= b`` over every field (tuples element-wise); a partial order."""
    if type(a) is not type(b):
        raise TypeError(f"cannot compare {type(a).__name__} with {type(b).__name__}")
    return all(_le(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


def spec_to_dict(spec: Any) -> dict:
    """Plain values (tuples as lists) for logs, checkpoints and YAML."""
    def plain(value):
        return [plain(v) for v in value] if isinstance(value, (tuple, list)) else value
    return {f.name: plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def spec_from_dict(spec_type: Type[S], values: Mapping[str, Any]) -> S:
    """Inverse of :func:`spec_to_dict` (lists become tuples so the spec stays hashable)."""
    def frozen(value):
        return tuple(frozen(v) for v in value) if isinstance(value, (tuple, list)) else value
    return spec_type(**{k: frozen(v) for k, v in values.items()})


def scale_channels(channels: int, ratio: float) -> int:
    """Active channels for a width ratio: ``ceil(ratio * channels)``, at least 1 (HeteroFL)."""
    return max(1, math.ceil(ratio * channels - 1e-9))  # tolerance: 0.1 * 30 must give 3, not 4


@dataclass(frozen=True)
class WidthSpec:
    """Width ratio in (0, 1] for each stage of a width-elastic model (HeteroFL, FjORD, FedRolex).

    One ratio per stage; ``WidthSpec.uniform(0.25, n)`` is the usual single-multiplier client.
    """

    widths: tuple[float, ...]

    def __post_init__(self):
        widths = tuple(float(w) for w in self.widths)
        if not widths or any(not 0.0 < w <= 1.0 for w in widths):
            raise ValueError(f"width ratios must lie in (0, 1], got {self.widths}")
        object.__setattr__(self, "widths", widths)

    @classmethod
    def uniform(cls, width: float, num_stages: int) -> "WidthSpec":
        return cls((width,) * num_stages)

    def __str__(self) -> str:
        if len(set(self.widths)) == 1:
            return f"width={self.widths[0]:g}"
        return "widths=(" + ",".join(f"{w:g}" for w in self.widths) + ")"


