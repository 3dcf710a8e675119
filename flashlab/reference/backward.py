"""The backward pass of attention in NumPy: the gradients written out whole, and FlashAttention-2's tiled loops.

The forward pass is ``S = Q K^T * scale``, ``P = softmax(S)`` (row by row, masked), ``O = P V``. Given the
gradient of the loss with respect to the output, ``dO``, the chain rule walks it back one line at a time:

    dV = P^T dO                    (Nk, Dv)  O = P V, so each key's value collects the rows that used it
    dP = dO V^T                    (Nq, Nk)
    dS = P * (dP - delta)          (Nq, Nk)  the softmax's Jacobian, row by row
    dQ = scale * dS K              (Nq, D)
    dK = scale * dS^T Q            (Nk, D)

with one number per query row, ``delta_i = sum_j P_ij dP_ij``. Because ``dP = dO V^T`` and ``O = P V``, that sum
is also ``sum_j P_ij (dO_i . V_j) = dO_i . (sum_j P_ij V_j) = dO_i . O_i``: ``delta = rowsum(dO * O)``, computed
from two (Nq, Dv) arrays the forward already produced, without a row of P.

- ``attention_backward`` -- the definition: P, dP and dS built whole, as an unfused implementation stores them.
- ``tiled_attention_backward`` -- what a FlashAttention-2 kernel does: delta first, then one pass over key tiles
  that accumulates dK and dV, then one pass over query tiles that accumulates dQ. Each pass *recomputes* its tile
  of P from Q, K and the forward's saved log-sum-exp (``P = exp(S - lse)``), so no (Nq, Nk) array ever exists;
  only one ``block_m x block_n`` tile of S, P, dP and dS at a time.

Shapes as ``flashlab.reference.attention``: q ``(..., Hq, Nq, D)``, k ``(..., Hk, Nk, D)``, v ``(..., Hk, Nk,
Dv)``, dO and O like ``(..., Hq, Nq, Dv)``, lse ``(..., Hq, Nq)``; with GQA (Hk < Hq) the gradient of a K/V head
is the sum over the query heads that read it. Masks follow ``flashlab.core.masking``; a query row that sees no key
has zero output, so its dQ is zero and it adds nothing to dK or dV. Everything computes in float64.
"""

from __future__ import annotations

import numpy as np

from flashlab.core.checks import as_count
from flashlab.core.integers import cdiv
from flashlab.core.masking import PARTIAL, SKIPPED, tile_state, visible_band, visible_mask
from flashlab.reference.attention import as_heads, default_scale


def _as_float64(name: str, x, want_shape: tuple, allow_neginf: bool = False) -> np.ndarray:
    """``x`` as a float64 array of ``want_shape``; ValueError naming ``name`` if the shape or values are wrong."""
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise TypeError(f"{name} must hold real numbers; got dtype {x.dtype}")
    if x.shape != tuple(want_shape):
        raise ValueError(f"{name} must have shape {tuple(want_shape)}; got {x.shape}")
    x = x.astype(np.float64)
    bad = np.isnan(x) | (np.isposinf(x) if allow_neginf else ~np.isfinite(x))
    if bad.any():
        what = "NaN or +inf" if allow_neginf else "NaN or inf"
        raise ValueError(f"{name} contains {what}")
    return x


def _check_block(name: str, b) -> None:
    as_count(name, b)


