"""Exercise for notebook 08 (exactness): a tolerance-based comparison that accepts reordered sums and catches bugs.

FlashAttention computes the same function as the naive version, not the same bits: it adds in a different order,
so results differ in the last places. The lesson's fp16 example: (1000 + 0.2) + 0.2 is 1000.0, but
1000 + (0.2 + 0.2) is 1000.5 (the spacing of fp16 numbers near 1000 is 0.5).
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises._checks import expect_bool

EXERCISES = [
    Exercise(
        id="08.close_enough",
        title="a tolerance-based comparison: passes reordered sums, fails a real bug",
        signature="actual, expected, dtype",
        doc="""
        Decide whether `actual`, computed in `dtype`, equals the float64 `expected` up to rounding.

        actual    array computed in dtype (bfloat16 values arrive in a float32 array; NumPy has no bfloat16)
        expected  float64 array, the reference
        dtype     "float16", "bfloat16", "float32" or "float64"

        Returns True or False (never raises): True when every element of actual is within a few units in the
        last place of dtype of expected (relative to |expected|; machine epsilon is 2**-10 for float16,
        2**-7 for bfloat16, 2**-23 for float32, 2**-52 for float64), False otherwise -- and False for a shape
        mismatch or any NaN. The tests: differences of up to 2 units in the last place (a sum added in another
        order) must compare equal; an error of 5 % or more in any one element (a real bug) must not; and
        float32 must be stricter than float16.
        """,
    ),
]

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def to_bfloat16(x) -> np.ndarray:
    """Round to the nearest bfloat16 (ties to even), returned in a float32 array."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def in_dtype(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and held in the array type a learner's function receives."""
    if dtype == "bfloat16":
        return to_bfloat16(x)
    return np.asarray(x, dtype=np.float64).astype(dtype)


def _expected(rng, shape):
    return rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-2, 2, shape)


def _reordered(rng, expected, dtype):
    """What a different summation order gives: the true value nudged by up to one epsilon, then rounded."""
    u = rng.uniform(-1, 1, expected.shape) * EPS[dtype]
    return in_dtype(expected * (1 + u), dtype)


@graded("08.close_enough", 1)
def test_close_lesson_fp16(answer):
    """the lesson's fp16 sums: both orders of 1000 + 0.2 + 0.2 are equal to 1000.4 up to fp16 rounding"""
    h = np.float16
    left = np.array([(h(1000) + h(0.2)) + h(0.2)])  # 1000.0
    right = np.array([h(1000) + (h(0.2) + h(0.2))])  # 1000.5
    assert left[0] != right[0], "the lesson's two fp16 sums should differ"
    expected = np.array([1000.4])
    expect_bool(answer(left, expected.copy(), "float16"), True, "close_enough((1000 + 0.2) + 0.2 in fp16, 1000.4)")
    expect_bool(answer(right, expected.copy(), "float16"), True, "close_enough(1000 + (0.2 + 0.2) in fp16, 1000.4)")


@graded("08.close_enough", 2)
def test_close_reordered(answer):
    """fresh random results that differ only by summation order pass, in every dtype"""
    rng = np.random.default_rng()
    for dtype in EPS:
        shape = (int(rng.integers(3, 40)), int(rng.integers(3, 40)))
        expected = _expected(rng, shape)
        actual = _reordered(rng, expected, dtype)
        got = answer(actual, expected.copy(), dtype)
        expect_bool(got, True, f"close_enough for a reordered {dtype} result of shape {shape}")


@graded("08.close_enough", 2)
def test_close_bug_missing_rescale(answer):
    """a kernel that forgot the rescale on some rows (off by e^(m_old - m_new)) fails, in every dtype"""
    rng = np.random.default_rng()
    for dtype in EPS:
        expected = _expected(rng, (int(rng.integers(4, 30)), 8))
        buggy = expected.copy()
        rows = rng.choice(expected.shape[0], size=2, replace=False)
        buggy[rows] *= np.exp(-rng.uniform(0.1, 2.0))
        expect_bool(answer(in_dtype(buggy, dtype), expected.copy(), dtype), False, f"close_enough for a {dtype} bug")


@graded("08.close_enough", 2)
def test_close_one_bad_element(answer):
    """one element off by 5 % among a thousand is a bug: look at the worst element, not the average"""
    rng = np.random.default_rng()
    for dtype in EPS:
        expected = _expected(rng, (1000,))
        actual = _reordered(rng, expected, dtype).astype(np.float64)
        i = int(rng.integers(0, 1000))
        actual[i] = expected[i] * (1.05 if dtype != "bfloat16" else 1.1)
        got = answer(in_dtype(actual, dtype), expected.copy(), dtype)
        expect_bool(got, False, f"close_enough for {dtype} with element {i} off by 5 %")


@graded("08.close_enough", 1)
def test_close_stricter_for_fp32(answer):
    """an error of 1e-3 is rounding in float16 but a bug in float32 and float64"""
    rng = np.random.default_rng()
    expected = _expected(rng, (50,))
    off = expected * (1 + 1e-3)
    expect_bool(answer(off.astype(np.float32), expected.copy(), "float32"), False, "float32 result off by 1e-3")
    expect_bool(answer(off, expected.copy(), "float64"), False, "float64 result off by 1e-3")


@graded("08.close_enough", 1)
def test_close_nan_and_shape(answer):
    """a NaN anywhere, or a result of the wrong shape, is not close (and does not raise)"""
    rng = np.random.default_rng()
    expected = _expected(rng, (6, 5))
    actual = expected.astype(np.float32)
    actual[int(rng.integers(0, 6)), int(rng.integers(0, 5))] = np.nan
    expect_bool(answer(actual, expected.copy(), "float32"), False, "close_enough with a NaN in the result")
    try:
        got = answer(expected[:, :4].astype(np.float32), expected.copy(), "float32")
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"a shape mismatch should give False; your function raised {type(e).__name__}") from None
    expect_bool(got, False, "close_enough for shapes (6, 4) vs (6, 5)")
