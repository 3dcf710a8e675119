"""Exercises for notebook 09 (the backward pass): one tile's backward step, and delta = rowsum(dO * O).

FlashAttention-2's backward recomputes each tile of P from Q, K and the forward's log-sum-exp, and from that tile
alone it gets the tile's share of every gradient. The one quantity that needs a whole row is delta, which it
computes first, from dO and O.
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_array, unpack
from flashlab.reference import attention, attention_backward

EXERCISES = [
    Exercise(
        id="09.delta",
        title="delta = rowsum(dO * O): the softmax backward's row term, without P",
        signature="do, o",
        doc="""
        The one number per query row that the backward pass of the softmax needs.

        do  (..., N, Dv)  gradient of the loss with respect to the attention output
        o   (..., N, Dv)  the attention output the forward pass saved

        Returns delta, shape (..., N): delta_i = sum over j of P_ij dP_ij, where dP = dO V^T. Because O = P V,
        that sum equals the dot product of row i of dO with row i of O -- so compute it from do and o alone,
        never forming an N x N matrix. Use NumPy; calling flashlab's own implementation scores 0. Do not change
        the inputs in place.
        """,
    ),
    Exercise(
        id="09.tile_backward",
        title="the backward of one tile: dS, and the tile's shares of dQ, dK and dV",
        signature="p, do, q, k, v, delta, scale",
        doc="""
        One step of FlashAttention-2's backward: one tile of query rows meets one tile of keys.

        p      (bm, bn)  this tile of the probabilities P, recomputed as exp(S - lse); 0 where masked
        do     (bm, Dv)  the tile's rows of dO         q  (bm, D)   the tile's rows of Q
        k      (bn, D)   the tile's keys               v  (bn, Dv)  the tile's values
        delta  (bm,)     rowsum(dO * O) of the tile's rows, computed over the WHOLE row beforehand
        scale  float     the softmax scale (S = Q K^T * scale)

        Returns (ds, dq, dk, dv):
          ds (bm, bn) = P * (dP - delta) with dP = dO V^T (delta subtracted from every column of its row)
          dq (bm, D)  = scale * dS K     -- this tile's contribution to dQ of these rows
          dk (bn, D)  = scale * dS^T Q   -- this tile's contribution to dK of these keys
          dv (bn, Dv) = P^T dO           -- this tile's contribution to dV of these keys
        Summed over all tiles, the contributions are the full gradients. Use the delta you are given: the
        tile holds only part of each row, so delta cannot be computed from it. Use NumPy; calling flashlab's
        own implementation scores 0. Do not change the inputs in place.
        """,
    ),
]


def _problem(rng, nq, nk, d, dv, causal=False):
    q = rng.standard_normal((nq, d))
    k = rng.standard_normal((nk, d))
    v = rng.standard_normal((nk, dv))
    do = rng.standard_normal((nq, dv))
    o, lse = attention(q, k, v, causal=causal)
    return q, k, v, do, o, lse


# -- 09.delta ---------------------------------------------------------------------------------------------------


def _probabilities(q, k, lse):
    """P of one head, from the scores and the log-sum-exp (rows that see nothing: zeros)."""
    s = q @ k.T / np.sqrt(q.shape[-1])  # (Nq, Nk)
    return np.exp(s - np.where(np.isneginf(lse), 0.0, lse)[:, None])


@graded("09.delta", 2)
def test_delta_equals_rowsum_p_dp(answer):
    """on a fresh random problem, rowsum(dO * O) equals rowsum(P * dP) built from the whole P"""
    rng = np.random.default_rng()
    nq, nk, d, dv = (int(x) for x in rng.integers([3, 3, 2, 1], [40, 50, 20, 12]))
    q, k, v, do, o, lse = _problem(rng, nq, nk, d, dv)
    p = _probabilities(q, k, lse)  # (Nq, Nk)
    want = (p * (do @ v.T)).sum(axis=-1)  # (Nq,) the definition
    got = answer(do.copy(), o.copy())
    expect_array(got, want, f"delta for N = {nq}, Dv = {dv}", rtol=1e-9, atol=1e-11)


@graded("09.delta", 1)
def test_delta_batched_heads(answer):
    """leading batch and head dims: one delta per row of every head, shape (B, H, N)"""
    rng = np.random.default_rng()
    do, o = rng.standard_normal((2, 3, 17, 5)), rng.standard_normal((2, 3, 17, 5))
    got = answer(do.copy(), o.copy())
    expect_array(got, np.einsum("bhnd,bhnd->bhn", do, o), "delta for do, o of shape (2, 3, 17, 5)")


@graded("09.delta", 1, gate=True)
def test_delta_without_an_n_by_n_matrix(answer):
    """N = 3,000 rows: delta needs two N x Dv arrays and N numbers, not an N x N matrix (72 MB of float64)"""
    rng = np.random.default_rng()
    n, dv = 3000, 4
    do, o = rng.standard_normal((n, dv)), rng.standard_normal((n, dv))
    want = (do * o).sum(axis=-1)
    # peak: the process's high-water mark up to the end of the call, less its memory before the cell ran and
    # less the inputs (read by the grader from the kernel)
    got, peak = answer.measure(do, o)
    expect_array(got, want, f"delta for N = {n}")
    bound = n * n * 8 // 8  # an eighth of the N x N matrix: room for copies of the inputs, not for P
    if peak > bound:
        raise AssertionError(
            f"for N = {n}, Dv = {dv} your process's peak memory, up to the end of this call, was {peak / 1e6:.1f} "
            f"MB above where it stood before your cell ran, not counting the {(do.nbytes + o.nbytes) / 1e6:.2f} MB "
            "of dO and O (memory your cell or an earlier call touched counts too); an N x N matrix is "
            f"{n * n * 8 / 1e6:.0f} MB: it built something N x N -- multiply dO and O element by element and sum "
            "each row"
        )


@graded("09.delta", 1)
def test_delta_rows_that_see_nothing(answer):
    """a row whose output is zeros (it saw no key) has delta 0, whatever its dO"""
    rng = np.random.default_rng()
    q, k, v, do, o, lse = _problem(rng, 9, 4, 3, 2, causal=True)  # rows 0..4 see no key
    got = answer(do.copy(), o.copy())
    expect_array(got, (do * o).sum(axis=-1), "delta with empty rows")
    expect_array(np.asarray(got)[:5], np.zeros(5), "delta of the rows that see no key")


# -- 09.tile_backward -------------------------------------------------------------------------------------------


def _call_tile(answer, p, do, q, k, v, delta, scale, what):
    args = [np.array(x, copy=True) for x in (p, do, q, k, v, delta)]
    return unpack(answer(*args, scale), 4, f"tile_backward(...) for {what}")


def _tile_want(p, do, q, k, v, delta, scale):
    ds = p * (do @ v.T - delta[:, None])
    return ds, scale * ds @ k, scale * ds.T @ q, p.T @ do


def _expect_tile(got, want, what):
    for name, g, w in zip(("ds", "dq", "dk", "dv"), got, want, strict=True):
        expect_array(g, w, f"{name} of {what}", rtol=1e-9, atol=1e-11)


@graded("09.tile_backward", 2)
def test_tile_one_random_tile(answer):
    """one random tile of a real problem: ds and each gradient's share"""
    rng = np.random.default_rng()
    q, k, v, do, o, lse = _problem(rng, 12, 20, 7, 5)
    scale = 1 / np.sqrt(7)
    p = _probabilities(q, k, lse)
    delta = (do * o).sum(axis=-1)
    r, c = slice(4, 10), slice(3, 11)  # a 6 x 8 tile in the middle
    got = _call_tile(answer, p[r, c], do[r], q[r], k[c], v[c], delta[r], scale, "a 6 x 8 tile")
    _expect_tile(got, _tile_want(p[r, c], do[r], q[r], k[c], v[c], delta[r], scale), "a 6 x 8 tile")


