"""Merging attention computed over disjoint key ranges: the split-KV (Flash-Decoding) combine step.

Split the keys into chunks and run attention on each chunk separately. Chunk c gives an output o_c (already
normalised by its own sum) and its log-sum-exp lse_c = log(sum of exp(scores) over that chunk). The full result
weights each chunk by its share of the total sum, exp(lse_c - lse), where lse = log(sum_c exp(lse_c)):

    lse = m + log(sum_c exp(lse_c - m))        with m = max_c lse_c, so nothing overflows
    o   = sum_c exp(lse_c - lse) * o_c

It is the online-softmax rescale again, done once at the end instead of once per tile.
"""

from __future__ import annotations

import numpy as np


def merge_partials(outs, lses):
    """Combine partial attention results. Returns ``(o, lse)``.

    ``outs``: a sequence of arrays ``(..., N, Dv)`` (or one array with the chunks stacked on axis 0);
    ``lses``: the matching ``(..., N)`` log-sum-exps. A chunk in which a row saw no key has lse = -inf and adds
    nothing; a row that saw no key in any chunk comes out as zeros with lse = -inf.
    """
    outs = [np.asarray(o) for o in outs]
    lses = [np.asarray(x) for x in lses]
    if len(outs) == 0:
        raise ValueError("merge_partials needs at least one partial result")
    if len(outs) != len(lses):
        raise ValueError(f"got {len(outs)} outputs but {len(lses)} log-sum-exps")
    for c, (o, x) in enumerate(zip(outs, lses, strict=True)):
        if o.shape != outs[0].shape or x.shape != lses[0].shape:
            raise ValueError(f"partial {c} has shapes {o.shape}/{x.shape}; expected {outs[0].shape}/{lses[0].shape}")
        if o.ndim < 1 or o.shape[:-1] != x.shape:
            raise ValueError(f"an output (..., N, Dv) needs an lse of shape (..., N); got {o.shape} and {x.shape}")
        if np.isnan(x).any() or np.isposinf(x).any() or np.isnan(o).any():
            raise ValueError(f"partial {c} contains NaN (or an lse of +inf)")
    dtype = np.result_type(*outs, *lses, np.float32)
    o_all = np.stack(outs).astype(np.float64)  # (C, ..., N, Dv)
    lse_all = np.stack(lses).astype(np.float64)  # (C, ..., N)
    m = lse_all.max(axis=0)  # (..., N)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    w = np.exp(lse_all - m_safe)  # (C, ..., N) each chunk's share, up to a common factor
    total = w.sum(axis=0)  # (..., N)
    o = np.divide(
        (w[..., None] * o_all).sum(axis=0), total[..., None], out=np.zeros(o_all.shape[1:]), where=total[..., None] > 0
    )
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m_safe + np.log(total), -np.inf)
    return o.astype(dtype, copy=False), lse.astype(dtype, copy=False)
