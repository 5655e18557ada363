"""Type and range checks of option fields (SamplingParams, ExecutorConfig).

A value is refused where it is given, with a message naming the field, what it accepts and what it got,
so that nothing malformed reaches the step loop (where it would fail every request in flight). The rules:
integer fields take Python or numpy integers, not bools and not floats (``2.0`` is refused: a float
where an integer belongs is usually a computation gone wrong); number fields take finite ints or floats,
not bools; flags take ``True``/``False`` only. Accepted values come back as plain ``int``/``float``/``bool``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

SEED_RANGE = (0, 2**64 - 1)   # what a 64-bit generator seed holds (torch.Generator.manual_seed)


def is_integer(value: Any) -> bool:
    """A Python or numpy integer (bools are not integers here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _got(value: Any) -> str:
    text = repr(value)
    return f"got {text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        if (lo, hi) == SEED_RANGE:
            return " in [0, 2**64)"
        return f" in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    return ""


class FieldChecks:
    """Collects every problem of one object's fields, so the error lists them all at once."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def integer(self, name: str, value: Any, lo: int | None = None, hi: int | None = None,
                optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if is_integer(value) and (lo is None or value >= lo) and (hi is None or value <= hi):
            return int(value)
        self.problems.append(f"{name} must be an integer{_bounds(lo, hi)}{' or None' if optional else ''}, "
                             f"{_got(value)}")
        return value

    def number(self, name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
               lo_open: bool = False, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
            v = float(value)
            if math.isfinite(v) and (lo is None or v > lo or (v == lo and not lo_open)) and (hi is None or v <= hi):
                return v
        self.problems.append(f"{name} must be a finite number{_bounds(lo, hi, lo_open)}"
                             f"{' or None' if optional else ''}, {_got(value)}")
        return value

    def flag(self, name: str, value: Any) -> Any:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        self.problems.append(f"{name} must be True or False, {_got(value)}")
        return value

    def choice(self, name: str, value: Any, choices: tuple[str, ...]) -> Any:
        if not (isinstance(value, str) and value in choices):
            self.problems.append(f"{name} must be one of {list(choices)}, {_got(value)}")
        return value
