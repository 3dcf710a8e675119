"""Exercises for notebook 05 (timing on a GPU): read a kernel time as TFLOP/s, and a kernel speedup end to end.

The lesson: attention is 4 n^2 d FLOPs per head (half that with a causal mask); if attention is 30 % of a step
and the kernel gets 2x faster, the step gets 1 / (0.7 + 0.15) = 1.18x faster (Amdahl's law).
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_number

EXERCISES = [
    Exercise(
        id="05.end_to_end_speedup",
        title="a kernel speedup turned into an end-to-end speedup",
        signature="attention_share, kernel_speedup",
        imports="",
        doc="""
        How much faster a whole step gets when only its attention gets faster (Amdahl's law).

        attention_share  float in [0, 1]   the fraction of the step's time spent in attention, before
        kernel_speedup   float > 0         how many times faster the attention kernel became

        Returns the step's speedup, a float. The lesson: end_to_end_speedup(0.3, 2.0) == 1 / (0.7 + 0.15),
        about 1.18. Raise ValueError for a share outside [0, 1] or a speedup that is not positive.
        """,
    ),
    Exercise(
        id="05.achieved_tflops",
        title="a measured attention time read as TFLOP/s",
        signature="batch, heads, n, d, seconds, causal=False",
        imports="",
        doc="""
        The throughput a forward attention kernel reached: its FLOPs divided by its time, in TFLOP/s (1e12).

        batch, heads, n, d  ints: sequences, heads, sequence length, head dim
        seconds             float, the measured time of one forward pass
        causal              with a causal mask only half the score matrix is useful work

        FLOPs per head: 4 * n^2 * d (two matrix multiplies, 2 FLOPs per multiply-add), halved if causal.
        Returns a float. The lesson's 8K prompt (1 x 64 heads x 80 layers of 4 * 8192^2 * 128) is 176 TFLOP;
        done in 0.352 s that is 500 TFLOP/s.
        """,
    ),
]


def _amdahl(f, s):
    return 1.0 / ((1.0 - f) + f / s)


@graded("05.end_to_end_speedup", 2)
def test_speedup_lesson(answer):
    """the lesson: 30 % attention, kernel 2x faster -> 1.18x end to end"""
    got = expect_number(answer(0.3, 2.0), _amdahl(0.3, 2.0), "end_to_end_speedup(0.3, 2.0)")
    assert round(got, 2) == 1.18


@graded("05.end_to_end_speedup", 2)
def test_speedup_random(answer):
    """fresh random shares and kernel speedups (including kernels that got slower)"""
    rng = np.random.default_rng()
    for _ in range(6):
        f, s = float(rng.uniform(0.01, 0.99)), float(rng.uniform(0.5, 10))
        expect_number(answer(f, s), _amdahl(f, s), f"end_to_end_speedup({f:.3f}, {s:.3f})", rel=1e-9)


@graded("05.end_to_end_speedup", 1)
def test_speedup_edges(answer):
    """no attention in the step: 1x; all attention: the kernel's own speedup"""
    expect_number(answer(0.0, 3.0), 1.0, "end_to_end_speedup(0.0, 3.0)")
    expect_number(answer(1.0, 3.0), 3.0, "end_to_end_speedup(1.0, 3.0)")


@graded("05.end_to_end_speedup", 1)
def test_speedup_bad_input(answer):
    """a share outside [0, 1] or a speedup <= 0 raises ValueError"""
    for args in ((1.5, 2.0), (-0.1, 2.0), (0.3, 0.0), (0.3, -2.0)):
        try:
            answer(*args)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"end_to_end_speedup{args} raised {type(e).__name__}; expected ValueError") from None
        raise AssertionError(f"end_to_end_speedup{args} returned a value; expected it to raise ValueError")


def _tflops(b, h, n, d, t, causal):
    return 4 * n * n * d * b * h / (2 if causal else 1) / t / 1e12


HINTS = {"reported FLOP/s, not TFLOP/s": 1e12, "forgot to halve the FLOPs for causal": 2.0, "count 4 n^2 d": 0.5}


@graded("05.achieved_tflops", 2)
def test_tflops_lesson(answer):
    """the lesson's 176 TFLOP prompt in 0.352 s is 500 TFLOP/s"""
    flops = 4 * 8192**2 * 128 * 64 * 80
    got = answer(80, 64, 8192, 128, flops / 500e12)
    got = expect_number(got, 500.0, "TFLOP/s for the lesson's prompt", hints=HINTS)
    assert round(got) == 500


@graded("05.achieved_tflops", 2)
def test_tflops_random(answer):
    """fresh random shapes and times, causal and not"""
    rng = np.random.default_rng()
    for causal in (False, True, False, True):
        b, h = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        n, d, t = int(rng.integers(128, 32768)), int(rng.choice([64, 80, 128, 256])), float(10 ** rng.uniform(-4, -1))
        expect_number(
            answer(b, h, n, d, t, causal),
            _tflops(b, h, n, d, t, causal),
            f"achieved_tflops({b}, {h}, {n}, {d}, {t:.3g}, causal={causal})",
            rel=1e-9,
            hints=HINTS,
        )


@graded("05.achieved_tflops", 1)
def test_tflops_causal_halves(answer):
    """the same time with a causal mask is half the TFLOP/s: only half the score matrix is useful work"""
    rng = np.random.default_rng()
    n, t = int(rng.integers(1000, 16000)), float(10 ** rng.uniform(-3, -1))
    full = expect_number(answer(2, 16, n, 128, t), _tflops(2, 16, n, 128, t, False), "TFLOP/s without a mask")
    half = expect_number(
        answer(2, 16, n, 128, t, causal=True), _tflops(2, 16, n, 128, t, True), "TFLOP/s with causal", hints=HINTS
    )
    assert abs(half / full - 0.5) < 1e-9
