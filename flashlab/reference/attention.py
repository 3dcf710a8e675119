"""Attention the plain way: build the whole score matrix, softmax it, multiply by V.

    S = Q K^T * scale      (Nq, Nk)   -- the matrix FlashAttention never writes to memory
    P = softmax(S)         (Nq, Nk)
    O = P V                (Nq, Dv)

This is the definition every other implementation in flashlab must equal. It computes in float64.

A key a query cannot see (hidden by the causal or window mask) has probability exactly 0 for that query, and
contributes nothing to its output -- even if its row of V holds inf or NaN, where the plain product would give
0 * inf = NaN (``weighted_values``). Queries that can see such a row get inf or NaN, as IEEE arithmetic gives.
q and k must be finite.
"""

from __future__ import annotations

import numpy as np

from flashlab.core.checks import as_real
from flashlab.core.masking import visible_mask
from flashlab.core.shapes import AttentionShape, attention_shape


def as_heads(q, k, v):
    """Validate q/k/v and view them as ``(B, H, N, D)`` float64 arrays with K/V heads repeated for GQA.

    Returns ``(q, k, v, shape, out_dtype)``; ``B`` flattens the leading dims. q and k must be finite; v may hold
    inf or NaN (see the module docstring).
    """
    arrays = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        x = np.asarray(x)
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise TypeError(f"{name} must hold real numbers; got dtype {x.dtype}")
        arrays.append(x)
    q, k, v = arrays
    shape = attention_shape(q.shape, k.shape, v.shape)
    for name, x in (("q", q), ("k", k)):
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or inf")
    out_dtype = np.result_type(q.dtype, k.dtype, v.dtype, np.float32)
    b = int(np.prod(shape.batch, dtype=np.int64))
    q = q.astype(np.float64).reshape(b, shape.hq, shape.nq, shape.d)  # (B, Hq, Nq, D)
    k = k.astype(np.float64).reshape(b, shape.hk, shape.nk, shape.d)  # (B, Hk, Nk, D)
    v = v.astype(np.float64).reshape(b, shape.hk, shape.nk, shape.dv)  # (B, Hk, Nk, Dv)
    if shape.group > 1:  # GQA: query head h reads key head h // group
        k = np.repeat(k, shape.group, axis=1)  # (B, Hq, Nk, D)
        v = np.repeat(v, shape.group, axis=1)  # (B, Hq, Nk, Dv)
    return q, k, v, shape, out_dtype


def default_scale(d: int, scale=None) -> float:
    """The softmax scale: 1/sqrt(d) unless given (any finite real number, Python or NumPy)."""
    if scale is None:
        return 1.0 / np.sqrt(d)
    return as_real("scale", scale)


def weighted_values(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v`` over the last two axes, except that a weight of exactly 0 contributes nothing, even against an
    inf or NaN in ``v`` (where IEEE arithmetic gives 0 * inf = NaN). p ``(..., Nq, Nk)`` >= 0, v ``(..., Nk, Dv)``.

    The finite part of v goes through the ordinary product; for the non-finite entries, which keys each row gives
    a positive weight to decides the result: +inf, -inf, or NaN (a NaN, or both infinities).
    """
    finite = np.isfinite(v)
    if finite.all():
        return p @ v
    out = p @ np.where(finite, v, 0.0)  # (..., Nq, Dv): every finite term
    weighted = (p > 0).astype(np.float64)  # (..., Nq, Nk) the keys each row gives weight to
    pos = weighted @ (v == np.inf) > 0  # (..., Nq, Dv) a row weighs a +inf
    neg = weighted @ (v == -np.inf) > 0
    nan = (weighted @ np.isnan(v) > 0) | (pos & neg)
    return out + np.select([nan, pos, neg], [np.nan, np.inf, -np.inf], 0.0)


def attention(q, k, v, causal: bool = False, window=None, scale=None):
    """Materialised attention. Returns ``(o, lse)``.

    q ``(..., Hq, Nq, D)``, k/v ``(..., Hk, Nk, D)``; o ``(..., Hq, Nq, Dv)``; lse ``(..., Hq, Nq)`` is the natural
    log-sum-exp of each row's scaled, masked scores (-inf for a row that sees no key, whose output is zeros).
    See ``flashlab.core.masking`` for the causal / window convention.
    """
    ndim = np.ndim(q)
    qh, kh, vh, shape, out_dtype = as_heads(q, k, v)
    scale = default_scale(shape.d, scale)
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * scale  # (B, H, Nq, Nk): the score matrix
    mask = visible_mask(shape.nq, shape.nk, causal, window)  # (Nq, Nk)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    m = np.where(np.isneginf(m), 0.0, m)  # rows that see nothing
    p = np.exp(s - m)  # (B, H, Nq, Nk)
    l = p.sum(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    o = np.divide(weighted_values(p, vh), l, out=np.zeros(p.shape[:-1] + (shape.dv,)), where=l > 0)  # (B, H, Nq, Dv)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]  # (B, H, Nq); log 0 = -inf for empty rows
    return reshape_out(o, lse, shape, ndim, out_dtype)


def reshape_out(o, lse, shape: AttentionShape, ndim: int, out_dtype):
    """``(B, Hq, Nq, Dv)`` and ``(B, Hq, Nq)`` back to the caller's leading dims and dtype."""
    lead = () if ndim == 2 else shape.batch + (shape.hq,)
    o = o.reshape(lead + (shape.nq, shape.dv)).astype(out_dtype, copy=False)
    lse = lse.reshape(lead + (shape.nq,)).astype(out_dtype, copy=False)
    return o, lse
