"""Exercise for notebook 10 (longer than one GPU): one pair of sequence chunks as a bottom-right-aligned call.

On a ring, a rank's queries meet another rank's keys. The mask is the whole sequence's (query i sees keys
``[i - left, i + right]``), but the kernel aligns its mask to the bottom-right corner of the pair's score matrix.
Cut the pair to the rows that see some key and the keys some row sees, and the global band becomes a window from
that corner with both sides >= 0.
"""

from __future__ import annotations

import math

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import as_number, unpack

EXERCISES = [
    Exercise(
        id="10.pair_band",
        title="a pair of sequence chunks as one bottom-right-aligned kernel call",
        signature="q_chunk, k_chunk, left, right",
        doc="""
        The kernel call for the queries at global positions [qs, qe) = q_chunk against the keys at
        [ks, ke) = k_chunk of one sequence, whose mask lets query i see keys i - left <= j <= i + right
        (left, right: ints >= 0, or np.inf for no bound; causal is right = 0).

        Returns None when no query of q_chunk sees any key of k_chunk. Otherwise
        (qa, qb, ka, kb, win_left, win_right): the query rows [qa, qb) and keys [ka, kb) to compute, in global
        positions, and the window the kernel applies from its bottom-right corner: with nq = qb - qa and
        nk = kb - ka, local row a sees local keys a + (nk - nq) - win_left ... a + (nk - nq) + win_right. Both
        sides must be >= 0 (np.inf for no bound). Every visible (query, key) of the two chunks must fall in
        [qa, qb) x [ka, kb) and be inside the window there; nothing hidden may be. Plain Python (or NumPy).
        """,
    ),
]


def _sequence_mask(q_chunk, k_chunk, left, right) -> np.ndarray:
    """(qe - qs, ke - ks) bool: the whole sequence's mask on the pair."""
    i = np.arange(*q_chunk)[:, None]  # (nq, 1) global query positions
    j = np.arange(*k_chunk)[None, :]  # (1, nk) global key positions
    return (j >= i - left) & (j <= i + right)


def _side(x, what) -> float:
    x = as_number(x, what)
    if math.isnan(x) or x < 0:
        raise AssertionError(f"{what} must be >= 0 (np.inf for no bound); got {x}: cut the pair tighter")
    return x


def _check(answer, q_chunk, k_chunk, left, right):
    want = _sequence_mask(q_chunk, k_chunk, left, right)
    what = f"queries {q_chunk} against keys {k_chunk} with left={left}, right={right}"
    got = answer(tuple(q_chunk), tuple(k_chunk), left, right)
    if not want.any():
        if got is not None:
            raise AssertionError(f"{what}: no query sees any key, so the answer is None (no call); got {got!r}")
        return
    if got is None:
        raise AssertionError(f"{what}: some queries see keys ({int(want.sum())} pairs), but you returned None")
    qa, qb, ka, kb, win_left, win_right = unpack(got, 6, what)
    (qs, qe), (ks, ke) = q_chunk, k_chunk
    bounds = []
    for name, x, lo, hi in (("qa", qa, qs, qe), ("qb", qb, qs, qe), ("ka", ka, ks, ke), ("kb", kb, ks, ke)):
        x = as_number(x, f"{what}: {name}")
        if x != int(x) or not lo <= x <= hi:
            raise AssertionError(f"{what}: {name} = {x} must be a whole position within [{lo}, {hi}]")
        bounds.append(int(x))
    qa, qb, ka, kb = bounds
    if qa >= qb or ka >= kb:
        raise AssertionError(f"{what}: rows [{qa}, {qb}) and keys [{ka}, {kb}) must not be empty")
    win_left, win_right = _side(win_left, f"{what}: win_left"), _side(win_right, f"{what}: win_right")
    nq, nk = qb - qa, kb - ka
    a = np.arange(nq)[:, None]  # (nq, 1) local rows
    b = np.arange(nk)[None, :]  # (1, nk) local keys
    diag = a + (nk - nq)  # each row's key on the bottom-right diagonal
    local = (b >= diag - win_left) & (b <= diag + win_right)  # (nq, nk) what the kernel would compute
    computed = np.zeros_like(want)
    computed[qa - qs : qb - qs, ka - ks : kb - ks] = local
    if not np.array_equal(computed, want):
        missing, extra = np.argwhere(want & ~computed), np.argwhere(computed & ~want)
        if len(missing):
            i, j = missing[0]
            raise AssertionError(f"{what}: query {qs + i} should see key {ks + j}, but your call leaves it out")
        i, j = extra[0]
        raise AssertionError(f"{what}: query {qs + i} must not see key {ks + j}, but your call computes it")


@graded("10.pair_band", 2)
def test_causal_chunks_of_a_split(answer):
    """causal: every pair of chunks when a fresh random sequence is split into equal chunks"""
    rng = np.random.default_rng()
    parts = int(rng.integers(3, 7))
    c = int(rng.integers(3, 9))
    chunks = [(r * c, (r + 1) * c) for r in range(parts)]
    for qc in chunks:
        for kc in chunks:
            _check(answer, qc, kc, np.inf, 0)


@graded("10.pair_band", 2)
def test_sliding_windows(answer):
    """windows of random widths, on chunks of unequal lengths"""
    rng = np.random.default_rng()
    for _ in range(30):
        qs, ks = (int(x) for x in rng.integers(0, 40, 2))
        q_chunk = (qs, qs + int(rng.integers(1, 12)))
        k_chunk = (ks, ks + int(rng.integers(1, 12)))
        left, right = (int(x) for x in rng.integers(0, 15, 2))
        _check(answer, q_chunk, k_chunk, left, right)


@graded("10.pair_band", 1)
def test_unbounded_and_hidden(answer):
    """no mask at all, a causal window, and pairs the mask hides entirely"""
    _check(answer, (0, 8), (8, 16), np.inf, np.inf)
    _check(answer, (16, 24), (0, 8), 10, 0)  # causal, a window of 10: query 16 reaches back to key 6 only
    _check(answer, (16, 24), (4, 12), 6, 0)
    _check(answer, (0, 8), (8, 16), np.inf, 0)  # the keys are all in the queries' future
    _check(answer, (20, 30), (0, 5), 4, 4)
