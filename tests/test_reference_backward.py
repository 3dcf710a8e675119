"""flashlab.reference's backward: both gradients against torch.autograd in float64, and the tiled loop's promises.

- ``attention_backward`` (P, dP, dS whole) and ``tiled_attention_backward`` (FlashAttention-2's two passes) against
  autograd through ``attention_float64`` on awkward shapes: odd N, Nq != Nk, GQA, causal, windows, odd head dims;
- ``attention_backward`` against ``torch.autograd.gradcheck`` (finite differences of the forward) on a tiny case;
- the tiled loop never builds more than one block_m x block_n tile of P, skips the tiles the mask hides, and
  delta = rowsum(dO * O) is rowsum(P * dP);
- rows that see no key get zero gradient, and bad input raises a clear error.
"""

from __future__ import annotations

import importlib
import tracemalloc

import numpy as np
import pytest
import torch

from flashlab.core.masking import visible_mask
from flashlab.reference import (
    attention,
    attention_backward,
    backward_delta,
    tiled_attention,
    tiled_attention_backward,
)
from flashlab.reference.torch_float64 import attention_float64

backward_module = importlib.import_module("flashlab.reference.backward")

TOL = dict(rtol=1e-10, atol=1e-12)


def autograd_grads(do, q, k, v, causal=False, window=None, scale=None):
    """(dq, dk, dv) from torch.autograd through the float64 torch reference, as NumPy arrays."""
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    o, _ = attention_float64(qt, kt, vt, causal, window, scale)
    o.backward(torch.tensor(do, dtype=torch.float64))
    return qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()


def problem(rng, b, hq, hk, nq, nk, d, dv=None):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, hq, nq, d))  # (B, Hq, Nq, D)
    k = rng.standard_normal((b, hk, nk, d))  # (B, Hk, Nk, D)
    v = rng.standard_normal((b, hk, nk, dv))  # (B, Hk, Nk, Dv)
    do = rng.standard_normal((b, hq, nq, dv))  # (B, Hq, Nq, Dv)
    return do, q, k, v


def random_case(rng):
    """Awkward shapes: odd lengths, Nq != Nk (either way), GQA groups, odd head dims, every kind of mask."""
    hk = int(rng.integers(1, 3))
    hq = hk * int(rng.choice([1, 2, 3]))
    nq, nk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    d, dv = int(rng.choice([1, 3, 5, 8, 13])), int(rng.choice([1, 4, 7]))
    mask = int(rng.integers(0, 4))
    causal = mask in (1, 3)
    window = None
    if mask >= 2:
        window = (int(rng.integers(0, 9)), None if rng.random() < 0.3 else int(rng.integers(0, 5)))
    scale = None if rng.random() < 0.5 else float(rng.uniform(0.05, 1.5))
    bm, bn = int(rng.integers(1, 17)), int(rng.integers(1, 17))
    return (hq, hk, nq, nk, d, dv, causal, window, scale, bm, bn)


@pytest.mark.parametrize("seed", range(30))
def test_both_backwards_equal_autograd_on_random_awkward_shapes(seed):
    rng = np.random.default_rng(1000 + seed)
    hq, hk, nq, nk, d, dv, causal, window, scale, bm, bn = case = random_case(rng)
    do, q, k, v = problem(rng, int(rng.integers(1, 3)), hq, hk, nq, nk, d, dv)
    want = autograd_grads(do, q, k, v, causal, window, scale)
    got = attention_backward(do, q, k, v, causal, window, scale)
    o, lse = attention(q, k, v, causal, window, scale)
    tiled = tiled_attention_backward(do, q, k, v, o, lse, causal, window, scale, block_m=bm, block_n=bn)
    for name, w, g, t in zip(("dq", "dk", "dv"), want, got, tiled, strict=True):
        assert g.shape == t.shape == w.shape, (name, case)
        np.testing.assert_allclose(g, w, **TOL, err_msg=f"materialised {name} {case}")
        np.testing.assert_allclose(t, w, **TOL, err_msg=f"tiled {name} {case}")


