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


@triton.jit
def merge_chunks(O_PART, LSE_PART, first, row_ok, offs_d, d_ok, NUM_SPLITS, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Split-KV's merge for BLOCK_M rows: combine the ``NUM_SPLITS`` partial outputs (each normalised, fp32) and
    log-sum-exps (log2 units) of every row, row ``r``'s chunk ``c`` at workspace row ``first[r] + c``.

    The chunks are folded in one pass with the online softmax's rescaling (``flashlab.reference.merge_partials``
    weighs each chunk by ``exp(lse_c - lse_total)``; this is the same sum, accumulated about a running max).
    Returns ``(o, lse2)``: the merged output (fp32) and log-sum-exp (log2 units, -inf where no chunk saw a key).
    The loads bypass L1 (``.cg``): the partials were written by other programs, on other SMs, a moment ago.
    """
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c in range(0, NUM_SPLITS):
        lse_c = tl.load(LSE_PART + first + c, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o_ptrs = O_PART + (first + c)[:, None] * HEAD_DIM + offs_d[None, :]
        o_c = tl.load(o_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse_c - m_safe)
        total = total * alpha + w
        o = o * alpha[:, None] + w[:, None] * o_c
        m = m_new
    seen = total > 0.0
    total_safe = tl.where(seen, total, 1.0)
    return o / total_safe[:, None], tl.where(seen, m + tl.math.log2(total_safe), float("-inf"))


@triton.jit
def finish_chunk(acc, m_i, l_i, out, lse_out, row_ok, offs_d, d_ok, O_PART, LSE_PART, first, counter, pid_s,
                 NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 DIRECT: tl.constexpr, MERGE_HERE: tl.constexpr):  # fmt: skip
    """The end of a split-KV program: its chunk's running output ``acc``, max ``m_i`` and sum ``l_i`` (log2
    units) for BLOCK_M rows become the answer, or a partial result that the chunks' last finisher merges.

    ``out`` and ``lse_out`` point at each row's output row and lse; ``first`` is each row's chunk 0 in the
    workspace (``O_PART`` rows of HEAD_DIM floats, ``LSE_PART`` floats); ``counter`` is this block's int32 counter
    of finished chunks, zero when the launch starts. With ``DIRECT`` (one chunk) the output is written at once.
    Otherwise the program stores its partial; without ``MERGE_HERE`` a second kernel merges them
    (``split_kv.split_kv_merge``). With it, the program counts itself finished (an atomic add whose release makes the
    partial visible, after a barrier so every thread's stores are in), and the one that finds every other chunk
    already counted (acquire) merges them all (``merge_chunks``), writes the output and sets the counter back to
    zero for the next launch. A row that saw no key gives zeros and lse -inf.
    """
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(lse_out, lse2 * LN_2, mask=row_ok)
        tl.store(out[:, None] + offs_d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(LSE_PART + first + pid_s, lse2, mask=row_ok)
        part = O_PART + (first + pid_s)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part, o, mask=row_ok[:, None] & d_ok[None, :])
        if MERGE_HERE:
            tl.debug_barrier()
            finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")  # chunks that finished before this
            if finished == NUM_SPLITS - 1:
                o, lse2 = merge_chunks(O_PART, LSE_PART, first, row_ok, offs_d, d_ok, NUM_SPLITS, HEAD_DIM, BLOCK_M,
                                       BLOCK_D)  # fmt: skip
                tl.store(lse_out, lse2 * LN_2, mask=row_ok)
                o_out = o.to(out.dtype.element_ty)
                tl.store(out[:, None] + offs_d[None, :], o_out, mask=row_ok[:, None] & d_ok[None, :])
                tl.atomic_xchg(counter, 0)
