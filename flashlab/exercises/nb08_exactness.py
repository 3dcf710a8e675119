"""Exercise for notebook 08 (exactness): a comparison that accepts rounding and catches a single broken element.

FlashAttention computes the same function as the naive version, not the same bits: it adds in a different order,
so results differ in the last places. The lesson's fp16 example: (1000 + 0.2) + 0.2 is 1000.0, but
1000 + (0.2 + 0.2) is 1000.5 (the spacing of fp16 numbers near 1000 is 0.5). A norm-wise relative error
||a - e|| / ||e|| accepts such differences, but on its own it also accepts one broken element among many: the
element's error is divided by the norm of the whole output. A sound comparison checks every element, against a
tolerance relative to that element with a floor set by the output's overall size (an output near zero moves by a
rounding step of the numbers it was summed from, not of itself). Every test below mixes results that must compare
equal with results that must not, so neither a constant answer nor a dtype-blind ``np.allclose`` earns points.
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_bool

EXERCISES = [
    Exercise(
        id="08.close_enough",
        title="a tolerance-based comparison: passes reordered sums, fails a real bug",
        signature="actual, expected, dtype",
        doc="""
        Decide whether `actual`, computed in `dtype`, equals the float64 `expected` up to rounding.

        actual    array computed in dtype (bfloat16 values arrive in a float32 array; NumPy has no bfloat16)
        expected  float64 array, the reference
        dtype     "float16", "bfloat16", "float32" or "float64"; its machine epsilon eps is 2**-10, 2**-7,
                  2**-23, 2**-52

        Returns True or False (never raises). False for a shape mismatch or any NaN. Otherwise True exactly when
        EVERY element satisfies |actual - expected| <= 4 * eps * |expected| + eps * rms, where rms is the
        root-mean-square size of expected: a few units in the last place of the element itself, with a floor
        of one unit at the output's typical size, so an element near zero may move by one rounding step of the
        numbers it was summed from. Checking only the norm-wise error ||actual - expected|| / ||expected|| is
        not enough: one element off by 5 % among a thousand barely moves it.
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


def _near_zero(rng, dtype):
    """An output with elements near zero, each moved by up to half a rounding step at the output's size."""
    expected = _expected(rng, (40,))
    expected[::4] *= 1e-4  # a quarter of the elements are tiny
    rms = float(np.sqrt(np.mean(expected**2)))
    return in_dtype(expected + rng.uniform(-0.5, 0.5, expected.shape) * EPS[dtype] * rms, dtype), expected


def _broken_one(rng, dtype, n=1000):
    """A reordered result with one element (of size about 1) off by 5 % (10 % in bfloat16)."""
    expected = _expected(rng, (n,))
    actual = _reordered(rng, expected, dtype).astype(np.float64)
    i = int(np.argmin(np.abs(np.abs(expected) - 1.0)))
    actual[i] = expected[i] * (1.1 if dtype == "bfloat16" else 1.05)
    return in_dtype(actual, dtype), expected, i


def _same(answer, actual, expected, dtype, what):
    expect_bool(answer(actual, expected.copy(), dtype), True, f"{what} (rounding only: should compare equal)")


def _differs(answer, actual, expected, dtype, what):
    expect_bool(answer(actual, expected.copy(), dtype), False, f"{what} (a real error: should not compare equal)")


@graded("08.close_enough", 1)
def test_close_lesson_fp16(answer):
    """the lesson's fp16 sums: both orders of 1000 + 0.2 + 0.2 equal 1000.4 up to fp16 rounding; 1100 does not"""
    h = np.float16
    left = np.array([(h(1000) + h(0.2)) + h(0.2)])  # 1000.0
    right = np.array([h(1000) + (h(0.2) + h(0.2))])  # 1000.5
    assert left[0] != right[0], "the lesson's two fp16 sums should differ"
    expected = np.array([1000.4])
    _same(answer, left, expected, "float16", "close_enough((1000 + 0.2) + 0.2 in fp16, 1000.4)")
    _same(answer, right, expected, "float16", "close_enough(1000 + (0.2 + 0.2) in fp16, 1000.4)")
    _differs(answer, np.array([h(1100)]), expected, "float16", "close_enough(1100 in fp16, 1000.4)")


