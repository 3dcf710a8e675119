"""Numbers of any size in the calculators: exact arithmetic, floats only where a result is one.

Byte and FLOP counts are Python ints, exact at any size (``10**400`` tokens included). A fractional byte size (0.5 B
for a 4-bit cache) enters the arithmetic as the exact fraction it equals (``exact``), so a count times it stays
exact too. Results that are floats -- seconds, rates, ratios -- are rounded once at the end (``as_float``), and a
value past the largest float is a ValueError naming the argument and the limit, never an OverflowError.
"""

from __future__ import annotations

import math
import numbers
import sys
from decimal import Decimal
from fractions import Fraction

FLOAT_MAX = sys.float_info.max  # the largest float, about 1.8e308


def exact(value) -> Fraction:
    """A real number (int, float, NumPy scalar) as the exact fraction it equals."""
    return Fraction(value)


def brief(value) -> str:
    """A number of any size in a few characters: 10**400 -> '1.000e+400', 0.5 -> '0.5'."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            value = value.numerator
        else:
            return f"{Decimal(value.numerator) / Decimal(value.denominator):.4g}"
    if isinstance(value, numbers.Integral) and abs(int(value)) >= 10**16:
        return f"{Decimal(int(value)):.3e}"
    return repr(value)


def as_float(what: str, value) -> float:
    """``value`` (a real number or a fraction of any size) as a finite float. TypeError unless it is a real number
    (not a bool); ValueError naming ``what`` if it is NaN, infinite or more than ``FLOAT_MAX``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number; got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf if value > 0 else -math.inf
    if math.isnan(x):
        raise ValueError(f"{what} must be a number, not NaN")
    if math.isinf(x):
        raise ValueError(f"{what} must be finite and at most {FLOAT_MAX:.3g} (the largest float); got {brief(value)}")
    return x


def as_size(value):
    """A byte count computed exactly: an int if it is whole (exact at any size), else a float."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return int(value)
        return as_float("the byte count", value)
    if isinstance(value, numbers.Integral):
        return int(value)
    return int(value) if float(value).is_integer() else value
