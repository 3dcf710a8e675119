"""Exercises for notebook 01 (online softmax by hand): one block's update, then the streaming output.

The lesson's example is one row of four scores [2, 1 | 3, 0] seen in blocks of two, with values V = [1, 2, 3, 4]:
l = 1.368 after block 1, rescale 0.368 when 3 arrives, l = 1.553, output 2.471.
"""

from __future__ import annotations

import math

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises._checks import expect_array, expect_number, unpack
from flashlab.reference import softmax

EXERCISES = [
    Exercise(
        id="01.online_softmax_update",
        title="the online-softmax update for one new block",
        signature="m, l, block",
        doc="""
        Fold one new block of scores into the running statistics of a row.

        m      float        running max of every score seen so far (-inf before the first block)
        l      float        running sum of exp(s - m) over every score seen so far (0.0 before the first block)
        block  (b,) array   the new block's scores (do not change it in place)

        Returns (m_new, l_new, rescale), three floats:
        m_new    the new running max
        rescale  exp(m - m_new), the factor that brings the old sum to the new max (1.0 on the first block,
                 when nothing has been seen yet)
        l_new    the old sum times rescale, plus the new block's exp(s - m_new)

        The lesson's block 2: online_softmax_update(2.0, 1.368, [3, 0]) gives m_new = 3, rescale 0.368,
        l_new 1.553. Use NumPy; calling flashlab's own implementation scores 0.
        """,
    ),
    Exercise(
        id="01.streaming_attention",
        title="one query's output, streamed block by block with the rescale",
        signature="scores, values, block_size",
        doc="""
        One query's attention output, seeing the keys block_size at a time (the last block may be shorter).

        scores      (n,) array        the query's scores against n keys
        values      (n,) or (n, dv)   one value (a number, or a vector of dv numbers) per key
        block_size  int >= 1

        Returns sum_j softmax(scores)_j * values_j: a float for (n,) values, a (dv,) array for (n, dv) values.
        Keep only a running max, a running sum and a running un-normalised output; when a new max arrives,
        rescale the old sum AND the old output by exp(m_old - m_new), and divide by the sum at the end.
        The lesson's example: scores [2, 1, 3, 0], values [1, 2, 3, 4], block_size 2 gives 2.471.
        Use NumPy; calling flashlab's own implementation scores 0. Do not change the inputs in place.
        """,
    ),
]

RESCALE_HINT = {"the old sum (or output) was not rescaled by exp(m_old - m_new) when a new max arrived": math.e}


def _fold(answer, row, block_size):
    """Run ``answer`` over ``row`` block by block; return the final (m, l) and every step's rescale."""
    m, l, rescales = -math.inf, 0.0, []
    for start in range(0, len(row), block_size):
        out = unpack(answer(m, l, row[start : start + block_size].copy()), 3, "online_softmax_update(...)")
        m, l, r = (float(np.asarray(x)) for x in out)
        rescales.append(r)
    return m, l, rescales


@graded("01.online_softmax_update", 1)
def test_update_lesson_block_1(answer):
    """the lesson's block 1: [2, 1] from nothing gives m = 2, l = 1.368, rescale 1.0"""
    m, l, r = unpack(answer(-math.inf, 0.0, np.array([2.0, 1.0])), 3, "online_softmax_update(-inf, 0, [2, 1])")
    expect_number(m, 2.0, "m_new after block 1")
    assert round(float(l), 3) == 1.368, f"l_new after block 1: got {float(l):.4f}, expected 1.368 (= 1 + e^-1)"
    expect_number(r, 1.0, "rescale on the first block (nothing seen yet)")


@graded("01.online_softmax_update", 2)
def test_update_lesson_block_2(answer):
    """the lesson's block 2: [3, 0] arrives with a new max; rescale 0.368, l = 1.553"""
    l1 = 1.0 + math.exp(-1.0)
    m, l, r = unpack(answer(2.0, l1, np.array([3.0, 0.0])), 3, "online_softmax_update(2, 1.368, [3, 0])")
    expect_number(m, 3.0, "m_new after block 2")
    assert round(float(r), 3) == 0.368, f"rescale after block 2: got {float(r):.4f}, expected 0.368 (= e^(2-3))"
    assert round(float(l), 3) == 1.553, f"l_new after block 2: got {float(l):.4f}, expected 1.553" + (
        " -- the old sum was not rescaled" if round(float(l), 3) == round(l1 + 1 + math.exp(-3), 3) else ""
    )