@graded("08.close_enough", 2)
def test_close_reordered(answer):
    """fresh random results that differ only by summation order pass, in every dtype; a 5 % error does not"""
    rng = np.random.default_rng()
    for dtype in EPS:
        shape = (int(rng.integers(3, 40)), int(rng.integers(3, 40)))
        expected = _expected(rng, shape)
        _same(answer, _reordered(rng, expected, dtype), expected, dtype, f"a reordered {dtype} result of shape {shape}")
    actual, expected, i = _broken_one(rng, "float16", 50)
    _differs(answer, actual, expected, "float16", f"a float16 result with element {i} off by 5 %")


@graded("08.close_enough", 2)
def test_close_bug_missing_rescale(answer):
    """a kernel that forgot the rescale on some rows (off by e^(m_old - m_new)) fails, in every dtype"""
    rng = np.random.default_rng()
    for dtype in EPS:
        expected = _expected(rng, (int(rng.integers(4, 30)), 8))
        buggy = expected.copy()
        rows = rng.choice(expected.shape[0], size=2, replace=False)
        buggy[rows] *= np.exp(-rng.uniform(0.1, 2.0))
        _differs(answer, in_dtype(buggy, dtype), expected, dtype, f"a {dtype} result with two rows not rescaled")
        if dtype in ("float16", "bfloat16"):
            _same(answer, _reordered(rng, expected, dtype), expected, dtype, f"the same {dtype} result, reordered")


@graded("08.close_enough", 2)
def test_close_one_bad_element(answer):
    """one element off by 5 % among a thousand is a bug the norm-wise error hides: check every element"""
    rng = np.random.default_rng()
    for dtype in EPS:
        actual, expected, i = _broken_one(rng, dtype)
        norm = np.linalg.norm(actual.astype(np.float64) - expected) / np.linalg.norm(expected)
        _differs(
            answer, actual, expected, dtype, f"{dtype}, element {i} of 1000 off by 5 % (norm-wise error {norm:.1e})"
        )
    expected = _expected(rng, (1000,))
    _same(answer, _reordered(rng, expected, "bfloat16"), expected, "bfloat16", "a reordered bfloat16 result")


@graded("08.close_enough", 1)
def test_close_stricter_for_fp32(answer):
    """an error of 1e-3 is a bug in float32 and float64; an error of 1e-4 is within float16's rounding"""
    rng = np.random.default_rng()
    expected = _expected(rng, (50,))
    _differs(answer, (expected * (1 + 1e-3)).astype(np.float32), expected, "float32", "float32 result off by 1e-3")
    _differs(answer, expected * (1 + 1e-3), expected, "float64", "float64 result off by 1e-3")
    _same(answer, in_dtype(expected * (1 + 1e-4), "float16"), expected, "float16", "float16 result off by 1e-4")


@graded("08.close_enough", 1)
def test_close_nan_shape_and_near_zero(answer):
    """a NaN, or the wrong shape, is not close (and does not raise); elements near zero use the output's scale"""
    rng = np.random.default_rng()
    expected = _expected(rng, (6, 5))
    actual = expected.astype(np.float32)
    actual[int(rng.integers(0, 6)), int(rng.integers(0, 5))] = np.nan
    _differs(answer, actual, expected, "float32", "close_enough with a NaN in the result")
    try:
        got = answer(expected[:, :4].astype(np.float32), expected.copy(), "float32")
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"a shape mismatch should give False; your function raised {type(e).__name__}") from None
    expect_bool(got, False, "close_enough for shapes (6, 4) vs (6, 5)")
    near, expected = _near_zero(rng, "float16")
    _same(answer, near, expected, "float16", "a float16 result whose elements near zero moved by a rounding step")
