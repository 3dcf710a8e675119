"""Argument checks shared by every layer: a bad argument is a clear error naming it, never a wrong answer."""

from __future__ import annotations

import math
import numbers


def check_positive_int(what: str, value) -> None:
    """TypeError unless ``value`` is an integer (Python or NumPy; not a bool), ValueError unless it is >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1; got {value!r}")


def check_positive(what: str, value) -> None:
    """TypeError unless ``value`` is a real number (not a bool), ValueError unless it is positive and finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number; got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be positive and finite; got {value!r}")