@graded("09.tile_backward", 1)
def test_tile_uses_the_given_delta(answer):
    """delta belongs to the whole row: a tile that holds part of the row cannot recompute it as rowsum(P * dP)"""
    rng = np.random.default_rng()
    q, k, v, do, o, lse = _problem(rng, 5, 30, 4, 3)
    scale = 0.5
    p = _probabilities(q, k, lse)
    delta = (do * o).sum(axis=-1)
    c = slice(0, 7)  # 7 of 30 keys: rowsum(P * dP) over this tile is not delta
    got = _call_tile(answer, p[:, c], do, q, k[c], v[c], delta, scale, "a tile of 7 of 30 keys")
    part = (p[:, c] * (do @ v[c].T)).sum(axis=-1)
    ds_from_tile = p[:, c] * (do @ v[c].T - part[:, None])
    if np.allclose(np.asarray(got[0], dtype=float), ds_from_tile) and not np.allclose(part, delta):
        raise AssertionError("ds used rowsum(P * dP) over this tile instead of the delta argument")
    _expect_tile(got, _tile_want(p[:, c], do, q, k[c], v[c], delta, scale), "a tile of 7 of 30 keys")


@graded("09.tile_backward", 2)
def test_tiles_add_up_to_the_gradients(answer):
    """run as the inner step of a tiled loop (causal, odd tiles): the shares sum to the full dQ, dK and dV"""
    rng = np.random.default_rng()
    nq, nk, d, dv, bm, bn = 13, 17, 6, 4, 4, 5
    q, k, v, do, o, lse = _problem(rng, nq, nk, d, dv, causal=True)
    scale = 1 / np.sqrt(d)
    s = q @ k.T * scale
    offset = nk - nq
    s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + offset, s, -np.inf)
    p = np.exp(s - lse[:, None])  # (Nq, Nk) zeros where masked
    delta = (do * o).sum(axis=-1)
    dq, dk, dv_ = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0 in range(0, nq, bm):
        r = slice(r0, min(r0 + bm, nq))
        for c0 in range(0, nk, bn):
            c = slice(c0, min(c0 + bn, nk))
            _, tq, tk, tv = _call_tile(answer, p[r, c], do[r], q[r], k[c], v[c], delta[r], scale, "a causal tile")
            dq[r] += np.asarray(tq, dtype=float)
            dk[c] += np.asarray(tk, dtype=float)
            dv_[c] += np.asarray(tv, dtype=float)
    want = attention_backward(do, q, k, v, causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv_), want, strict=True):
        expect_array(g, w, f"{name} summed over all {bm} x {bn} tiles", rtol=1e-8, atol=1e-10)


@graded("09.tile_backward", 1)
def test_tile_masked_entries_give_nothing(answer):
    """where the tile's P is 0 (masked), dS is 0 as well, whatever dP is"""
    rng = np.random.default_rng()
    p = rng.uniform(0.01, 0.2, (4, 6))
    p[np.triu_indices(4, 3, 6)] = 0.0  # the upper corner is masked
    do, q = rng.standard_normal((4, 3)), rng.standard_normal((4, 5))
    k, v = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    delta = rng.standard_normal(4)
    got = _call_tile(answer, p, do, q, k, v, delta, 0.3, "a tile with masked entries")
    _expect_tile(got, _tile_want(p, do, q, k, v, delta, 0.3), "a tile with masked entries")
    ds = np.asarray(got[0], dtype=float)
    if (ds[p == 0] != 0).any():
        raise AssertionError("ds is not 0 where P is 0: dS = P * (dP - delta), so masked entries stay 0")
