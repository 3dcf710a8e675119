"""FlashAttention's tiled forward pass in NumPy: the loop the Triton kernel runs, one tile at a time.

For each tile of ``block_m`` query rows the loop walks the key/value tiles of ``block_n`` keys, keeping three
things per query row and nothing else (this is all a kernel holds in fast on-chip memory):

    m  (block_m,)       running max of the scores seen so far
    l  (block_m,)       running sum of exp(s - m)
    acc (block_m, Dv)   running un-normalised output, sum of exp(s - m) * v

Each key tile: S = Q_tile K_tile^T * scale (one block_m x block_n tile, the only scores that ever exist), then
the online-softmax update -- new max, rescale factor alpha = exp(m_old - m_new), l = alpha*l + rowsum(P),
acc = alpha*acc + P V_tile. After the last tile: O = acc / l and lse = m + log(l).

Tiles that the causal or window mask hides entirely are skipped without being loaded. Inside a partly hidden
tile the hidden keys have p = 0 and add nothing, even if their V rows hold inf or NaN
(``flashlab.reference.attention.weighted_values``). Heads (and batch) run in parallel, as the kernel's grid does;
here they are the leading axis of every array.
"""

from __future__ import annotations

import numpy as np

from flashlab.core.checks import as_count
from flashlab.core.integers import cdiv
from flashlab.core.masking import FULL, PARTIAL, SKIPPED, TileMap, tile_state, visible_band
from flashlab.reference.attention import as_heads, default_scale, reshape_out, weighted_values


def tiled_attention(
    q,
    k,
    v,
    causal: bool = False,
    window=None,
    scale=None,
    block_m: int = 64,
    block_n: int = 64,
    return_tiles: bool = False,
):
    """Tiled attention. Returns ``(o, lse)``, or ``(o, lse, tiles)`` with ``return_tiles=True``.

    Same arguments and results as ``flashlab.reference.attention``; ``block_m``/``block_n`` are the query and key
    tile sizes (any positive ints; they need not divide N). ``tiles`` is a ``flashlab.core.masking.TileMap``
    recording, for each (query tile, key tile), whether the loop skipped it, computed it with an element mask,
    or computed it whole.
    """
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        as_count(name, b)
    ndim = np.ndim(q)
    q, k, v, shape, out_dtype = as_heads(q, k, v)  # (B, H, N, D), K/V repeated for GQA
    scale = default_scale(shape.d, scale)
    band = visible_band(shape.nq, shape.nk, causal, window)
    offset, left, right = band
    bh = q.shape[0] * q.shape[1]
    q = q.reshape(bh, shape.nq, shape.d)  # (BH, Nq, D)
    k = k.reshape(bh, shape.nk, shape.d)  # (BH, Nk, D)
    v = v.reshape(bh, shape.nk, shape.dv)  # (BH, Nk, Dv)
    o = np.zeros((bh, shape.nq, shape.dv))
    lse = np.full((bh, shape.nq), -np.inf)
    n_m, n_n = cdiv(shape.nq, block_m), cdiv(shape.nk, block_n)
    tiles = np.full((n_m, n_n), SKIPPED, dtype=np.int8)

    for ti in range(n_m):  # one query tile: in the kernel, one program of the grid
        r0, r1 = ti * block_m, min((ti + 1) * block_m, shape.nq)
        q_tile = q[:, r0:r1]  # (BH, bm, D)      load Q tile once
        m = np.full((bh, r1 - r0), -np.inf)  # (BH, bm)   running max
        l = np.zeros((bh, r1 - r0))  # (BH, bm)        running sum
        acc = np.zeros((bh, r1 - r0, shape.dv))  # (BH, bm, Dv) running output
        for tj in range(n_n):
            c0, c1 = tj * block_n, min((tj + 1) * block_n, shape.nk)
            state = tile_state(r0, r1, c0, c1, band)
            if state == SKIPPED:
                continue  # hidden by the mask: never loaded, never computed
            tiles[ti, tj] = state
            k_tile, v_tile = k[:, c0:c1], v[:, c0:c1]  # (BH, bn, D), (BH, bn, Dv)  load K, V tiles
            s = np.einsum("bid,bjd->bij", q_tile, k_tile) * scale  # (BH, bm, bn) the score tile
            if state == PARTIAL:
                rows = np.arange(r0, r1)[:, None] + offset  # (bm, 1) diagonal position of each row
                cols = np.arange(c0, c1)[None, :]  # (1, bn)
                s = np.where((cols >= rows - left) & (cols <= rows + right), s, -np.inf)
            # -- update m and l: new running max, rescale what was summed against the old one
            m_new = np.maximum(m, s.max(axis=-1))  # (BH, bm)
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)  # rows with nothing visible yet
            alpha = np.exp(m - m_safe)  # (BH, bm) rescale factor; a first tile has nothing to rescale (l, acc = 0)
            p = np.exp(s - m_safe[..., None])  # (BH, bm, bn)
            l = alpha * l + p.sum(axis=-1)
            # -- rescale the output and accumulate this tile's P @ V
            acc = alpha[..., None] * acc + weighted_values(p, v_tile)  # (BH, bm, Dv); p = 0: hidden, adds nothing
            m = m_new
        # -- epilogue: normalise and write O and lse once per query tile
        seen = l > 0
        o[:, r0:r1] = np.divide(acc, l[..., None], out=np.zeros_like(acc), where=seen[..., None])
        with np.errstate(divide="ignore"):
            lse[:, r0:r1] = np.where(seen, m + np.log(l), -np.inf)

    o = o.reshape(-1, shape.hq, shape.nq, shape.dv)
    lse = lse.reshape(-1, shape.hq, shape.nq)
    o, lse = reshape_out(o, lse, shape, ndim, out_dtype)
    if return_tiles:
        return o, lse, TileMap(state=tiles, block_m=block_m, block_n=block_n, nq=shape.nq, nk=shape.nk)
    return o, lse


__all__ = ["tiled_attention", "FULL", "PARTIAL", "SKIPPED"]
