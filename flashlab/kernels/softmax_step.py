"""The device functions every attention kernel in flashlab shares: the band's element mask and one step of the
online softmax on a tile of scores. ``@triton.jit`` functions are inlined where they are called, so sharing them
costs nothing at run time.

Scores are in log2 units (the softmax scale carries log2(e)), so ``exp2`` gives ``exp(scale * (s - m))``.
"""

import triton
import triton.language as tl

LN_2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * ln(2): turns a log2-unit lse into a natural one


@triton.jit
def band_mask(rows_diag, cols, win_left, win_right, key_end):
    """(BLOCK_M, BLOCK_N) True where a row sees a key: ``diag - win_left <= col <= diag + win_right`` and
    ``col < key_end`` (``flashlab.core.masking``'s band, bottom-right aligned; ``rows_diag`` is each row's
    diagonal key column)."""
    return (
        (cols[None, :] >= rows_diag[:, None] - win_left)
        & (cols[None, :] <= rows_diag[:, None] + win_right)
        & (cols[None, :] < key_end)
    )


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of the online softmax, on scores ``s`` (BLOCK_M, BLOCK_N) already scaled (log2 units) and masked
    to -inf where a key is hidden. Returns ``(p, m_new, alpha, l_new)``:

        m_new = max(m_i, rowmax(s))                 the new running max
        alpha = exp2(m_i - m_new)                   how much to shrink what was summed against the old max
        p     = exp2(s - m_new)                     this tile's unnormalised probabilities (0 where masked)
        l_new = alpha * l_i + rowsum(p)             the new running sum

    A row that has seen no key yet keeps m = -inf; it is taken about 0 instead, so it gives p = 0 and alpha = 0
    rather than NaN from (-inf) - (-inf).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, m_new, alpha, l_new


@triton.jit
def accumulate_pv(acc, p, v, DOT_PRECISION: tl.constexpr):
    """``acc + p @ v`` for a tile with an element mask, where a key with ``p == 0`` (hidden from that row) adds
    nothing even if its V row holds inf or NaN -- inside a plain ``tl.dot`` 0 * inf is NaN and would reach every
    row of the tile.

    The dot takes V with its non-finite entries set to 0; a row that gives weight (p > 0) to a key whose V row
    holds inf or NaN is then set to NaN as a whole, so it still shows that it saw one. (The float64 reference,
    ``flashlab.reference.attention``, follows IEEE arithmetic column by column; both agree on which rows are not
    finite.) Unmasked tiles, where every row sees every key, keep the plain dot.
    """
    finite = tl.abs(v) < float("inf")  # (BLOCK_N, BLOCK_D) False for +-inf and NaN
    acc = tl.dot(p, tl.where(finite, v, 0.0), acc, input_precision=DOT_PRECISION)
    key_bad = tl.max(tl.where(finite, 0, 1), 1)  # (BLOCK_N,) 1 where the key's V row holds inf or NaN
    row_bad = tl.max(tl.where(p > 0, key_bad[None, :], 0), 1)  # (BLOCK_M,) 1 where a row weighs such a key
    return tl.where(row_bad[:, None] > 0, float("nan"), acc)