def attention_backward(do, q, k, v, causal: bool = False, window=None, scale=None):
    """Gradients of materialised attention. Returns ``(dq, dk, dv)``, shaped like q, k and v.

    ``do`` is the gradient of the loss with respect to the output ``o = attention(q, k, v, ...)[0]``, shaped like
    o. Builds the (Nq, Nk) matrices P, dP and dS whole -- what an unfused implementation keeps in memory for its
    backward -- and computes delta the long way, as ``rowsum(P * dP)``.
    """
    q_shape, k_shape, v_shape = np.shape(q), np.shape(k), np.shape(v)
    qh, kh, vh, shape, out_dtype = as_heads(q, k, v)  # (B, Hq, N, D), K/V repeated for GQA
    b = qh.shape[0]
    do = _as_float64("do", do, q_shape[:-1] + (shape.dv,)).reshape(b, shape.hq, shape.nq, shape.dv)
    scale = default_scale(shape.d, scale)

    # -- the forward, kept whole: S and P are (B, Hq, Nq, Nk)
    s = np.einsum("bhid,bhjd->bhij", qh, kh) * scale  # (B, Hq, Nq, Nk)
    s = np.where(visible_mask(shape.nq, shape.nk, causal, window), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (B, Hq, Nq, 1)
    p = np.exp(s - np.where(np.isneginf(m), 0.0, m))  # (B, Hq, Nq, Nk), zeros on rows that see no key
    l = p.sum(axis=-1, keepdims=True)  # (B, Hq, Nq, 1)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)  # softmax rows; a row that sees nothing stays zero

    # -- the chain rule, one line of the forward at a time
    dv = np.einsum("bhij,bhid->bhjd", p, do)  # (B, Hq, Nk, Dv)  dV = P^T dO
    dp = np.einsum("bhid,bhjd->bhij", do, vh)  # (B, Hq, Nq, Nk)  dP = dO V^T
    delta = (p * dp).sum(axis=-1, keepdims=True)  # (B, Hq, Nq, 1)  the definition: rowsum(P * dP)
    ds = p * (dp - delta)  # (B, Hq, Nq, Nk)  through the softmax
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, kh)  # (B, Hq, Nq, D)  dQ = scale dS K
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, qh)  # (B, Hq, Nk, D)  dK = scale dS^T Q

    # -- GQA: a K/V head's gradient is the sum over the query heads that read it
    dk = dk.reshape(b, shape.hk, shape.group, shape.nk, shape.d).sum(axis=2)  # (B, Hk, Nk, D)
    dv = dv.reshape(b, shape.hk, shape.group, shape.nk, shape.dv).sum(axis=2)  # (B, Hk, Nk, Dv)
    return (
        dq.reshape(q_shape).astype(out_dtype, copy=False),
        dk.reshape(k_shape).astype(out_dtype, copy=False),
        dv.reshape(v_shape).astype(out_dtype, copy=False),
    )


def backward_delta(do, o):
    """``delta = rowsum(dO * O)``: the one number per query row the softmax's backward needs, ``(..., Nq)``.

    It equals ``rowsum(P * dP)`` (see the module docstring) but reads only dO and O, two (Nq, Dv) arrays.
    """
    do = np.asarray(do, dtype=np.float64)
    o = _as_float64("o", o, do.shape)
    return (do * o).sum(axis=-1)