@graded("01.online_softmax_update", 2)
def test_update_random_rows(answer):
    """fresh random rows folded block by block end with the row's max and full sum"""
    rng = np.random.default_rng()
    for _ in range(5):
        n, b = int(rng.integers(7, 60)), int(rng.integers(1, 9))
        row = rng.normal(0, 3, n)
        m, l, _ = _fold(answer, row, b)
        what = f"row of {n} random scores in blocks of {b}"
        expect_number(m, row.max(), f"{what}: final m")
        expect_number(l, np.exp(row - row.max()).sum(), f"{what}: final l", rel=1e-9, hints=RESCALE_HINT)


@graded("01.online_softmax_update", 1)
def test_update_no_new_max(answer):
    """a block below the running max leaves m alone and rescales by exactly 1"""
    rng = np.random.default_rng()
    m0, l0 = float(rng.uniform(2, 5)), float(rng.uniform(1, 4))
    block = m0 - rng.uniform(0.1, 3, 5)
    m, l, r = unpack(answer(m0, l0, block.copy()), 3, "online_softmax_update(...)")
    expect_number(m, m0, "m_new when the block has no new max")
    expect_number(r, 1.0, "rescale when the block has no new max")
    expect_number(l, l0 + np.exp(block - m0).sum(), "l_new when the block has no new max", rel=1e-9)


@graded("01.online_softmax_update", 1)
def test_update_huge_scores(answer):
    """scores near 1e4 must not overflow: subtract the running max before exp"""
    rng = np.random.default_rng()
    row = 1e4 + rng.normal(0, 5, 24)
    m, l, _ = _fold(answer, row, 5)
    expect_number(l, np.exp(row - row.max()).sum(), "final l for scores near 1e4", rel=1e-9)


def _expected_output(scores, values):
    return softmax(np.asarray(scores, dtype=np.float64)) @ np.asarray(values, dtype=np.float64)


@graded("01.streaming_attention", 2)
def test_stream_lesson(answer):
    """the lesson's example: scores [2, 1, 3, 0], V = [1, 2, 3, 4], blocks of 2 give 2.471"""
    got = expect_number(
        answer(np.array([2.0, 1.0, 3.0, 0.0]), np.array([1.0, 2.0, 3.0, 4.0]), 2),
        2.471,
        "output for the lesson's example",
        rel=2e-4,
        hints=RESCALE_HINT,
    )
    assert round(got, 3) == 2.471


@graded("01.streaming_attention", 2)
def test_stream_random_vectors(answer):
    """fresh random scores with a value vector per key; block size that does not divide n"""
    rng = np.random.default_rng()
    for _ in range(3):
        n, dv = int(rng.integers(9, 50)), int(rng.integers(2, 7))
        b = int(rng.integers(2, 8))
        if n % b == 0:
            n += 1
        s, v = rng.normal(0, 2, n), rng.normal(0, 1, (n, dv))
        expect_array(
            answer(s.copy(), v.copy(), b),
            _expected_output(s, v),
            f"output for {n} keys, values ({n}, {dv}), blocks of {b}",
            hints=RESCALE_HINT,
        )


@graded("01.streaming_attention", 1)
def test_stream_block_sizes(answer):
    """block size 1 (one key at a time) and a block bigger than the row give the same answer"""
    rng = np.random.default_rng()
    n = int(rng.integers(5, 20))
    s, v = rng.normal(0, 2, n), rng.normal(0, 1, n)
    want = float(_expected_output(s, v))
    expect_number(answer(s.copy(), v.copy(), 1), want, f"output with block_size 1 ({n} keys)", rel=1e-9)
    expect_number(answer(s.copy(), v.copy(), n + 3), want, f"output with block_size {n + 3} > n = {n}", rel=1e-9)


@graded("01.streaming_attention", 1)
def test_stream_huge_scores(answer):
    """scores near 1e4 must not overflow"""
    rng = np.random.default_rng()
    s, v = 1e4 + rng.normal(0, 4, 17), rng.normal(0, 1, (17, 3))
    expect_array(answer(s.copy(), v.copy(), 4), _expected_output(s, v), "output for scores near 1e4")
