"""Numeric bounds declared once with each config option, and the checks every number gets.

A config field declares its range where it is declared (``rounds: int = bounded(50, ge=1)``);
``check_fields`` then checks every field of a section the same way: declared ranges, and for
every number, declared or not, that it is finite and that an integer stays within
``INT_LIMIT`` (past it numpy and torch overflow or try to allocate the impossible).
``check_numbers`` gives free-form values (model.kwargs, data.options, algorithm settings) the
same treatment. Cross-field rules live in ``config.validate``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from fl_lightning.errors import ConfigError

INT_LIMIT = 2**31 - 1
"""Largest integer an option may hold unless it declares another bound (counts, sizes, steps)."""


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
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a number"


def bounded(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None) -> Any:
    """A dataclass field whose value must lie in the given range (``ge``: >=, ``gt``: >, ...)."""
    span = Range(low=gt if gt is not None else ge, high=lt if lt is not None else le,
                 low_open=gt is not None, high_open=lt is not None)
    return field(default=default, metadata={"range": span})


def check_fields(prefix: str, section: Any) -> None:
    """ConfigError naming ``<prefix>.<field>`` for the first value outside its declared range or
    not a finite number within INT_LIMIT; nested sections are checked under their own prefix."""
    for f in dataclasses.fields(section):
        key, value = f"{prefix}.{f.name}", getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(key, value)
            continue
        span = f.metadata.get("range")
        if span is not None and is_number(value):
            is_float = isinstance(value, float) or isinstance(f.default, float) or "float" in str(f.type)
            finite = "a finite number " if is_float else ""
            nullable = " or null" if "Optional" in str(f.type) else ""
            if not math.isfinite(value) or not span.holds(value):
                raise ConfigError(key, f"must be {finite}{span.words()}{nullable}, got {value!r}")
        check_numbers(key, value)


def check_numbers(key: str, value: Any, int_limit: int = INT_LIMIT) -> None:
    """Every number in ``value`` (through lists and mappings) is finite and every integer lies in
    [-int_limit, int_limit]; ConfigError naming the key (``model.kwargs.width``) otherwise."""
    if isinstance(value, dict):
        for name, item in value.items():
            check_numbers(f"{key}.{name}", item, int_limit)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_numbers(f"{key}[{i}]" if len(value) > 1 else key, item, int_limit)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > int_limit:
        raise ConfigError(key, f"{value} is out of range (at most {int_limit:,} in size)")


def is_number(value: Any) -> bool:
    """An int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A number that is neither infinite nor NaN."""
    return is_number(value) and math.isfinite(value)
