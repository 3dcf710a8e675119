"""The device functions every attention kernel in flashlab shares: the band's element mask, one step of the
online softmax on a tile of scores, and one tile step of each of the copy-engine backward's two loops.
``@triton.jit`` functions are inlined where they are called, so sharing them costs nothing at run time.

Scores are in log2 units (the softmax scale carries log2(e)), so ``exp2`` gives ``exp(scale * (s - m))``.
"""

import triton
import triton.language as tl

LN_2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * ln(2): turns a log2-unit lse into a natural one
# Chunks the in-kernel merge loads at once (``merge_chunks``, written for four): one memory latency per four chunks.
MERGE_UNROLL = tl.constexpr(4)


def merge_counters(num_splits: int, merge_group: int) -> int:
    """The int32 counters one block of rows needs for ``finish_chunk``'s merge of ``num_splits`` chunks: one for a
    one-level merge (``merge_group`` 0), else one per group of ``merge_group`` chunks and one for the groups."""
    return 1 if merge_group == 0 else -(-num_splits // merge_group) + 1


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
def edge_keys(rows, offset, win_left, win_right, NK):
    """Each row's first and last visible key, ``(first_key, last_key)``: the band ``[i + offset - win_left, i +
    offset + win_right]`` of query rows ``rows``, its right end cut at the last key. What ``edge_visible`` compares
    against."""
    return rows + offset - win_left, tl.minimum(rows + offset + win_right, NK - 1)


@triton.jit
def edge_rows(keys, offset, win_left, win_right):
    """Each key's first and last query row that sees it, ``(first_row, last_row)``: the band ``[i + offset -
    win_left, i + offset + win_right]`` seen from the keys' side, ``[j - offset - win_right, j - offset +
    win_left]``. What ``edge_visible`` compares rows against where a tile has its keys first (the backward's dK/dV
    loop; rows past the last query need no bound there: their lse is +inf)."""
    return keys - offset - win_right, keys - offset + win_left


@triton.jit
def edge_visible(cols, first_key, last_key, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """(BLOCK_M, BLOCK_N) True where a row sees key ``cols``, testing only the edges a tile can cut: the left one
    (``MASK_LEFT``: a window's start), the right one (``MASK_RIGHT``: the diagonal, a window's end or the last
    key), or both. No branch on the values: a tile every row sees passes it unchanged, which keeps a
    warp-specialised loop's body straight-line code. Call it only where one of the two is set."""
    if MASK_LEFT and MASK_RIGHT:
        visible = (cols[None, :] >= first_key[:, None]) & (cols[None, :] <= last_key[:, None])
    elif MASK_RIGHT:
        visible = cols[None, :] <= last_key[:, None]
    else:
        visible = cols[None, :] >= first_key[:, None]
    return visible


@triton.jit
def band_keys(row_lo, BLOCK_M: tl.constexpr, NQ, NK, offset, win_left, win_right):
    """The keys a tile of query rows needs: ``(lo, hi, row_hi)`` with ``[lo, hi)`` the keys any of the rows
    ``row_lo .. row_hi`` sees (``row_hi`` the tile's last row inside ``NQ``), from the band ``[i + offset -
    win_left, i + offset + win_right]`` cut to ``[0, NK)``; an empty band gives ``hi == lo``."""
    row_hi = tl.minimum(row_lo + BLOCK_M, NQ) - 1
    lo = tl.maximum(row_lo + offset - win_left, 0)
    hi = tl.minimum(row_hi + offset + win_right + 1, NK)
    return lo, tl.maximum(hi, lo), row_hi


@triton.jit
def normalise(acc, m_i, l_i):
    """The end of the online softmax: ``(o, lse)`` from the running output, max and sum (log2 units), with
    ``o = acc / l`` and lse the natural log-sum-exp; a row that saw no key (``l == 0``) gives zeros and -inf."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN_2, float("-inf"))


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


# fmt: off
@triton.jit
def backward_key_tile(Q, k, v, q, do, lse2, delta, dk, dv, start_m, offs_m, first_row, last_row, qk_scale,
                      HIDE_BEFORE: tl.constexpr, HIDE_AFTER: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # fmt: on
    """One step of the backward's dK/dV loop (the copy-engine rungs): the query rows ``start_m + offs_m`` (their
    q, dO, lse2 and delta) against a program's resident keys ``k``, ``v``, their P^T recomputed from the saved lse2.
    ``dV += P^T dO``, ``dK += dS^T Q`` (unscaled) with ``dS^T = P^T (V dO^T - delta)``; the element mask only where
    the band can hide a key from rows before it or after it (``edge_visible`` on each key's first and last row).
    Products enter the dots in ``Q``'s dtype, as in FlashAttention. Returns ``(dk, dv, ds_t)``."""
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :]
    if HIDE_BEFORE or HIDE_AFTER:  # (BLOCK_N, BLOCK_M): key j is seen by rows first_row_j .. last_row_j
        visible = edge_visible(start_m + offs_m, first_row, last_row, HIDE_BEFORE, HIDE_AFTER)
        s_t = tl.where(visible, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t)
    dv = tl.dot(p_t.to(Q.dtype.element_ty).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(Q.dtype.element_ty).to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv, ds_t


# fmt: off
@triton.jit
def backward_query_tile(Q, q, do, lse2, delta, k, v, dq, start_n, offs_n, first_key, last_key, qk_scale,
                        MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # fmt: on
    """One step of the backward's dQ loop (the copy-engine rungs): a program's resident query rows (q, dO, lse2,
    delta) against the keys ``start_n + offs_n`` (``k``, ``v``), P recomputed from the saved lse2. ``dQ += dS K``
    (unscaled) with ``dS = P (dO V^T - delta)``; the element mask only where the band has an edge
    (``edge_visible``). Returns dq."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None]
    if MASK_LEFT or MASK_RIGHT:
        visible = edge_visible(start_n + offs_n, first_key, last_key, MASK_LEFT, MASK_RIGHT)
        s = tl.where(visible, s, float("-inf"))
    p = tl.math.exp2(s)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(Q.dtype.element_ty).to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _load_chunk(O_PART, LSE_PART, first, c, valid, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Chunk ``c``'s partial lse (BLOCK_M,) and output (BLOCK_M, BLOCK_D) for every row; -inf and zeros where
    ``valid`` (a scalar) is False. The loads bypass L1 (``.cg``): other programs, on other SMs, wrote them a
    moment ago."""
    ok = row_ok & ((tl.zeros_like(first) + valid) != 0)
    lse_c = tl.load(LSE_PART + first + c, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o_ptrs = O_PART + (first + c)[:, None] * HEAD_DIM + offs_d[None, :]
    o_c = tl.load(o_ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    return lse_c, o_c


@triton.jit
def merge_chunks(O_PART, LSE_PART, first, c_lo, count, stride, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Split-KV's merge for BLOCK_M rows: combine ``count`` partial outputs (each normalised, fp32) and
    log-sum-exps (log2 units) of every row, those of row ``r`` at workspace rows ``first[r] + c_lo + i * stride``
    for ``i < count``.

    The chunks are folded with the online softmax's rescaling (``flashlab.reference.merge_partials`` weighs each
    chunk by ``exp(lse_c - lse_total)``; this is the same sum, accumulated about a running max), ``MERGE_UNROLL``
    chunks per step: their loads are all issued before the first is used, so a step waits for one memory latency
    instead of one per chunk. Returns ``(o, lse2)``: the merged output (fp32) and log-sum-exp (log2 units, -inf
    where no chunk saw a key).
    """
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(0, count, MERGE_UNROLL):  # four chunks a step: loads first, then one rescale for all four
        c = c_lo + i * stride
        l0, o0 = _load_chunk(O_PART, LSE_PART, first, c, True, row_ok, offs_d, d_ok, HEAD_DIM)
        l1, o1 = _load_chunk(O_PART, LSE_PART, first, c + stride, i + 1 < count, row_ok, offs_d, d_ok, HEAD_DIM)
        l2, o2 = _load_chunk(O_PART, LSE_PART, first, c + 2 * stride, i + 2 < count, row_ok, offs_d, d_ok, HEAD_DIM)
        l3, o3 = _load_chunk(O_PART, LSE_PART, first, c + 3 * stride, i + 3 < count, row_ok, offs_d, d_ok, HEAD_DIM)
        m_new = tl.maximum(tl.maximum(tl.maximum(m, l0), l1), tl.maximum(l2, l3))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no chunk saw a key yet: every weight is 0
        alpha = tl.math.exp2(m - m_safe)
        w0, w1 = tl.math.exp2(l0 - m_safe), tl.math.exp2(l1 - m_safe)
        w2, w3 = tl.math.exp2(l2 - m_safe), tl.math.exp2(l3 - m_safe)
        total = total * alpha + w0 + w1 + (w2 + w3)
        o = o * alpha[:, None] + w0[:, None] * o0 + w1[:, None] * o1 + (w2[:, None] * o2 + w3[:, None] * o3)
        m = m_new
    seen = total > 0.0
    total_safe = tl.where(seen, total, 1.0)
    return o / total_safe[:, None], tl.where(seen, m + tl.math.log2(total_safe), float("-inf"))


@triton.jit
def _write_answer(o, lse2, out, lse_out, row_ok, offs_d, d_ok):
    tl.store(lse_out, lse2 * LN_2, mask=row_ok)
    tl.store(out[:, None] + offs_d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _count_finished(counter):
    # every thread's stores are in (barrier), then counted; the release makes them visible to the acquirer
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")


@triton.jit
def finish_chunk(acc, m_i, l_i, out, lse_out, row_ok, offs_d, d_ok, O_PART, LSE_PART, first, COUNTERS, block,
                 pid_s, NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 DIRECT: tl.constexpr, MERGE_HERE: tl.constexpr, MERGE_GROUP: tl.constexpr):  # fmt: skip
    """The end of a split-KV program: its chunk's running output ``acc``, max ``m_i`` and sum ``l_i`` (log2
    units) for BLOCK_M rows become the answer, or a partial result that the chunks' last finishers merge.

    ``out`` and ``lse_out`` point at each row's output row and lse; ``first`` is each row's chunk 0 in the
    workspace (``O_PART`` rows of HEAD_DIM floats, ``LSE_PART`` floats); block ``block`` of rows owns
    ``merge_counters(NUM_SPLITS, MERGE_GROUP)`` int32 counters of ``COUNTERS``, zero when the launch starts. With
    ``DIRECT`` (one chunk) the output is written at once. Otherwise the program stores its partial; without
    ``MERGE_HERE`` a second kernel merges them (``split_kv.split_kv_merge``).

    With it, the chunks' last finishers merge them in the same launch. A program counts itself finished on a
    counter (an atomic add whose release makes its partial visible, after a barrier so every thread's stores are
    in), and the one that finds the others already counted (acquire) merges them (``merge_chunks``). With
    ``MERGE_GROUP`` 0 the last of all the chunks folds them all. Otherwise the merge is a two-level tree: the
    chunks form groups of ``MERGE_GROUP``, each group's last finisher merges the group, its merged partial replaces
    the group's first chunk's and is counted on the block's last counter, and the last group to arrive merges the
    groups. Groups merge in parallel, on different SMs, so a long cache's 50 chunks cost two short folds instead of
    one long one. Each merger sets its counter back to zero for the next launch. A row that saw no key gives zeros
    and lse -inf.
    """
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse2 = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    if DIRECT:
        _write_answer(o, lse2, out, lse_out, row_ok, offs_d, d_ok)
    else:
        tl.store(LSE_PART + first + pid_s, lse2, mask=row_ok)
        part = O_PART + (first + pid_s)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part, o, mask=row_ok[:, None] & d_ok[None, :])
        if MERGE_HERE:
            if MERGE_GROUP == 0:  # one level: the last chunk to finish folds them all
                counter = COUNTERS + block
                if _count_finished(counter) == NUM_SPLITS - 1:
                    o, lse2 = merge_chunks(O_PART, LSE_PART, first, 0, NUM_SPLITS, 1, row_ok, offs_d, d_ok, HEAD_DIM,
                                           BLOCK_M, BLOCK_D)  # fmt: skip
                    _write_answer(o, lse2, out, lse_out, row_ok, offs_d, d_ok)
                    tl.atomic_xchg(counter, 0)
            else:  # a tree: groups of MERGE_GROUP chunks, then the groups
                group = pid_s // MERGE_GROUP
                g_lo = group * MERGE_GROUP
                g_count = tl.minimum(NUM_SPLITS - g_lo, MERGE_GROUP)
                num_groups = (NUM_SPLITS + MERGE_GROUP - 1) // MERGE_GROUP
                counters = COUNTERS + block * (num_groups + 1)  # merge_counters(NUM_SPLITS, MERGE_GROUP) per block
                if _count_finished(counters + group) == g_count - 1:  # the rest of the group finished before this
                    o, lse2 = merge_chunks(O_PART, LSE_PART, first, g_lo, g_count, 1, row_ok, offs_d, d_ok, HEAD_DIM,
                                           BLOCK_M, BLOCK_D)  # fmt: skip
                    tl.atomic_xchg(counters + group, 0)
                    if num_groups == 1:
                        _write_answer(o, lse2, out, lse_out, row_ok, offs_d, d_ok)
                    else:
                        tl.debug_barrier()  # every thread has read the group's chunks before its first is overwritten
                        tl.store(LSE_PART + first + g_lo, lse2, mask=row_ok)
                        tl.store(O_PART + (first + g_lo)[:, None] * HEAD_DIM + offs_d[None, :], o,
                                 mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
                        if _count_finished(counters + num_groups) == num_groups - 1:  # the last group to finish
                            o, lse2 = merge_chunks(O_PART, LSE_PART, first, 0, num_groups, MERGE_GROUP, row_ok, offs_d,
                                                   d_ok, HEAD_DIM, BLOCK_M, BLOCK_D)  # fmt: skip
                            _write_answer(o, lse2, out, lse_out, row_ok, offs_d, d_ok)
                            tl.atomic_xchg(counters + num_groups, 0)