def tiled_attention_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool = False,
    window=None,
    scale=None,
    block_m: int = 64,
    block_n: int = 64,
):
    """FlashAttention-2's backward, tile by tile. Returns ``(dq, dk, dv)``, shaped like q, k and v.

    ``o`` and ``lse`` are what the forward saved (``flashlab.reference.attention`` or ``tiled_attention``, or the
    kernel's ``return_lse=True``); ``do`` is the gradient with respect to o. Nothing of size (Nq, Nk) is stored or
    built: each tile of P is recomputed as ``exp(S_tile - lse)`` when a pass needs it. ``block_m`` / ``block_n``
    are the query and key tile sizes (any positive ints). Tiles the mask hides entirely are skipped, as in the
    forward. Equals ``attention_backward`` to rounding.
    """
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    q_shape, k_shape, v_shape = np.shape(q), np.shape(k), np.shape(v)
    q, _, _, shape, out_dtype = as_heads(q, k, v)  # validates q, k, v together; q (B, Hq, Nq, D)
    scale = default_scale(shape.d, scale)
    g, bhk = shape.group, q.shape[0] * shape.hk
    o_shape = q_shape[:-1] + (shape.dv,)
    do = _as_float64("do", do, o_shape).reshape(bhk, g, shape.nq, shape.dv)  # (BHk, G, Nq, Dv)
    o = _as_float64("o", o, o_shape).reshape(bhk, g, shape.nq, shape.dv)  # (BHk, G, Nq, Dv)
    lse = _as_float64("lse", lse, q_shape[:-1], allow_neginf=True).reshape(bhk, g, shape.nq)  # (BHk, G, Nq)
    q = q.reshape(bhk, g, shape.nq, shape.d)  # (BHk, G, Nq, D): the G query heads that read each K/V head
    k = np.asarray(k, dtype=np.float64).reshape(bhk, shape.nk, shape.d)  # (BHk, Nk, D)  not repeated for GQA
    v = np.asarray(v, dtype=np.float64).reshape(bhk, shape.nk, shape.dv)  # (BHk, Nk, Dv)
    lse = np.where(np.isneginf(lse), 0.0, lse)  # a row that sees no key: every score is -inf, so P = exp(-inf) = 0
    band = visible_band(shape.nq, shape.nk, causal, window)
    n_m, n_n = cdiv(shape.nq, block_m), cdiv(shape.nk, block_n)
    dq = np.zeros((bhk, g, shape.nq, shape.d))
    dk = np.zeros((bhk, shape.nk, shape.d))
    dv = np.zeros((bhk, shape.nk, shape.dv))

    def p_tile(q_tile, k_tile, lse_tile, r0, r1, c0, c1, state):
        """Recompute one tile of P from Q, K and lse: (BHk, bm, bn). The only scores that ever exist."""
        s = np.einsum("bid,bjd->bij", q_tile, k_tile) * scale  # (BHk, bm, bn)  S = Q K^T * scale
        if state == PARTIAL:
            offset, left, right = band
            rows = np.arange(r0, r1)[:, None] + offset  # (bm, 1) diagonal position of each row
            cols = np.arange(c0, c1)[None, :]  # (1, bn)
            s = np.where((cols >= rows - left) & (cols <= rows + right), s, -np.inf)
        return np.exp(s - lse_tile[..., None])  # (BHk, bm, bn)  already normalised: P = exp(S - lse)

    # -- preprocessing: delta = rowsum(dO * O), one number per query row (reads 2 (Nq, Dv) arrays, no P)
    delta = (do * o).sum(axis=-1)  # (BHk, G, Nq)

    # -- pass 1, dK and dV: one program per key tile; it walks every query tile of every query head that reads it
    for tj in range(n_n):
        c0, c1 = tj * block_n, min((tj + 1) * block_n, shape.nk)
        k_tile, v_tile = k[:, c0:c1], v[:, c0:c1]  # (BHk, bn, D), (BHk, bn, Dv)  load K, V tiles once
        dk_acc = np.zeros((bhk, c1 - c0, shape.d))  # (BHk, bn, D)   on chip for the whole pass
        dv_acc = np.zeros((bhk, c1 - c0, shape.dv))  # (BHk, bn, Dv)
        for h in range(g):  # GQA: the query heads sharing this K/V head, summed here, no atomics
            for ti in range(n_m):
                r0, r1 = ti * block_m, min((ti + 1) * block_m, shape.nq)
                state = tile_state(r0, r1, c0, c1, band)
                if state == SKIPPED:
                    continue  # hidden by the mask: nothing loaded, nothing computed
                q_tile, do_tile = q[:, h, r0:r1], do[:, h, r0:r1]  # (BHk, bm, D), (BHk, bm, Dv)  load
                p = p_tile(q_tile, k_tile, lse[:, h, r0:r1], r0, r1, c0, c1, state)  # recomputed, not stored
                dv_acc += np.einsum("bij,bid->bjd", p, do_tile)  # dV += P^T dO
                dp = np.einsum("bid,bjd->bij", do_tile, v_tile)  # (BHk, bm, bn)  dP = dO V^T
                ds = p * (dp - delta[:, h, r0:r1, None])  # (BHk, bm, bn)  dS = P * (dP - delta)
                dk_acc += scale * np.einsum("bij,bid->bjd", ds, q_tile)  # dK += scale dS^T Q
        dk[:, c0:c1] = dk_acc  # write dK, dV once per key tile
        dv[:, c0:c1] = dv_acc

    # -- pass 2, dQ: one program per query tile; it walks the key tiles, recomputing P and dS once more
    for h in range(g):
        for ti in range(n_m):
            r0, r1 = ti * block_m, min((ti + 1) * block_m, shape.nq)
            q_tile, do_tile = q[:, h, r0:r1], do[:, h, r0:r1]  # (BHk, bm, D), (BHk, bm, Dv)  load once
            dq_acc = np.zeros((bhk, r1 - r0, shape.d))  # (BHk, bm, D)
            for tj in range(n_n):
                c0, c1 = tj * block_n, min((tj + 1) * block_n, shape.nk)
                state = tile_state(r0, r1, c0, c1, band)
                if state == SKIPPED:
                    continue
                k_tile, v_tile = k[:, c0:c1], v[:, c0:c1]  # (BHk, bn, D), (BHk, bn, Dv)  load K, V tiles
                p = p_tile(q_tile, k_tile, lse[:, h, r0:r1], r0, r1, c0, c1, state)  # (BHk, bm, bn)
                dp = np.einsum("bid,bjd->bij", do_tile, v_tile)  # (BHk, bm, bn)
                ds = p * (dp - delta[:, h, r0:r1, None])  # (BHk, bm, bn)
                dq_acc += scale * np.einsum("bij,bjd->bid", ds, k_tile)  # dQ += scale dS K
            dq[:, h, r0:r1] = dq_acc  # write dQ once per query tile

    return (
        dq.reshape(q_shape).astype(out_dtype, copy=False),
        dk.reshape(k_shape).astype(out_dtype, copy=False),
        dv.reshape(v_shape).astype(out_dtype, copy=False),
    )


__all__ = ["attention_backward", "backward_delta", "tiled_attention_backward"]
