"""Argument checks shared by every layer: a bad argument is a clear error naming it, never a wrong answer.

The ``as_*`` functions check and convert in one step: they return a plain Python ``int`` or ``float``, whatever
number type came in (Python, NumPy ``int32``/``int64``/``float32``...). Computing with the converted value keeps
the arithmetic exact: NumPy integers wrap around silently (``np.int32(8192) ** 3 == 0``), Python integers do not.
"""

from __future__ import annotations

import math
import numbers


def as_positive_int(what: str, value) -> int:
    """``value`` as a Python int. TypeError unless it is an integer (Python or NumPy; not a bool), ValueError
    unless it is >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer; got {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{what} must be at least 1; got {value!r}")
    return value


def as_real(what: str, value) -> float:
    """``value`` as a finite Python float. TypeError unless it is a real number (Python or NumPy; not a bool),
    ValueError if it is NaN, infinite, or too large for a float (``10**400``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number; got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large for a floating-point number; got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite; got {value!r}")
    return x


def as_positive(what: str, value) -> int | float:
    """``value`` as a Python int (if it is an integer) or float, checked to be a positive, finite real number.

    TypeError unless it is a real number (not a bool), ValueError unless it is positive and finite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number; got {value!r}")
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise ValueError(f"{what} must be positive and finite; got {value!r}")
        return int(value)
    try:
        x = float(value)
    except OverflowError:  # pragma: no cover - a Real that is neither int nor float-sized
        raise ValueError(f"{what} is too large for a floating-point number; got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{what} must be positive and finite; got {value!r}")
    return x


def as_fraction(what: str, value) -> float:
    """``value`` as a Python float in [0, 1]. TypeError unless it is a real number, ValueError outside [0, 1]."""
    x = as_real(what, value)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{what} is a fraction, 0 <= {what} <= 1; got {value!r}")
    return x


def as_count(what: str, value) -> int:
    """``value`` as a Python int >= 1 (a block size, a length, a batch), or a ValueError naming ``what`` -- for a
    bool, a float or anything else that is not a positive integer alike."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive int; got {value!r}")
    return int(value)


def check_positive_int(what: str, value) -> None:
    """TypeError unless ``value`` is an integer (Python or NumPy; not a bool), ValueError unless it is >= 1.
    (``as_positive_int`` also returns it as a Python int.)"""
    as_positive_int(what, value)


def check_positive(what: str, value) -> None:
    """TypeError unless ``value`` is a real number (not a bool), ValueError unless it is positive and finite.
    (``as_positive`` also returns it as a Python number.)"""
    as_positive(what, value)
