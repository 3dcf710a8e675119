"""Exercise for notebook 06 (decode): the split-KV merge of partial results by their log-sum-exps.

Flash-Decoding splits the keys into chunks, runs attention on each chunk in parallel, and merges: chunk c's output
o_c is weighted by exp(lse_c - lse), where lse = log(sum_c exp(lse_c)).
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_array, unpack
from flashlab.reference import attention

EXERCISES = [
    Exercise(
        id="06.merge_split_kv",
        title="the split-KV (Flash-Decoding) log-sum-exp merge",
        signature="outs, lses",
        doc="""
        Combine attention results computed separately over C disjoint chunks of the keys.

        outs  (C, N, Dv)  chunk c's attention output for N query rows, each already normalised over chunk c
        lses  (C, N)      chunk c's log-sum-exp of each row's scores over its keys (-inf if the row saw
                          no key in that chunk; then its output row is zeros)

        Returns (o, lse): o (N, Dv) the attention output over all the keys, lse (N,) the log-sum-exp over all
        the keys. Weight each chunk by exp(lse_c - lse); compute lse = m + log(sum_c exp(lse_c - m)) with
        m the largest lse_c, so nothing overflows. A row that saw no key in any chunk gives zeros and -inf.
        Use NumPy; calling flashlab's own implementation scores 0. Do not change the inputs in place.
        """,
    ),
]


def _split(rng, n, nk, d, dv, cuts, scale=1.0):
    q = rng.normal(0, scale, (n, d))
    k, v = rng.normal(0, 1, (nk, d)), rng.normal(0, 1, (nk, dv))
    want_o, want_lse = attention(q, k, v)
    edges = [0, *cuts, nk]
    parts = [attention(q, k[a:b], v[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), want_o, want_lse


def _check(answer, outs, lses, want_o, want_lse, what):
    o, lse = unpack(answer(outs.copy(), lses.copy()), 2, "merge_split_kv(...)")
    mean = outs.mean(axis=0)
    if np.shape(o) == mean.shape and outs.shape[0] > 1 and np.allclose(o, mean):
        raise AssertionError(f"{what}: o is the plain average of the chunks; weight chunk c by exp(lse_c - lse)")
    expect_array(o, want_o, f"{what}: o", rtol=1e-7, atol=1e-9)
    expect_array(lse, want_lse, f"{what}: lse", rtol=1e-9, atol=1e-9)


@graded("06.merge_split_kv", 2)
def test_merge_two_chunks(answer):
    """two chunks of a fresh random problem merge to attention over all the keys"""
    rng = np.random.default_rng()
    nk = int(rng.integers(10, 60))
    outs, lses, o, lse = _split(rng, 5, nk, 8, 3, [int(rng.integers(1, nk))])
    _check(answer, outs, lses, o, lse, f"two chunks of {nk} keys")


@graded("06.merge_split_kv", 2)
def test_merge_uneven_chunks(answer):
    """many chunks of uneven sizes"""
    rng = np.random.default_rng()
    nk = int(rng.integers(30, 120))
    c = int(rng.integers(3, 8))
    cuts = sorted(int(x) for x in rng.choice(np.arange(1, nk), size=c - 1, replace=False))
    outs, lses, o, lse = _split(rng, 7, nk, 6, 5, cuts)
    _check(answer, outs, lses, o, lse, f"{c} uneven chunks of {nk} keys")


@graded("06.merge_split_kv", 1)
def test_merge_huge_lse(answer):
    """log-sum-exps in the thousands: exp(lse_c) overflows, exp(lse_c - m) does not"""
    rng = np.random.default_rng()
    outs, lses, o, lse = _split(rng, 4, 40, 16, 3, [13, 27], scale=200.0)
    _check(answer, outs, lses, o, lse, "chunks with lse in the thousands")


@graded("06.merge_split_kv", 1)
def test_merge_empty_chunk(answer):
    """a chunk a row saw nothing of (lse -inf, output zeros) adds nothing; a row that saw nothing gives zeros"""
    rng = np.random.default_rng()
    outs, lses, o, lse = _split(rng, 3, 20, 4, 2, [9])
    outs = np.concatenate([outs, np.zeros((1, 3, 2))])  # a third chunk nobody saw
    lses = np.concatenate([lses, np.full((1, 3), -np.inf)])
    _check(answer, outs, lses, o, lse, "an extra chunk with lse = -inf")
    z_o, z_lse = unpack(answer(np.zeros((2, 1, 2)), np.full((2, 1), -np.inf)), 2, "merge_split_kv(...)")
    expect_array(z_o, np.zeros((1, 2)), "o for a row that saw no key in any chunk")
    expect_array(z_lse, np.full(1, -np.inf), "lse for a row that saw no key in any chunk")
