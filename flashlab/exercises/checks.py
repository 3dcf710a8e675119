"""Readable assertions for exercise tests: say what is wrong (shape, which index, by what factor), not a traceback.

Every helper raises ``AssertionError`` with a message written for a learner; the grader shows that message as the
test's output. When a test can compute what a mistake the lesson predicts would give (``known_wrong``: a
description -> that wrong answer), a wrong answer that matches one is named as that mistake.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# the mistakes the lesson warns about, as the messages name them
RESCALE_FORGOTTEN = (
    "the rescale was forgotten: when a new max arrives, the old sum and the old output must be multiplied by "
    "exp(m_old - m_new)"
)
MAX_NOT_SUBTRACTED = "the max was not subtracted: take exp(s - m), not exp(s), so the running sum is relative to m"
MASK_MISALIGNED = (
    "the causal mask is aligned top-left (key j <= query i); it must be aligned bottom-right, shifted by Nk - Nq "
    "(key j <= i + Nk - Nq)"
)


def _lesson_mistake(got, known_wrong, close) -> str:
    """`` -- this is what you get when <mistake>`` if ``got`` matches one of the known wrong answers, else ''."""
    for text, wrong in (known_wrong or {}).items():
        try:
            if close(got, wrong):
                return f" -- this is exactly what you get when {text}"
        except (TypeError, ValueError):
            continue
    return ""


def fmt(x) -> str:
    """A number as a learner would write it (4 significant digits), or a short array."""
    if isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, bool):
        x = float(x)
        if math.isfinite(x) and x != 0 and 1e-3 <= abs(x) < 1e6:
            return f"{x:.4f}".rstrip("0").rstrip(".")
        return f"{x:.4g}"
    return np.array2string(np.asarray(x), precision=4, threshold=12, edgeitems=3)


def as_number(got, what: str) -> float:
    """``got`` must be one real number (a Python or NumPy scalar, or a 0-d / one-element array)."""
    if isinstance(got, bool) or got is None:
        raise AssertionError(f"{what} should be a number; got {got!r}")
    if isinstance(got, (numbers.Real, np.floating, np.integer)):
        return float(got)
    arr = np.asarray(got) if not isinstance(got, (str, bytes, dict)) else None
    if arr is not None and arr.size == 1 and np.issubdtype(arr.dtype, np.number):
        return float(arr.reshape(()))
    raise AssertionError(f"{what} should be one number; got {type(got).__name__} {fmt(got) if arr is not None else ''}")


def unpack(got, n: int, what: str):
    """``got`` must be a tuple (or list) of ``n`` things."""
    if not isinstance(got, (tuple, list)) or len(got) != n:
        kind = f"a {type(got).__name__}" if not isinstance(got, (tuple, list)) else f"{len(got)} values"
        raise AssertionError(f"{what}: expected a tuple of {n} values; got {kind}")
    return tuple(got)


def _explain(factor: float, hints: dict[str, float] | None) -> str:
    """The explanation in ``hints`` whose factor matches ``factor``, or ''."""
    for text, f in (hints or {}).items():
        if f != 0 and math.isclose(factor, f, rel_tol=1e-3):
            return text
    return ""


def _factor_hint(got: float, want: float, hints: dict[str, float] | None) -> str:
    if want == 0 or got == 0:
        return ""
    text = _explain(got / want, hints)
    return f" -- off by a factor of {fmt(got / want)}: {text}" if text else ""


def expect_number(
    got, want: float, what: str, rel: float = 1e-6, abs_: float = 1e-12, hints=None, known_wrong=None
) -> float:
    """``got`` is one finite number close to ``want``. ``hints`` maps an explanation to a suspicious factor."""
    x = as_number(got, what)
    if math.isnan(x):
        raise AssertionError(f"{what} is NaN; expected {fmt(want)}")
    if math.isinf(want) or math.isinf(x):
        if x != want:
            raise AssertionError(f"{what}: got {fmt(x)}, expected {fmt(want)}")
        return x
    if not math.isclose(x, want, rel_tol=rel, abs_tol=abs_):
        mistake = _lesson_mistake(x, known_wrong, lambda a, b: math.isclose(a, float(b), rel_tol=rel, abs_tol=abs_))
        hint = mistake or _factor_hint(x, want, hints)
        raise AssertionError(f"{what}: got {fmt(x)}, expected {fmt(want)}{hint}")
    return x


def expect_int(got, want: int, what: str, hints=None) -> int:
    """``got`` is a whole number equal to ``want`` (an int, or a float with no fractional part)."""
    x = as_number(got, what)
    if not math.isfinite(x) or x != round(x):
        raise AssertionError(f"{what} should be a whole number of bytes/tiles; got {fmt(x)}")
    if int(round(x)) != want:
        raise AssertionError(f"{what}: got {int(round(x)):,}, expected {want:,}{_factor_hint(x, want, hints)}")
    return int(round(x))


def expect_array(
    got, want, what: str, rtol: float = 1e-6, atol: float = 1e-9, hints=None, known_wrong=None
) -> np.ndarray:
    """``got`` is an array of ``want``'s shape, finite, and close to it element by element.

    On a mismatch the message names the worst index, and, when every element is off by the same factor, that
    factor (with an explanation from ``hints`` if it matches one).
    """
    want = np.asarray(want, dtype=np.float64)
    if got is None:
        raise AssertionError(f"{what}: your function returned None; expected an array of shape {want.shape}")
    try:
        arr = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise AssertionError(f"{what}: could not read the result as an array of numbers ({e})") from None
    if arr.shape != want.shape:
        raise AssertionError(f"{what}: wrong shape {arr.shape}; expected {want.shape}")
    bad_nan = ~np.isfinite(arr) & np.isfinite(want)
    if bad_nan.any():
        idx = tuple(int(i) for i in np.argwhere(bad_nan)[0])
        raise AssertionError(
            f"{what}: {int(bad_nan.sum())} value(s) are NaN or inf, first at index {idx} -- "
            "subtract the running max before exp, and guard rows that have seen nothing yet"
        )
    with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: decided on the next line
        err = np.abs(arr - want) - (atol + rtol * np.abs(want))
    err = np.where(np.isfinite(want), err, np.where(arr == want, -1.0, 1.0))
    if (err > 0).any():
        idx = np.unravel_index(int(np.argmax(err)), err.shape)
        idx_s = str(tuple(int(i) for i in idx)) if arr.ndim else "()"
        n_bad = int((err > 0).sum())
        msg = f"{what}: {n_bad} of {arr.size} values are wrong; worst at index {idx_s}: got {fmt(arr[idx])}, "
        msg += f"expected {fmt(want[idx])}"
        mistake = _lesson_mistake(
            arr, known_wrong, lambda a, b: a.shape == np.shape(b) and np.allclose(a, b, rtol=rtol, atol=atol)
        )
        if mistake:
            raise AssertionError(msg + mistake)
        nz = (np.abs(want) > 1e-12) & np.isfinite(want)
        if nz.any():
            ratios = arr[nz] / want[nz]
            if np.allclose(ratios, ratios.flat[0], rtol=1e-4) and not np.isclose(ratios.flat[0], 1.0):
                factor = float(ratios.flat[0])
                msg += f" -- every value is off by the same factor {fmt(factor)}"
                text = _explain(factor, hints)
                msg += f": {text}" if text else ""
        raise AssertionError(msg)
    return arr


def expect_bool(got, want: bool, what: str) -> bool:
    """``got`` is a real bool (Python or NumPy) equal to ``want``."""
    if not isinstance(got, (bool, np.bool_)):
        raise AssertionError(f"{what} should be True or False; got {type(got).__name__} {got!r}")
    if bool(got) != want:
        raise AssertionError(f"{what}: got {bool(got)}, expected {want}")
    return bool(got)
