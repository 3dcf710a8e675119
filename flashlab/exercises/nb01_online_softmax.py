"""Exercises for notebook 01 (online softmax by hand): one block's update, then the streaming output.

The lesson's example is one row of four scores [2, 1 | 3, 0] seen in blocks of two, with values V = [1, 2, 3, 4]:
l = 1.368 after block 1, rescale 0.368 when 3 arrives, l = 1.553, output 2.471.
"""

from __future__ import annotations

import math

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import MAX_NOT_SUBTRACTED, RESCALE_FORGOTTEN, expect_array, expect_number, unpack
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
        signature="blocks",
        doc="""
        One query's attention output, computed as its keys arrive one block at a time. A generator.

        blocks  an iterator of (scores, values) pairs, one block of keys each, handed over one at a time:
                scores (b,) the query's scores against the block's keys; values (b,) or (b, dv) their values
                (a number, or a vector of dv numbers, per key). Block sizes vary; the last may be shorter.

        After folding each block in, yield the running state (m, l, acc), then read the next block:
        m    float                 running max of every score seen so far
        l    float                 running sum of exp(s - m) over those scores
        acc  float or (dv,) array  running un-normalised output: the sum of exp(s - m) * value
        When a new max arrives, rescale the old l AND the old acc by exp(m_old - m_new) before adding the new
        block's terms. The output is acc / l of the last state. `for scores, values in blocks:` reads the blocks
        one at a time, as required: reading a block before yielding the state for the one before fails.

        The lesson's example, blocks ([2, 1], [1, 2]) then ([3, 0], [3, 4]): states (2, 1.368, 1.736), then
        (3, 1.553, 3.838); output 3.838 / 1.553 = 2.471. Use NumPy; calling flashlab's own implementation
        scores 0. Do not change the inputs in place.
        """,
    ),
]


def fold(blocks, rescale: bool = True, subtract_max: bool = True):
    """The running (m, l, acc) after each block, as the lesson computes it -- or with one of its mistakes."""
    m, l, acc, states = -math.inf, 0.0, 0.0, []
    for scores, values in blocks:
        m_new = max(m, float(np.max(scores)))
        alpha = math.exp(m - m_new) if rescale and m > -math.inf else (1.0 if m > -math.inf else 0.0)
        shift = m_new if subtract_max else 0.0
        with np.errstate(over="ignore", invalid="ignore"):  # exp(s) of huge scores overflows: that is the mistake
            p = np.exp(np.asarray(scores, dtype=np.float64) - shift)
            l, acc = alpha * l + float(p.sum()), alpha * acc + p @ np.asarray(values, dtype=np.float64)
        m = m_new
        states.append((m, l, acc))
    return states


def _mistakes(blocks, i, part):
    """What state ``i``'s ``part`` (1: l, 2: acc) would be after each mistake the lesson predicts."""
    return {
        RESCALE_FORGOTTEN: fold(blocks, rescale=False)[i][part],
        MAX_NOT_SUBTRACTED: fold(blocks, subtract_max=False)[i][part],
    }


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
        blocks = [(row[i : i + b], np.zeros(len(row[i : i + b]))) for i in range(0, n, b)]
        expect_number(
            l, np.exp(row - row.max()).sum(), f"{what}: final l", rel=1e-9, known_wrong=_mistakes(blocks, -1, 1)
        )


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


def _blocks(scores, values, sizes):
    out, start = [], 0
    for b in sizes:
        out.append((scores[start : start + b], values[start : start + b]))
        start += b
    return out


def _stream(answer, blocks, what):
    """Feed the blocks one at a time, checking each yielded state before the next block is sent; the output."""
    want, n, m, l, acc = fold(blocks), 0, None, None, None
    for i, state in enumerate(answer.stream(blocks)):
        m, l, acc = unpack(state, 3, f"{what}: the state yielded after block {i + 1}")
        after = f"{what}: after block {i + 1} of {len(blocks)}"
        expect_number(m, want[i][0], f"{after}, m")
        expect_number(l, want[i][1], f"{after}, l", rel=1e-9, known_wrong=_mistakes(blocks, i, 1))
        if np.ndim(want[i][2]) == 0:
            expect_number(acc, want[i][2], f"{after}, acc", rel=1e-9, abs_=1e-12, known_wrong=_mistakes(blocks, i, 2))
        else:
            expect_array(acc, want[i][2], f"{after}, acc", known_wrong=_mistakes(blocks, i, 2))
        n += 1
    assert n == len(blocks), f"{what}: your function yielded {n} states for {len(blocks)} blocks; yield once per block"
    scores = np.concatenate([b[0] for b in blocks])
    values = np.concatenate([b[1] for b in blocks])
    out = np.asarray(acc, dtype=np.float64) / float(l)
    expect_array(out, softmax(scores) @ values, f"{what}: the output acc / l of the last state")
    return out


def _random_sizes(rng, n, lo=1, hi=8):
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(int(rng.integers(lo, hi + 1)), n - sum(sizes)))
    return sizes


@graded("01.streaming_attention", 2)
def test_stream_lesson(answer):
    """the lesson's example: scores [2, 1 | 3, 0], V = [1, 2 | 3, 4] give states ending in output 2.471"""
    blocks = _blocks(np.array([2.0, 1.0, 3.0, 0.0]), np.array([1.0, 2.0, 3.0, 4.0]), [2, 2])
    out = _stream(answer, blocks, "the lesson's example")
    assert round(float(out), 3) == 2.471


@graded("01.streaming_attention", 2)
def test_stream_random_vectors(answer):
    """fresh random scores with a value vector per key, in blocks of varying size, each state checked in turn"""
    rng = np.random.default_rng()
    for _ in range(3):
        n, dv = int(rng.integers(9, 50)), int(rng.integers(2, 7))
        s, v = rng.normal(0, 2, n), rng.normal(0, 1, (n, dv))
        s[-1] = s.max() + 0.5  # a new max in the last block
        sizes = _random_sizes(rng, n)
        _stream(answer, _blocks(s, v, sizes), f"{n} keys with values ({n}, {dv}) in blocks of {sizes}")


@graded("01.streaming_attention", 1)
def test_stream_block_sizes(answer):
    """one key at a time, and all keys in a single block"""
    rng = np.random.default_rng()
    n = int(rng.integers(5, 20))
    s, v = rng.normal(0, 2, n), rng.normal(0, 1, n)
    s[-1] = s.max() + 1.0  # the max arrives last, so every earlier term needs the rescale
    _stream(answer, _blocks(s, v, [1] * n), f"{n} keys, one at a time")
    _stream(answer, _blocks(s, v, [n]), f"{n} keys in one block")


@graded("01.streaming_attention", 1)
def test_stream_huge_scores(answer):
    """scores near 1e4 must not overflow: the running sum is relative to the running max"""
    rng = np.random.default_rng()
    s, v = 1e4 + rng.normal(0, 4, 17), rng.normal(0, 1, (17, 3))
    s[-1] = s.max() + 2.0  # a new max in the last block
    _stream(answer, _blocks(s, v, [4, 4, 4, 4, 1]), "scores near 1e4")
