"""Option types that carry their range: ``rounds: PositiveInt = 50``.

Every numeric option (config sections, algorithm settings, command arguments) is annotated with
one of these types. jsonargparse checks each value against its type while it parses a YAML file
or the command line, so ``--help`` shows the range (``type: int >= 1``) and a bad value stops
the command before any work, with one message naming the range. Besides its declared range,
every number must be finite, every integer lie within ``INT_LIMIT`` (past it numpy and torch
overflow or try to allocate the impossible) and every float within ``FLOAT_LIMIT``. A parsed
value is a plain ``int`` or ``float``.

``check_numbers`` gives free-form mappings (``model``) the same
finiteness and size checks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

from jsonargparse.typing import register_type

from fl_lightning.errors import ConfigError

INT_LIMIT = 2**31 - 1
"""Largest integer an option may hold unless its type declares an upper bound (counts, sizes, steps)."""
FLOAT_LIMIT = 3.4028234663852886e38
"""Largest float an option may hold (``torch.finfo(torch.float32).max``): options meet float32
tensors (a learning rate past it cannot even be converted for the optimizer's step)."""


@dataclass(frozen=True)
class Range:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def words(self) -> str:
        low, high = _figure(self.low), _figure(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {high}"
        return ""


def _figure(value) -> str:
    """A bound as written: 1, 0.5, 2**63 for the seed's."""
    if isinstance(value, int) and value >= 2**32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


@functools.lru_cache(maxsize=None)  # one type per (base, range): jsonargparse registers each once
def number_type(base: type, ge=None, gt=None, le=None, lt=None) -> type:
    """The option type of an ``int`` or ``float`` within a range (``ge``: >=, ``gt``: >, ``le``:
    <=, ``lt``: <); it is named by what it accepts, e.g. ``int >= 1`` or ``float in [0, 1)``."""
    if base not in (int, float):
        raise TypeError(f"number_type takes int or float, not {base!r}")
    span = Range(low=gt if gt is not None else ge, high=lt if lt is not None else le,
                 low_open=gt is not None, high_open=lt is not None)
    name = f"{base.__name__} {span.words()}".strip()
    wanted = ("an integer" if base is int else "a finite number") + (f" {span.words()}" if span.words() else "")
    marker = _Named(name, (), {"__doc__": f"An {name}.", "__module__": __name__, "wanted": wanted})
    register_type(marker, serializer=_same, deserializer=functools.partial(parse_number, base, span, wanted),
                  type_check=_never)  # every value passes through parse_number, which is idempotent
    return marker


class _Named(type):
    """A type that prints as its name (``int >= 1``), as ``--help`` shows it."""

    def __repr__(cls) -> str:
        return cls.__name__


def _same(value):
    return value


def _never(value, marker) -> bool:
    return False


class OutOfRange(ValueError):
    """A value its number type refuses; the message is the whole reason."""


def parse_number(base: type, span: Range, wanted: str, value: Any):
    """``value`` (a number, or its text from the command line) as a plain ``base``; OutOfRange
    with the whole reason otherwise: ``must be {wanted}, got 0``."""
    number = _as_number(base, value)
    if number is None or (base is float and not math.isfinite(number)) or not span.holds(number):
        raise OutOfRange(f"must be {wanted}, got {_given(value)}")
    if base is int and span.high is None and abs(number) > INT_LIMIT:
        raise OutOfRange(f"must be {wanted} (at most {INT_LIMIT:,} in size), got {_given(value)}")
    if base is float and abs(number) > FLOAT_LIMIT:
        raise OutOfRange(f"must be {wanted} (at most {FLOAT_LIMIT:.4g} in size, float32's largest), "
                         f"got {_given(value)}")
    return number


def _given(value: Any) -> str:
    """A refused value as the user typed it: numbers bare, anything else quoted."""
    return value if isinstance(value, str) and _as_number(float, value) is not None else repr(value)


def _as_number(base: type, value: Any):
    """``value`` converted to ``base``, or None when it is not one (booleans, fractions for an int,
    text that is not a number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = int(value) if base is int else float(value)
        except (ValueError, OverflowError):
            return None
    if base is int:
        return value if isinstance(value, int) else None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:
            return None
    return None


# The ranges options use most, named as jsonargparse names its own.
FiniteFloat = number_type(float)
PositiveInt = number_type(int, ge=1)
NonNegativeInt = number_type(int, ge=0)
PositiveFloat = number_type(float, gt=0)
NonNegativeFloat = number_type(float, ge=0)
ClosedUnitInterval = number_type(float, ge=0, le=1)
UnitFraction = number_type(float, gt=0, le=1)
"""A fraction in (0, 1]: widths, rates, shares of a model or a budget."""
MAX_MULTIPLIER = 1024
WidthMultiplier = number_type(float, gt=0, le=MAX_MULTIPLIER)
"""A factor on a model's widths (``model.width``, ``width_scale``, ViT's ``mlp_ratio``). A model
grows with its square: 1024 times the widths of the smallest model here (0.09M parameters)
would hold about 10^11 parameters, past any machine; a larger factor overflows the channel
counts before the memory check could name it."""


def check_numbers(key: str, value: Any, int_limit: int = INT_LIMIT) -> None:
    """Every number in ``value`` (through lists and mappings) is finite and every integer lies in
    [-int_limit, int_limit]; ConfigError naming the key (``model.width``) otherwise."""
    if isinstance(value, dict):
        for name, item in value.items():
            check_numbers(f"{key}.{name}", item, int_limit)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_numbers(f"{key}[{i}]" if len(value) > 1 else key, item, int_limit)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    elif isinstance(value, float) and abs(value) > FLOAT_LIMIT:
        raise ConfigError(key, f"{value!r} is out of range (at most {FLOAT_LIMIT:.4g} in size, float32's largest)")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > int_limit:
        raise ConfigError(key, f"{value} is out of range (at most {int_limit:,} in size)")

