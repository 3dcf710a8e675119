"""flashlab.reference: the lesson's worked numbers, and every path against attention written out in this file.

Three kinds of check:
- the online-softmax example from the lesson, asserted as the lesson prints it (to 3 decimals);
- ``attention`` (materialised), ``tiled_attention`` (tiled) and ``merge_partials`` (split-KV) against ``naive``
  below -- attention in float64 built from a brute-force mask -- on awkward shapes and as hypothesis properties;
- that the tiled loop really skips what the mask hides, and that bad input raises a clear error.
"""

from __future__ import annotations

import importlib
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlab.core.masking import tile_map, visible_mask
from flashlab.reference import attention, merge_partials, online_attention, online_softmax, softmax, tiled_attention

tiled_module = importlib.import_module("flashlab.reference.tiled")

TOL = dict(rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- test's own attention


def brute_force_mask(nq, nk, causal=False, window=None):
    """(nq, nk) bool: may query i see key j? Bottom-right aligned: query i sits on key column i + nk - nq."""
    mask = np.ones((nq, nk), dtype=bool)
    for i in range(nq):
        diag = i + nk - nq
        for j in range(nk):
            if causal and j > diag:
                mask[i, j] = False
            if window is not None:
                left, right = window
                if (left is not None and j < diag - left) or (right is not None and j > diag + right):
                    mask[i, j] = False
    return mask


def logsumexp_rows(s):
    """Natural log-sum-exp over the last axis, -inf for an all -inf row; shifted by the row max so exp never
    overflows."""
    m = s.max(axis=-1, keepdims=True)
    finite = np.isfinite(m)
    shifted = np.where(finite, s - np.where(finite, m, 0.0), -np.inf)
    with np.errstate(divide="ignore"):
        return np.where(finite[..., 0], m[..., 0] + np.log(np.exp(shifted).sum(axis=-1)), -np.inf)


def naive_from_mask(q, k, v, mask, scale):
    """Attention over q (..., H, Nq, D), k/v (..., H, Nk, D|Dv) with an explicit (Nq, Nk) mask. Returns (o, lse)."""
    s = np.where(mask, q @ np.swapaxes(k, -1, -2) * scale, -np.inf)  # (..., H, Nq, Nk)
    lse = logsumexp_rows(s)  # (..., H, Nq)
    p = np.where(np.isfinite(lse)[..., None], np.exp(s - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return p @ v, lse


def naive(q, k, v, causal=False, window=None, scale=None):
    """Attention in float64, the way a textbook writes it; GQA by indexing head h // group."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    two_d = q.ndim == 2
    if two_d:
        q, k, v = q[None], k[None], v[None]  # (1, N, D)
    hq, hk = q.shape[-3], k.shape[-3]
    heads = np.arange(hq) // (hq // hk)
    k, v = k[..., heads, :, :], v[..., heads, :, :]  # (..., Hq, Nk, D)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    o, lse = naive_from_mask(q, k, v, brute_force_mask(q.shape[-2], k.shape[-2], causal, window), scale)
    return (o[0], lse[0]) if two_d else (o, lse)


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def qkv(rng, batch=(), hq=1, hk=1, nq=5, nk=5, d=4, dv=None, scale=1.0):
    dv = d if dv is None else dv
    return (
        randn(rng, *batch, hq, nq, d, scale=scale),
        randn(rng, *batch, hk, nk, d, scale=scale),
        randn(rng, *batch, hk, nk, dv),
    )


# ---------------------------------------------------------------------------------------------- the lesson's numbers


def test_lesson_online_softmax_numbers():
    probs, steps = online_softmax([2, 1, 3, 0], 2)
    assert len(steps) == 2
    # block 1: scores 2 and 1; running max 2; l = 1 + 0.368
    assert steps[0].m == 2 and round(steps[0].l, 3) == 1.368 and steps[0].rescale == 1.0
    # block 2: 3 is a new max; the old sum is rescaled by e^(2-3) = 0.368
    assert steps[1].m == 3 and round(steps[1].rescale, 3) == 0.368
    assert round(steps[0].l * steps[1].rescale, 3) == 0.503
    assert round(steps[1].l - steps[0].l * steps[1].rescale, 3) == 1.050
    assert round(steps[1].l, 3) == 1.553
    assert [round(float(p), 3) for p in probs] == [0.237, 0.087, 0.644, 0.032]
    # the textbook softmax gives the same four numbers
    assert [round(float(p), 3) for p in softmax([2, 1, 3, 0])] == [0.237, 0.087, 0.644, 0.032]


def test_lesson_online_attention_numbers():
    out, steps = online_attention([2, 1, 3, 0], [1, 2, 3, 4], 2)
    assert round(steps[0].acc, 3) == 1.736  # 1 + 0.368 * 2, relative to max 2
    assert round(steps[0].acc * steps[1].rescale, 3) == 0.639  # rescaled to the new max 3
    assert round(steps[1].acc - steps[0].acc * steps[1].rescale, 3) == 3.199  # block 2: 1 * 3 + 0.050 * 4
    assert round(steps[1].acc, 3) == 3.838
    assert round(out, 3) == 2.471
    assert round(steps[1].acc / steps[1].l, 3) == 2.471
    assert isinstance(out, float)


def test_online_steps_record_previous_max_and_scores():
    _, steps = online_softmax([2, 1, 3, 0], 2)
    assert steps[0].m_prev == -np.inf and steps[1].m_prev == 2
    assert [step.block for step in steps] == [0, 1]
    np.testing.assert_array_equal(steps[1].scores, [3, 0])


def test_online_attention_vector_values_per_key():
    rng = np.random.default_rng(0)
    scores, values = randn(rng, 11), randn(rng, 11, 3)
    out, steps = online_attention(scores, values, 4)
    assert out.shape == (3,) and steps[-1].acc.shape == (3,)
    np.testing.assert_allclose(out, softmax(scores) @ values, **TOL)
    # each column streams exactly as a scalar value would
    for c in range(3):
        col, _ = online_attention(scores, values[:, c], 4)
        assert col == pytest.approx(out[c], rel=1e-12)


@pytest.mark.parametrize("n,block", [(1, 1), (4, 1), (4, 3), (7, 2), (10, 3), (13, 5), (5, 5), (3, 8), (6, 100)])
def test_online_softmax_any_block_size(n, block):
    rng = np.random.default_rng(n * 100 + block)
    x = randn(rng, n, scale=3)
    probs, steps = online_softmax(x, block)
    assert len(steps) == -(-n // block)  # the last block may be shorter; a block bigger than n is one block
    assert len(steps[-1].scores) == n - block * (len(steps) - 1)
    e = np.exp(x - x.max())
    np.testing.assert_allclose(probs, e / e.sum(), **TOL)
    assert steps[-1].m == x.max()
    assert steps[-1].l == pytest.approx(e.sum(), rel=1e-12)
    # the running max never decreases and the rescale is exp(m_prev - m)
    for step in steps[1:]:
        assert step.m >= step.m_prev and step.rescale == pytest.approx(math.exp(step.m_prev - step.m), rel=1e-12)
    v = randn(rng, n, 2)
    out, _ = online_attention(x, v, block)
    np.testing.assert_allclose(out, (e / e.sum()) @ v, **TOL)


def test_online_softmax_rescale_is_one_when_the_max_does_not_change():
    _, steps = online_softmax([5, 1, 2, 0, 3], 2)
    assert [step.rescale for step in steps] == [1.0, 1.0, 1.0]


def test_softmax_huge_scores_do_not_overflow():
    x = np.array([1e4, 1e4 - 1, 0.0, -1e4])
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(x)).any()  # the naive exp would overflow
    expected = np.array([1.0, math.exp(-1), 0.0, 0.0]) / (1 + math.exp(-1))
    np.testing.assert_allclose(softmax(x), expected, **TOL)
    probs, _ = online_softmax(x[::-1].copy(), 1)
    np.testing.assert_allclose(probs, expected[::-1], **TOL)


def test_softmax_and_online_softmax_with_minus_inf_scores():
    x = np.array([-np.inf, 1.0, -np.inf, 2.0, -np.inf])
    expected = np.array([0, math.exp(-1), 0, 1, 0]) / (1 + math.exp(-1))
    np.testing.assert_allclose(softmax(x), expected, **TOL)
    for block in (1, 2, 3, 5):
        probs, steps = online_softmax(x, block)
        np.testing.assert_allclose(probs, expected, **TOL)
        assert not any(np.isnan(step.l) or np.isnan(step.rescale) for step in steps)
    # a first block that is all -inf: nothing seen yet, then the real scores arrive
    probs, steps = online_softmax([-np.inf, -np.inf, 0.0, 0.0], 2)
    np.testing.assert_allclose(probs, [0, 0, 0.5, 0.5], **TOL)
    assert steps[0].l == 0.0 and steps[1].l == 2.0


def test_all_minus_inf_row_gives_zeros_not_nan():
    x = np.full(4, -np.inf)
    np.testing.assert_array_equal(softmax(x), np.zeros(4))
    probs, _ = online_softmax(x, 3)
    np.testing.assert_array_equal(probs, np.zeros(4))
    out, _ = online_attention(x, np.ones((4, 2)), 3)
    np.testing.assert_array_equal(out, np.zeros(2))
    np.testing.assert_array_equal(softmax(np.array([[0.0, 0.0], [-np.inf, -np.inf]])), [[0.5, 0.5], [0, 0]])


def test_softmax_axis():
    rng = np.random.default_rng(1)
    x = randn(rng, 3, 4)
    np.testing.assert_allclose(softmax(x, axis=0).sum(axis=0), np.ones(4), **TOL)
    np.testing.assert_allclose(softmax(x, axis=0), softmax(x.T).T, **TOL)


# ---------------------------------------------------------------------------------------------- full attention


CASES = [
    # (batch, hq, hk, nq, nk, d, dv)
    ((), 1, 1, 1, 1, 1, 1),
    ((), 1, 1, 7, 7, 5, 5),
    ((), 1, 1, 13, 29, 8, 8),
    ((), 1, 1, 29, 13, 8, 3),
    ((2,), 3, 3, 17, 17, 7, 7),
    ((2,), 6, 2, 11, 19, 9, 5),  # GQA, group 3
    ((2,), 4, 1, 19, 11, 6, 6),  # multi-query
    ((2, 3), 2, 2, 9, 9, 3, 4),  # two leading batch dims
    ((), 5, 5, 1, 33, 16, 16),  # decode: one query row
    ((1,), 2, 1, 65, 65, 12, 10),
]
MASKS = [(False, None), (True, None), (False, (3, 2)), (True, (4, None)), (False, (None, 0)), (False, (0, None))]


def _ids(c):
    batch, hq, hk, nq, nk, d, dv = c
    return f"b{'x'.join(map(str, batch)) or '-'}_h{hq}/{hk}_n{nq}x{nk}_d{d}/{dv}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
@pytest.mark.parametrize("causal,window", MASKS)
def test_attention_and_tiled_match_naive(case, causal, window):
    batch, hq, hk, nq, nk, d, dv = case
    rng = np.random.default_rng(zlib.crc32(repr((case, causal, window)).encode()))
    q, k, v = qkv(rng, batch, hq, hk, nq, nk, d, dv)
    o_ref, lse_ref = naive(q, k, v, causal, window)
    o, lse = attention(q, k, v, causal, window)
    assert o.shape == batch + (hq, nq, dv) and lse.shape == batch + (hq, nq)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(lse, lse_ref, **TOL)
    for block_m, block_n in [(1, 1), (4, 4), (5, 3), (7, 16), (64, 64), (200, 200)]:
        ot, lset = tiled_attention(q, k, v, causal, window, block_m=block_m, block_n=block_n)
        np.testing.assert_allclose(ot, o_ref, **TOL, err_msg=f"block {block_m}x{block_n}")
        np.testing.assert_allclose(lset, lse_ref, **TOL, err_msg=f"block {block_m}x{block_n}")


def test_two_dimensional_inputs_are_one_head():
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, 9, 5), randn(rng, 12, 5), randn(rng, 12, 3)
    o_ref, lse_ref = naive(q, k, v, causal=True)
    for fn in (attention, tiled_attention):
        o, lse = fn(q, k, v, causal=True)
        assert o.shape == (9, 3) and lse.shape == (9,)
        np.testing.assert_allclose(o, o_ref, **TOL)
        np.testing.assert_allclose(lse, lse_ref, **TOL)
    # and it equals the same data with one head and one batch
    o4, _ = tiled_attention(q[None, None], k[None, None], v[None, None], causal=True, block_m=4, block_n=5)
    np.testing.assert_allclose(o4[0, 0], o_ref, **TOL)


def test_leading_batch_dims_are_independent_problems():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2, 3), 4, 2, 10, 14, 6)
    o, lse = tiled_attention(q, k, v, causal=True, block_m=3, block_n=4)
    for b0 in range(2):
        for b1 in range(3):
            for h in range(4):
                ob, lb = attention(q[b0, b1, h], k[b0, b1, h // 2], v[b0, b1, h // 2], causal=True)
                np.testing.assert_allclose(o[b0, b1, h], ob, **TOL)
                np.testing.assert_allclose(lse[b0, b1, h], lb, **TOL)


def test_gqa_query_head_reads_key_head_h_over_group():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (), 6, 2, 8, 8, 4)
    o, _ = attention(q, k, v)
    o_rep, _ = attention(q, np.repeat(k, 3, axis=0), np.repeat(v, 3, axis=0))  # heads 0,1,2 -> kv 0; 3,4,5 -> 1
    np.testing.assert_allclose(o, o_rep, **TOL)
    o_tiled, _ = tiled_attention(q, k, v, block_m=3, block_n=3)
    np.testing.assert_allclose(o_tiled, o_rep, **TOL)
    # and not the interleaved reading h % Hk
    o_wrong, _ = attention(q, np.tile(k, (3, 1, 1)), np.tile(v, (3, 1, 1)))
    assert not np.allclose(o, o_wrong)


def test_lse_is_the_natural_log_sum_exp_of_scaled_scores():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, 4, 6), randn(rng, 7, 6), randn(rng, 7, 2)
    _, lse = tiled_attention(q, k, v, block_m=2, block_n=3, scale=0.7)
    for i in range(4):
        scores = [0.7 * float(q[i] @ k[j]) for j in range(7)]
        assert lse[i] == pytest.approx(math.log(math.fsum(math.exp(s) for s in scores)), rel=1e-12)


def test_default_scale_is_one_over_sqrt_d_and_scale_is_used():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (), 2, 2, 6, 6, 9)
    o_default, _ = tiled_attention(q, k, v, block_m=4, block_n=4)
    o_third, _ = tiled_attention(q, k, v, scale=1 / 3, block_m=4, block_n=4)
    np.testing.assert_allclose(o_default, o_third, **TOL)  # d = 9
    o_custom, lse_custom = tiled_attention(q, k, v, scale=2.5, block_m=4, block_n=4)
    o_ref, lse_ref = naive(q, k, v, scale=2.5)
    np.testing.assert_allclose(o_custom, o_ref, **TOL)
    np.testing.assert_allclose(lse_custom, lse_ref, **TOL)
    assert not np.allclose(o_custom, o_default)


def test_huge_scores_that_overflow_a_naive_exp():
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), 2, 2, 13, 21, 8, scale=60.0)  # scores of order 1e4
    s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(8)
    assert np.abs(s).max() > 5e3
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(s)).any()
    for causal in (False, True):
        o_ref, lse_ref = naive(q, k, v, causal)
        assert np.isfinite(o_ref).all()
        for fn_kwargs in ({}, {"block_m": 4, "block_n": 5}, {"block_m": 1, "block_n": 2}):
            fn = attention if not fn_kwargs else tiled_attention
            o, lse = fn(q, k, v, causal, **fn_kwargs)
            assert np.isfinite(o).all() and np.isfinite(lse).all()
            np.testing.assert_allclose(o, o_ref, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)


@pytest.mark.parametrize(
    "nq,nk,causal,window,empty_rows",
    [
        (7, 3, True, None, [0, 1, 2, 3]),  # more queries than keys: the first 4 rows see nothing
        (6, 6, False, (None, None), []),
        (5, 8, False, (0, 0), []),
        (8, 3, False, (0, 0), [0, 1, 2, 3, 4]),  # diagonal left of column 0 for the first 5 rows
        (6, 4, True, (1, None), [0, 1]),
    ],
)
def test_rows_with_no_visible_key_give_zeros_and_minus_inf(nq, nk, causal, window, empty_rows):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 2, 1, nq, nk, 5, 3)
    mask = brute_force_mask(nq, nk, causal, window)
    assert list(np.flatnonzero(~mask.any(axis=1))) == empty_rows
    o_ref, lse_ref = naive(q, k, v, causal, window)
    for o, lse in [
        attention(q, k, v, causal, window),
        tiled_attention(q, k, v, causal, window, block_m=2, block_n=2),
        tiled_attention(q, k, v, causal, window, block_m=3, block_n=1),
    ]:
        assert not np.isnan(o).any() and not np.isnan(lse).any()
        np.testing.assert_array_equal(o[..., empty_rows, :], 0.0)
        assert np.isneginf(lse[..., empty_rows]).all()
        np.testing.assert_allclose(o, o_ref, **TOL)
        np.testing.assert_allclose(lse, lse_ref, **TOL)


def test_dtypes():
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (), 2, 2, 5, 5, 4)
    o32, lse32 = tiled_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), block_m=2)
    assert o32.dtype == np.float32 and lse32.dtype == np.float32
    o64, _ = tiled_attention(q, k, v, block_m=2)
    assert o64.dtype == np.float64
    np.testing.assert_allclose(o32, o64, rtol=1e-5, atol=1e-6)
    o16, _ = attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    assert o16.dtype == np.float32  # computed in float64, returned no narrower than float32


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.sampled_from([(), (1,), (2,), (2, 1)]),
    hk=st.integers(1, 2),
    group=st.integers(1, 3),
    nq=st.integers(1, 17),
    nk=st.integers(1, 17),
    d=st.integers(1, 9),
    dv=st.integers(1, 6),
    block_m=st.integers(1, 9),
    block_n=st.integers(1, 9),
    causal=st.booleans(),
    window=st.one_of(
        st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 8)), st.one_of(st.none(), st.integers(0, 8)))
    ),
    magnitude=st.sampled_from([1.0, 4.0, 100.0]),
)
def test_property_tiled_equals_materialised_equals_naive(
    seed, batch, hk, group, nq, nk, d, dv, block_m, block_n, causal, window, magnitude
):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, batch, hk * group, hk, nq, nk, d, dv, scale=magnitude)
    o_ref, lse_ref = naive(q, k, v, causal, window)
    o, lse = attention(q, k, v, causal, window)
    ot, lset, tiles = tiled_attention(q, k, v, causal, window, block_m=block_m, block_n=block_n, return_tiles=True)
    tol = dict(rtol=1e-9, atol=1e-9 * magnitude**2)
    for oo, ll in ((o, lse), (ot, lset)):
        assert not np.isnan(oo).any() and not np.isnan(ll).any()
        np.testing.assert_allclose(oo, o_ref, **tol)
        np.testing.assert_allclose(ll, lse_ref, **tol)
    np.testing.assert_array_equal(tiles.state, tile_map(nq, nk, block_m, block_n, causal, window).state)


# ---------------------------------------------------------------------------------------------- skipped tiles


@pytest.mark.parametrize("nq,nk,bm,bn", [(64, 64, 8, 8), (50, 70, 7, 9), (33, 33, 16, 4)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3)), (True, (9, None))])
def test_recorded_tiles_equal_the_plan(nq, nk, bm, bn, causal, window):
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, (), 1, 1, nq, nk, 4)
    _, _, tiles = tiled_attention(q, k, v, causal, window, block_m=bm, block_n=bn, return_tiles=True)
    plan = tile_map(nq, nk, bm, bn, causal, window)
    np.testing.assert_array_equal(tiles.state, plan.state)
    assert (tiles.block_m, tiles.block_n, tiles.nq, tiles.nk) == (bm, bn, nq, nk)


def test_causal_skips_about_half_the_tiles():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (), 1, 1, 256, 256, 4)
    _, _, full = tiled_attention(q, k, v, block_m=16, block_n=16, return_tiles=True)
    _, _, causal = tiled_attention(q, k, v, causal=True, block_m=16, block_n=16, return_tiles=True)
    assert full.n_skipped == 0 and full.n_computed == 256
    assert causal.n_computed == 16 * 17 // 2  # the diagonal and below
    assert causal.fraction_computed == pytest.approx(17 / 32)


def _poisoning_as_heads(key_ranges, keys=True):
    """Wrap the loop's input preparation so the given key ranges of V (and of K, with ``keys``) hold NaN after
    validation."""
    real = tiled_module.as_heads

    def poisoned(q, k, v):
        q, k, v, shape, out_dtype = real(q, k, v)
        k, v = k.copy(), v.copy()
        for c0, c1 in key_ranges:
            if keys:
                k[..., c0:c1, :] = np.nan
            v[..., c0:c1, :] = np.nan
        return q, k, v, shape, out_dtype

    return poisoned


@pytest.mark.parametrize("nq,nk,window,bn", [(8, 40, (2, 0), 8), (5, 50, (3, 1), 6), (10, 64, (0, 0), 16)])
def test_poisoned_skipped_tiles_do_not_change_the_output(monkeypatch, nq, nk, window, bn):
    # A sliding window near the end of a long key sequence: key tiles far to the left are skipped by every query
    # tile. Fill them with NaN after input validation; had the loop loaded them at all, even under an element mask,
    # 0 * NaN in P @ V would poison the output.
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (2,), 2, 2, nq, nk, 4)
    plan = tile_map(nq, nk, 4, bn, window=window)
    skipped_cols = np.flatnonzero(plan.skipped.all(axis=0))
    assert len(skipped_cols) >= 2
    ranges = [(tj * bn, min((tj + 1) * bn, nk)) for tj in skipped_cols]
    o_clean, lse_clean = tiled_attention(q, k, v, window=window, block_m=4, block_n=bn)
    monkeypatch.setattr(tiled_module, "as_heads", _poisoning_as_heads(ranges))
    o, lse = tiled_attention(q, k, v, window=window, block_m=4, block_n=bn)
    assert np.isfinite(o).all()
    np.testing.assert_array_equal(o, o_clean)
    np.testing.assert_array_equal(lse, lse_clean)
    # the poison is real: the same NaN values in a tile the loop computes reach the rows that see them
    monkeypatch.setattr(tiled_module, "as_heads", _poisoning_as_heads([(nk - 1, nk)], keys=False))
    o_bad, _ = tiled_attention(q, k, v, window=window, block_m=4, block_n=bn)
    assert np.isnan(o_bad).any()


# ---------------------------------------------------------------------------------------------- merge_partials


def _chunks(nk, cuts):
    edges = [0, *sorted(set(cuts)), nk]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


@pytest.mark.parametrize("cuts", [[], [1], [5], [3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [10]])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (2, 1))])
def test_merge_partials_equals_unsplit_attention(cuts, causal, window):
    rng = np.random.default_rng(13)
    nq, nk = 9, 12
    q, k, v = qkv(rng, (2,), 3, 3, nq, nk, 5, 4)
    mask = brute_force_mask(nq, nk, causal, window)
    outs, lses = [], []
    for c0, c1 in _chunks(nk, cuts):
        o_c, lse_c = naive_from_mask(q, k[..., c0:c1, :], v[..., c0:c1, :], mask[:, c0:c1], 1 / math.sqrt(5))
        outs.append(o_c)
        lses.append(lse_c)
    o, lse = merge_partials(outs, lses)
    o_ref, lse_ref = attention(q, k, v, causal, window)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(lse, lse_ref, **TOL)
    if causal and cuts == [10]:
        assert np.isneginf(lses[1][..., :7]).all()  # the last chunk is empty for the first rows, and adds nothing


def test_merge_partials_of_reference_chunks_without_a_mask():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, (), 2, 1, 4, 23, 6)
    parts = [attention(q, k[..., a:b, :], v[..., a:b, :]) for a, b in _chunks(23, [4, 5, 17])]
    o, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    o_ref, lse_ref = naive(q, k, v)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(lse, lse_ref, **TOL)
    # chunks stacked in one array work too
    o2, _ = merge_partials(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    np.testing.assert_allclose(o2, o_ref, **TOL)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    nq=st.integers(1, 8),
    nk=st.integers(1, 20),
    cuts=st.lists(st.integers(1, 19), max_size=5),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 5)),
    magnitude=st.sampled_from([1.0, 100.0]),
)
def test_property_merge_any_split(seed, nq, nk, cuts, causal, left, magnitude):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, (), 2, 2, nq, nk, 3, 2, scale=magnitude)
    window = (left, None)
    mask = brute_force_mask(nq, nk, causal, window)
    parts = [
        naive_from_mask(q, k[..., a:b, :], v[..., a:b, :], mask[:, a:b], 1 / math.sqrt(3))
        for a, b in _chunks(nk, [c for c in cuts if c < nk])
    ]
    o, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    o_ref, lse_ref = tiled_attention(q, k, v, causal, window, block_m=3, block_n=4)
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, o_ref, rtol=1e-9, atol=1e-9 * magnitude**2)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-9, atol=1e-9 * magnitude**2)


def test_merge_rows_empty_in_every_chunk():
    o, lse = merge_partials([np.ones((3, 2)), np.zeros((3, 2))], [np.array([0.0, -np.inf, -np.inf])] * 2)
    np.testing.assert_allclose(o, [[0.5, 0.5], [0, 0], [0, 0]])
    np.testing.assert_array_equal(lse, [math.log(2), -np.inf, -np.inf])


def test_merge_weights_by_share_of_the_sum():
    # chunk sums e^0 = 1 and e^(log 3) = 3: weights 1/4 and 3/4
    o, lse = merge_partials([np.array([[4.0]]), np.array([[8.0]])], [np.array([0.0]), np.array([math.log(3)])])
    assert o[0, 0] == pytest.approx(7.0) and lse[0] == pytest.approx(math.log(4))


def test_merge_huge_lse_does_not_overflow():
    o, lse = merge_partials([np.array([[1.0]]), np.array([[3.0]])], [np.array([1e4]), np.array([1e4])])
    assert o[0, 0] == pytest.approx(2.0) and lse[0] == pytest.approx(1e4 + math.log(2))


def test_merge_single_partial_is_itself():
    rng = np.random.default_rng(15)
    o_in, lse_in = randn(rng, 4, 3), randn(rng, 4)
    o, lse = merge_partials([o_in], [lse_in])
    np.testing.assert_allclose(o, o_in, **TOL)
    np.testing.assert_allclose(lse, lse_in, **TOL)


def test_merge_bad_input():
    o, lse = np.zeros((3, 2)), np.zeros(3)
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([], [])
    with pytest.raises(ValueError, match="2 outputs but 1"):
        merge_partials([o, o], [lse])
    with pytest.raises(ValueError, match="shape"):
        merge_partials([o, np.zeros((4, 2))], [lse, np.zeros(4)])
    with pytest.raises(ValueError, match="lse of shape"):
        merge_partials([o], [np.zeros(2)])
    with pytest.raises(ValueError, match="NaN"):
        merge_partials([o], [np.array([0.0, np.nan, 0.0])])
    with pytest.raises(ValueError, match=r"\+inf"):
        merge_partials([o], [np.array([0.0, np.inf, 0.0])])
    with pytest.raises(ValueError, match="NaN"):
        merge_partials([np.full((3, 2), np.nan)], [lse])


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn", [attention, tiled_attention])
def test_bad_shapes_raise_value_error(fn):
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, (2,), 4, 2, 5, 6, 3)
    cases = [
        ((q, k[..., :2], v), "head dim"),  # D differs between q and k
        ((q, k, v[..., :5, :]), "k and v"),  # Nk differs between k and v
        ((q, k, v[:1]), "k and v"),
        ((q[:1], k, v), "batch"),
        ((q[..., :3, :, :], k, v), "multiple of key/value heads"),  # 3 query heads over 2 kv heads
        ((q, k[0], v[0]), "number of dims"),
        ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), "at least 2 dims"),
        ((np.zeros((0, 3)), np.zeros((4, 3)), np.zeros((4, 3))), "Nq"),
        ((np.zeros((2, 3)), np.zeros((0, 3)), np.zeros((0, 3))), "Nk"),
        ((np.zeros((2, 0)), np.zeros((4, 0)), np.zeros((4, 0))), "D"),
        ((np.zeros((2, 3)), np.zeros((4, 3)), np.zeros((4, 0))), "Dv"),
        ((np.zeros((0, 2, 2, 3)), np.zeros((0, 2, 4, 3)), np.zeros((0, 2, 4, 3))), "empty"),
        ((np.zeros((1, 0, 2, 3)), np.zeros((1, 0, 4, 3)), np.zeros((1, 0, 4, 3))), "empty"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(*args)


@pytest.mark.parametrize("fn", [attention, tiled_attention])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", [0, 1])
def test_non_finite_queries_and_keys_raise(fn, bad, which):
    rng = np.random.default_rng(17)
    args = list(qkv(rng, (), 1, 1, 4, 4, 3))
    args[which][0, 1, 2] = bad
    with pytest.raises(ValueError, match=f"{'qkv'[which]} contains NaN or inf"):
        fn(*args)


@pytest.mark.parametrize("fn", [attention, tiled_attention])
def test_non_numeric_inputs_raise_type_error(fn):
    x = np.zeros((3, 2))
    with pytest.raises(TypeError, match="real numbers"):
        fn(x.astype(complex), x, x)
    with pytest.raises(TypeError, match="real numbers"):
        fn(x, np.array([["a", "b"]] * 3), x)


@pytest.mark.parametrize("fn", [attention, tiled_attention])
@pytest.mark.parametrize("window", [(-1, 0), (0, 1.5), 4, (1, 2, 3)])
def test_bad_window_raises(fn, window):
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="window"):
        fn(x, x, x, window=window)


@pytest.mark.parametrize("scale", [np.nan, np.inf])
def test_bad_scale_raises(scale):
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="scale"):
        tiled_attention(x, x, x, scale=scale)


@pytest.mark.parametrize("block", [0, -3, 1.5, True, None, "8"])
def test_bad_block_sizes_raise(block):
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="block_m"):
        tiled_attention(x, x, x, block_m=block)
    with pytest.raises(ValueError, match="block_n"):
        tiled_attention(x, x, x, block_n=block)
    with pytest.raises(ValueError, match="block_size"):
        online_softmax([1.0, 2.0], block)
    with pytest.raises(ValueError, match="block_size"):
        online_attention([1.0, 2.0], [1.0, 2.0], block)


def test_numpy_integer_block_sizes_are_fine():
    x = np.ones((5, 2))
    o, _ = tiled_attention(x, x, x, block_m=np.int64(2), block_n=np.int32(3))
    np.testing.assert_allclose(o, np.ones((5, 2)), **TOL)
    probs, _ = online_softmax([1.0, 1.0], np.int64(1))
    np.testing.assert_allclose(probs, [0.5, 0.5])


def test_online_softmax_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        online_softmax([1.0, np.nan], 1)
    with pytest.raises(ValueError, match=r"\+inf"):
        online_softmax([1.0, np.inf], 1)
    with pytest.raises(ValueError, match="empty"):
        online_softmax([], 1)
    with pytest.raises(ValueError, match="one row"):
        online_softmax(np.zeros((2, 2)), 1)
    with pytest.raises(TypeError, match="real numbers"):
        online_softmax(["a", "b"], 1)
    with pytest.raises(TypeError, match="real numbers"):
        online_softmax(np.array([1j, 2]), 1)
    with pytest.raises(ValueError, match="values must have shape"):
        online_attention([1.0, 2.0], [1.0, 2.0, 3.0], 1)
    with pytest.raises(ValueError, match="values must have shape"):
        online_attention([1.0, 2.0], np.zeros((2, 2, 2)), 1)
    with pytest.raises(ValueError, match="NaN"):
        online_attention([1.0, np.nan], [1.0, 2.0], 1)


def test_softmax_bad_input():
    with pytest.raises(ValueError, match=r"\+inf"):
        softmax([0.0, np.inf])
    with pytest.raises(ValueError, match="NaN"):
        softmax([0.0, np.nan])
    with pytest.raises(TypeError, match="real numbers"):
        softmax(np.array([1j]))


# ---------------------------------------------------------------------------------------------- inf and NaN in V


def v_with_bad_rows(v, nk):
    """A copy of v (..., Nk, Dv) with NaN in the last key's row, +inf and -inf in two entries near the end."""
    v = v.copy()
    v[..., nk - 1, :] = np.nan
    v[..., nk - 3, 1] = np.inf
    v[..., nk - 4, 2] = -np.inf
    return v


@pytest.mark.parametrize("fn", [attention, tiled_attention])
@pytest.mark.parametrize("nq, nk, causal, window", [(9, 9, True, None), (6, 11, True, None), (8, 12, False, (2, 1))])
def test_inf_and_nan_in_v_reach_only_the_rows_that_see_them(fn, nq, nk, causal, window):
    # A hidden key has probability exactly 0; 0 * inf = NaN in a plain P @ V would spread a bad V row to every
    # query. Expected, built by hand: each row's output, over its visible keys only, with IEEE arithmetic.
    rng = np.random.default_rng(30)
    q, k, v = qkv(rng, (2,), 2, 1, nq, nk, 3)
    v_bad = v_with_bad_rows(v, nk)
    o, lse = fn(q, k, v_bad, causal=causal, window=window)
    o_clean, lse_clean = fn(q, k, v, causal=causal, window=window)
    np.testing.assert_array_equal(lse, lse_clean)  # V never touches the softmax
    mask = visible_mask(nq, nk, causal, window)  # (Nq, Nk)
    for i in range(nq):
        seen = np.flatnonzero(mask[i])
        sees_nan = (nk - 1) in seen
        sees_pos, sees_neg = (nk - 3) in seen, (nk - 4) in seen
        row = o[..., i, :]  # (B, Hq, Dv)
        if not (sees_nan or sees_pos or sees_neg):
            np.testing.assert_array_equal(row, o_clean[..., i, :])
            continue
        if sees_nan:
            assert np.isnan(row).all()
            continue
        assert (np.isposinf(row[..., 1]) if sees_pos else np.isfinite(row[..., 1])).all()
        assert (np.isneginf(row[..., 2]) if sees_neg else np.isfinite(row[..., 2])).all()
        np.testing.assert_array_equal(row[..., 0], o_clean[..., i, 0])
    assert np.isfinite(o[..., 0, :]).all()  # the first row sees none of the bad keys in every case here


def test_tiled_and_materialised_agree_on_bad_v_and_every_tile_size():
    rng = np.random.default_rng(31)
    q, k, v = qkv(rng, (), 3, 3, 13, 17, 4)
    v_bad = v_with_bad_rows(v, 17)
    ref, _ = attention(q, k, v_bad, causal=True)
    for bm, bn in [(1, 1), (4, 3), (5, 8), (16, 16)]:
        o, _ = tiled_attention(q, k, v_bad, causal=True, block_m=bm, block_n=bn)
        np.testing.assert_array_equal(np.isnan(o), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(o), np.isinf(ref))
        np.testing.assert_allclose(o[np.isfinite(ref)], ref[np.isfinite(ref)], **TOL)


def test_weighted_values_is_p_at_v_where_no_zero_meets_inf():
    from flashlab.reference.attention import weighted_values

    rng = np.random.default_rng(32)
    p = rng.random((5, 6)) * (rng.random((5, 6)) > 0.4)  # some exact zeros
    v = rng.standard_normal((6, 3))
    np.testing.assert_allclose(weighted_values(p, v), p @ v, rtol=1e-15)
    v[2, 0], v[4, 0], v[3, 1] = np.inf, -np.inf, np.nan
    out = weighted_values(p, v)
    for i in range(5):  # by hand, one term at a time, skipping zero weights
        for j in range(3):
            terms = [p[i, t] * v[t, j] for t in range(6) if p[i, t] > 0]
            with np.errstate(invalid="ignore"):  # inf + -inf = NaN, as intended
                expected = sum(terms) if terms else 0.0
            assert (np.isnan(out[i, j]) and np.isnan(expected)) or out[i, j] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------- argument types


@pytest.mark.parametrize("fn", [attention, tiled_attention])
@pytest.mark.parametrize("causal", ["yes", 1, None])
def test_causal_must_be_a_bool(fn, causal):
    x = np.zeros((3, 2))
    with pytest.raises(TypeError, match="causal must be True or False"):
        fn(x, x, x, causal=causal)


@pytest.mark.parametrize("fn", [attention, tiled_attention])
def test_scale_too_large_for_a_float_is_a_value_error(fn):
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="scale"):
        fn(x, x, x, scale=10**400)
    with pytest.raises(TypeError, match="scale"):
        fn(x, x, x, scale="0.5")


@pytest.mark.parametrize("fn", [attention, tiled_attention])
def test_numpy_scale_and_window_sides_are_accepted(fn):
    rng = np.random.default_rng(33)
    q, k, v = qkv(rng, (), 2, 2, 7, 9, 4)
    expected, _ = fn(q, k, v, window=(3, 1), scale=0.25)
    got, _ = fn(q, k, v, window=(np.int64(3), np.int32(1)), scale=np.float32(0.25))
    np.testing.assert_array_equal(got, expected)
    wide, _ = fn(q, k, v, window=(2**63, 2**64))  # wider than the matrix: no window at all
    np.testing.assert_array_equal(wide, fn(q, k, v)[0])
