"""Exercises for notebook 02 (score matrix and traffic): count the bytes, then ask the roofline which bound wins.

The lesson's figures: one head's 8,192-token fp16 score matrix is 134,217,728 B; naive attention moves it four
times (537 MB); FlashAttention reads Q, K, V and writes O once (8.4 MB at d = 128), 64x less. For the whole 8K
prompt of a 64-head, 80-layer model: 2.75 TB of score traffic against 176 TFLOP, 0.92 s of memory time against
0.35 s of arithmetic on a GPU with 3 TB/s and 500 TFLOP/s.
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_int, expect_number, unpack

EXERCISES = [
    Exercise(
        id="02.attention_traffic",
        title="score-matrix bytes, and naive vs flash HBM traffic for one head",
        signature="n, d, dtype_bytes=2",
        imports="",
        doc="""
        Bytes for one attention head at sequence length n and head dimension d, elements of dtype_bytes each.

        Returns (score_bytes, naive_bytes, flash_bytes), three ints:
        score_bytes  the n x n score matrix S
        naive_bytes  the unfused version's traffic in the lesson's simplified count: write S, read S,
                     write P, read P (leave out the Q, K, V, O reads and writes)
        flash_bytes  FlashAttention's traffic: read Q, K and V and write O once, each n x d

        The lesson: attention_traffic(8192, 128) == (134_217_728, 536_870_912, 8_388_608).
        """,
    ),
    Exercise(
        id="02.roofline_bound",
        title="which roofline bound wins: memory time or compute time",
        signature="flops, nbytes, bandwidth, peak_flops",
        imports="",
        doc="""
        The roofline: an operation needs at least nbytes / bandwidth seconds to move its bytes and
        flops / peak_flops seconds to do its arithmetic; the larger of the two is its time.

        flops       float   floating-point operations
        nbytes      float   bytes moved to and from HBM
        bandwidth   float   HBM bandwidth, bytes per second
        peak_flops  float   arithmetic throughput, FLOP per second

        Returns (seconds, bound): the larger time, and "memory" or "compute" for whichever bound it is.
        The lesson's 8K prompt: 2.75 TB and 176 TFLOP on 3 TB/s and 500 TFLOP/s gives (0.92, "memory").
        """,
    ),
]


@graded("02.attention_traffic", 2)
def test_traffic_lesson(answer):
    """the lesson's head at 8,192 tokens, d = 128, fp16: 134,217,728 B / 537 MB / 8.4 MB"""
    s, naive, flash = unpack(answer(8192, 128, 2), 3, "attention_traffic(8192, 128, 2)")
    expect_int(s, 134_217_728, "score_bytes at 8,192 tokens fp16", hints={"counted bits, not bytes": 8.0})
    expect_int(naive, 536_870_912, "naive_bytes at 8,192 tokens", hints={"count four passes over S": 0.25})
    expect_int(flash, 8_388_608, "flash_bytes at 8,192 tokens, d = 128")


@graded("02.attention_traffic", 1)
def test_traffic_default_dtype(answer):
    """dtype_bytes defaults to 2 (fp16/bf16)"""
    s, _, _ = unpack(answer(4096, 64), 3, "attention_traffic(4096, 64)")
    expect_int(s, 4096 * 4096 * 2, "score_bytes at 4,096 tokens with the default dtype")


@graded("02.attention_traffic", 2)
def test_traffic_random(answer):
    """fresh random lengths, head dims and dtypes (1, 2 or 4 bytes)"""
    rng = np.random.default_rng()
    for _ in range(5):
        n, d, b = int(rng.integers(100, 40_000)), int(rng.integers(16, 257)), int(rng.choice([1, 2, 4]))
        s, naive, flash = unpack(answer(n, d, b), 3, f"attention_traffic({n}, {d}, {b})")
        expect_int(s, n * n * b, f"score_bytes for n = {n}, {b}-byte elements")
        expect_int(naive, 4 * n * n * b, f"naive_bytes for n = {n}, {b}-byte elements")
        expect_int(flash, 4 * n * d * b, f"flash_bytes for n = {n}, d = {d}, {b}-byte elements")


@graded("02.attention_traffic", 1)
def test_traffic_ratio(answer):
    """the saving is n / d: 64x at 8K tokens and d = 128, and it grows with n"""
    rng = np.random.default_rng()
    n, d = int(rng.integers(1000, 30000)), int(rng.choice([64, 80, 96, 128]))
    _, naive, flash = unpack(answer(n, d, 2), 3, f"attention_traffic({n}, {d}, 2)")
    expect_number(float(naive) / float(flash), n / d, f"naive / flash traffic at n = {n}, d = {d}")


def _lesson_prompt():
    n, d, heads, layers = 8192, 128, 64, 80
    return 4 * n * n * d * heads * layers, 4 * n * n * 2 * heads * layers


@graded("02.roofline_bound", 2)
def test_bound_lesson(answer):
    """the lesson's 8K prompt on 3 TB/s and 500 TFLOP/s: memory-bound, 0.92 s"""
    flops, nbytes = _lesson_prompt()
    t, bound = unpack(answer(flops, nbytes, 3e12, 500e12), 2, "roofline_bound(...)")
    assert bound == "memory", f"bound for the lesson's prompt: got {bound!r}, expected 'memory'"
    t = expect_number(t, nbytes / 3e12, "time for the lesson's prompt", hints={"took the smaller time": 0.38})
    assert round(t, 2) == 0.92


@graded("02.roofline_bound", 1)
def test_bound_flash(answer):
    """with FlashAttention's traffic the same prompt becomes compute-bound: 0.35 s"""
    flops, _ = _lesson_prompt()
    nbytes = 4 * 8192 * 128 * 2 * 64 * 80
    t, bound = unpack(answer(flops, nbytes, 3e12, 500e12), 2, "roofline_bound(...)")
    assert bound == "compute", f"bound with flash traffic: got {bound!r}, expected 'compute'"
    assert round(float(t), 2) == 0.35, f"time with flash traffic: got {float(t):.4g} s, expected 0.35 s"


@graded("02.roofline_bound", 2)
def test_bound_random(answer):
    """fresh random operations on random GPUs, both sides of the ridge point"""
    rng = np.random.default_rng()
    for _ in range(6):
        flops, nbytes = 10 ** rng.uniform(9, 15), 10 ** rng.uniform(7, 13)
        bw, peak = 10 ** rng.uniform(11.5, 12.8), 10 ** rng.uniform(13.5, 15.3)
        t_mem, t_cmp = nbytes / bw, flops / peak
        if abs(np.log(t_mem / t_cmp)) < 0.01:
            continue
        t, bound = unpack(answer(flops, nbytes, bw, peak), 2, "roofline_bound(...)")
        want = "memory" if t_mem > t_cmp else "compute"
        what = f"{flops:.3g} FLOP, {nbytes:.3g} B on {bw:.3g} B/s and {peak:.3g} FLOP/s"
        assert bound == want, f"bound for {what}: got {bound!r}, expected {want!r}"
        expect_number(t, max(t_mem, t_cmp), f"time for {what}")