@pytest.mark.parametrize(
    "hq,hk,nq,nk,d,causal,window",
    [
        (4, 2, 33, 33, 16, True, None),  # GQA, causal, tiles cut the diagonal
        (2, 1, 17, 45, 9, True, None),  # Nq < Nk: the last query sees every key
        (2, 2, 45, 17, 9, True, None),  # Nq > Nk: the first 28 rows see no key
        (3, 1, 29, 37, 24, False, (5, 2)),  # sliding window, both sides bounded
        (1, 1, 1, 50, 8, True, None),  # decode: one query row
    ],
)
def test_tiled_backward_against_autograd_named_cases(hq, hk, nq, nk, d, causal, window):
    rng = np.random.default_rng(7)
    do, q, k, v = problem(rng, 2, hq, hk, nq, nk, d)
    want = autograd_grads(do, q, k, v, causal, window)
    o, lse = tiled_attention(q, k, v, causal, window, block_m=8, block_n=8)  # the tiled forward saves o, lse
    for bm, bn in ((8, 8), (1, 1), (5, 11), (64, 64)):
        got = tiled_attention_backward(do, q, k, v, o, lse, causal, window, block_m=bm, block_n=bn)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, **TOL)


def test_unbatched_and_float32_inputs_keep_their_shapes_and_dtype():
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal(s) for s in ((6, 4), (9, 4), (9, 3), (6, 3)))  # one head: (N, D)
    want = autograd_grads(do[None, None], q[None, None], k[None, None], v[None, None], causal=True)
    o, lse = attention(q, k, v, causal=True)
    for got in (
        attention_backward(do, q, k, v, causal=True),
        tiled_attention_backward(do, q, k, v, o, lse, causal=True, block_m=4, block_n=4),
    ):
        for w, g, x in zip(want, got, (q, k, v), strict=True):
            assert g.shape == x.shape and g.dtype == np.float64
            np.testing.assert_allclose(g, w[0, 0], **TOL)
    f32 = attention_backward(do.astype(np.float32), q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert all(g.dtype == np.float32 for g in f32)


class _MaterialisedAttention(torch.autograd.Function):
    """The NumPy forward with the NumPy backward: gradcheck compares the backward with finite differences."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window):
        ctx.save_for_backward(q, k, v)
        ctx.mask = (causal, window)
        o, _ = attention(q.numpy(), k.numpy(), v.numpy(), causal, window)
        return torch.from_numpy(o)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        grads = attention_backward(do.numpy(), q.numpy(), k.numpy(), v.numpy(), *ctx.mask)
        return (*(torch.from_numpy(g) for g in grads), None, None)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (1, 1))])
def test_materialised_backward_passes_gradcheck(causal, window):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)  # (B, Hq, Nq, D)
    k = torch.randn(1, 1, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)  # GQA: one K/V head
    v = torch.randn(1, 1, 5, 2, dtype=torch.float64, generator=gen, requires_grad=True)  # Dv != D
    assert torch.autograd.gradcheck(lambda q, k, v: _MaterialisedAttention.apply(q, k, v, causal, window), (q, k, v))


def test_delta_from_o_equals_rowsum_of_p_times_dp():
    # The identity that lets the backward skip a pass over P: rowsum(dO * O) = rowsum(P * dP), with P, dP
    # written out here from the definition.
    rng = np.random.default_rng(11)
    do, q, k, v = problem(rng, 1, 3, 3, 21, 30, 7, 5)
    mask = visible_mask(21, 30, causal=True)
    s = np.where(mask, q @ k.swapaxes(-1, -2) / np.sqrt(7), -np.inf)  # (B, H, Nq, Nk)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)  # (B, H, Nq, Nk)
    o, _ = attention(q, k, v, causal=True)
    from_p = (p * dp).sum(-1)  # (B, H, Nq)
    np.testing.assert_allclose(backward_delta(do, o), from_p, **TOL)
    np.testing.assert_allclose((do * (p @ v)).sum(-1), from_p, **TOL)
    assert not np.allclose(from_p, 0)  # the identity is not 0 = 0


class _SpyNumPy:
    """Stands in for ``np`` inside the backward module and records the shape of every array ``np.exp`` makes
    (each one is a tile of P being recomputed)."""

    def __init__(self):
        self.exp_shapes = []

    def __getattr__(self, name):
        return getattr(np, name)

    def exp(self, x, *args, **kwargs):
        out = np.exp(x, *args, **kwargs)
        self.exp_shapes.append(np.shape(out))
        return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (6, 0))])
def test_tiled_backward_recomputes_p_one_tile_at_a_time_and_skips_hidden_tiles(monkeypatch, causal, window):
    from flashlab.core.masking import tile_map

    rng = np.random.default_rng(5)
    b, hq, hk, nq, nk, bm, bn = 2, 4, 2, 37, 41, 8, 6
    do, q, k, v = problem(rng, b, hq, hk, nq, nk, 5)
    o, lse = attention(q, k, v, causal, window)
    spy = _SpyNumPy()
    monkeypatch.setattr(backward_module, "np", spy)
    tiled_attention_backward(do, q, k, v, o, lse, causal, window, block_m=bm, block_n=bn)
    monkeypatch.undo()
    assert spy.exp_shapes, "the backward never recomputed P"
    for shape in spy.exp_shapes:  # (B * Hk, rows, keys): at most one tile's worth, never a whole row of P
        assert shape[0] == b * hk and shape[1] <= bm and shape[2] <= bn, shape
    # each computed tile's P is recomputed once per pass (dK/dV, then dQ), for each of a K/V head's query heads
    plan = tile_map(nq, nk, bm, bn, causal, window)
    assert len(spy.exp_shapes) == 2 * (hq // hk) * plan.n_computed
    if causal or window:
        assert plan.n_skipped > 0


def test_tiled_backward_memory_does_not_grow_with_n_squared():
    # One head, N = 1536: the materialised backward holds several N x N float64 arrays (18.9 MB each); the tiled
    # one holds inputs and gradients of size N x D and a few 32 x 32 tiles.
    rng = np.random.default_rng(2)
    n, d, block = 1536, 8, 32
    do, q, k, v = problem(rng, 1, 1, 1, n, n, d)
    o, lse = attention(q, k, v)
    score_matrix = n * n * 8

    def peak_bytes(fn):
        tracemalloc.start()
        tracemalloc.reset_peak()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    tiled = peak_bytes(lambda: tiled_attention_backward(do, q, k, v, o, lse, block_m=block, block_n=block))
    whole = peak_bytes(lambda: attention_backward(do, q, k, v))
    assert whole > 2 * score_matrix  # the measurement sees N^2 arrays when there are some
    assert tiled < 40 * n * d * 8 + 40 * block * block * 8 < score_matrix / 4, (tiled, score_matrix)


def test_rows_that_see_no_key_get_zero_gradient_not_nan():
    rng = np.random.default_rng(4)
    do, q, k, v = problem(rng, 1, 2, 1, 12, 4, 6)  # causal with Nq = 12 > Nk = 4: rows 0..7 see nothing
    o, lse = attention(q, k, v, causal=True)
    assert np.isneginf(lse[..., :8]).all()
    for dq, dk, dv in (
        attention_backward(do, q, k, v, causal=True),
        tiled_attention_backward(do, q, k, v, o, lse, causal=True, block_m=3, block_n=3),
    ):
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        np.testing.assert_array_equal(dq[..., :8, :], 0.0)
        assert np.abs(dq[..., 8:, :]).max() > 0
    # the empty rows' dO adds nothing to dK, dV: change it and they stay the same
    do2 = do.copy()
    do2[..., :8, :] = 100.0
    for a, b in zip(attention_backward(do, q, k, v, True), attention_backward(do2, q, k, v, True), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_bad_input_raises_clear_errors():
    rng = np.random.default_rng(0)
    do, q, k, v = problem(rng, 1, 2, 2, 5, 6, 4)
    o, lse = attention(q, k, v)
    with pytest.raises(ValueError, match=r"do must have shape \(1, 2, 5, 4\)"):
        attention_backward(do[..., :3], q, k, v)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 5\)"):
        tiled_attention_backward(do, q, k, v, o, lse[..., :4])
    bad = lse.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="lse contains NaN"):
        tiled_attention_backward(do, q, k, v, o, bad)
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        tiled_attention_backward(do, q, k, v, o, lse, block_n=0)
    with pytest.raises(ValueError, match="do contains NaN"):
        attention_backward(np.full_like(do, np.nan), q, k, v)
    with pytest.raises(ValueError, match="query heads"):
        attention_backward(do, q, k[:, :1].repeat(3, axis=1)[:, :3], v[:, :1].repeat(3, axis=1)[:, :3])
