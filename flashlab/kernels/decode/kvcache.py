"""Attention against a serving engine's KV cache: ragged lengths, and keys and values in a pool of paged blocks.

A serving engine keeps every running sequence's keys and values in one pool of fixed-size blocks (PagedAttention,
``flashlab.kv_allocator`` simulates its allocator): ``k_cache`` and ``v_cache`` are ``(num_blocks, block_size, Hk, D)``,
and row ``b`` of a block table lists the physical blocks of sequence ``b`` in logical order. Key ``j`` of sequence ``b``
lives in block ``block_table[b, j // block_size]`` at slot ``j % block_size``. Sequences have their own lengths
(``cache_seqlens``); blocks may sit anywhere in the pool, in any order, and be shared between sequences (a common prompt
prefix).

The kernel is the split-KV partial kernel of ``flashlab.kernels.decode.split_kv`` with two changes:

- each program reads its sequence's length, and masks are aligned to that sequence's own end (query i of Nq sees
  keys up to ``seqlen_b - Nq + i`` when causal);
- each key tile's address goes through the block table: one table entry per tile when a block holds whole tiles,
  one per key otherwise. The cache is never gathered into a contiguous copy.

Its chunks' partial outputs are merged as in split-KV, inside the same launch, by the chunks' last finishers
(``softmax_step.finish_chunk``): as a tree of groups, or, for blocks smaller than ``SMALL_BLOCK_TOKENS`` tokens
and up to ``split_kv.MAX_FOLD_SPLITS`` chunks, folded in one level (fewer registers). When one chunk suffices it
normalises and writes the output itself.
Without a block table the cache is
``(B, Nk_max, Hk, D)``, one slab per sequence, read the same way.

A mixed batch (prefill chunks and single decode rows together) packs q as ``(total_q, Hq, D)``, sequence b's rows
being ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` (``RAGGED_Q``, a compile-time branch: the uniform kernel is
unchanged). Each program reads its sequence's row offset and count from ``cu_seqlens_q``, so one grid, cut for the
longest sequence's rows (``max_seqlen_q``), serves every split of the rows: a block of packed rows past its
sequence's ``GROUP * rows`` exits at once, and the masks align to the sequence's end with its own row count. o is
``(total_q, Hq, D)`` and lse ``(Hq, total_q)``, as FlashAttention's variable-length calls return them.

Decode rows and prefill chunks want different blocks of rows. A decode step's few rows wait on the cache's bytes;
a chunk of hundreds of rows waits on its products, and each key tile it loads buys more of them the more rows
share it. So a launch with at least ``TALL_ROWS`` packed rows a sequence takes ``TALL_BLOCK_M``-row blocks on a GPU
and splits its key loop at the band (``SPLIT_BAND``: the tiles every row sees whole skip the mask); in a ragged
launch its short sequences (a decode row's heads) take ``SHORT_BLOCK_M``-row blocks in the same grid
(``SHORT_M``); and the programs with the most work start first: such a ragged launch walks its (sequence, row
block) pairs in the order a small sort on the device gives them (``ORDERED``, ``order_row_blocks``), and any
other launch walks its row blocks from the last.

A bad block table or length never makes the kernel read outside the pool, and never gives a quiet wrong answer.
A length outside ``[0, capacity]`` is clamped to it, and a table entry outside ``[0, num_blocks)`` is never
followed; either way the program that meets it writes NaN into its partial output, so every output row of that
sequence is NaN, and records what it met in a small int32 error record (``ERROR_RECORD_INTS`` of them, laid out as
``ERROR_FIELDS`` says): the first program to fail claims the record with a compare-and-swap and fills it, and the
others leave it alone. The host engine hands the kernel a record in page-locked host memory, which the device writes
through, so the host reads it with a plain memory load, without waiting for the GPU (``flashlab.host.kvcache_errors``).
Each program checks the entries of its own chunk of keys that the sequence uses (those before its length), in a
short scan after its loop; inside the loop a bad entry's keys are only masked. Entries past a sequence's last block
are never read and may hold anything.

An 8-bit cache (``KV_SCALED``): ``k_cache`` and ``v_cache`` hold float8 e4m3 values, and ``K_DESCALE``,
``V_DESCALE`` one float32 scale per (sequence, K/V head), the cache's stored value times its scale being the key or
value it stands for. The kernel loads the 8-bit tiles (half the bytes of a 16-bit cache: what decode, bound by
the cache's reads, is waiting for) and widens them to q's dtype for the dots, exactly (every e4m3 value is a bf16
and an fp16 value); it never writes a 16-bit copy of the cache. The scales are not applied per element: they are
constant over a (sequence, head), so they come out of the sums (below, at the loop). A scale that is not finite
and > 0 is reported like a bad length (``ERROR_SCALE``) and that sequence's rows are NaN.

The float64 reference it must equal is ``flashlab.reference.torch_float64.attention_float64`` applied to each
sequence's keys and values, gathered into contiguous tensors (the tests do exactly that); for an 8-bit cache,
to the keys and values it stands for (``flashlab.host.quantize.dequantize_kv``).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.kernels import configs, error_record, softmax_step
from flashlab.kernels.decode import split_kv
from flashlab.kernels.device import (
    CPU_CONFIG,
    block_d,
    device_index,
    dot_precision,
    dot_upcast,
    sm_count,
)
from flashlab.kernels.error_record import ERROR_FIELDS, ERROR_RECORD_INTS, report_error
from flashlab.kernels.interpreter import interpreted, interpreted_language

# Block sizes must be multiples of this: the smallest key tile, so a tile never straddles a block unevenly.
BLOCK_SIZE_MULTIPLE = 16

# The kinds of the device's error record (flashlab.kernels.error_record) this kernel writes:
ERROR_ENTRY = 1  # block_table[batch, column] = value is outside [0, limit): limit is the pool's block count
ERROR_LENGTH = 2  # cache_seqlens[batch] = value is outside [0, limit]: limit is the capacity (column is -1)
ERROR_SCALE = 3  # a descale of (sequence batch, K/V head column) is not finite and > 0: value is its float32 bits,
# limit says which (SCALE_K: k_descale, SCALE_V: v_descale)
SCALE_K, SCALE_V = 0, 1
ENTRY_SCAN = 64  # table entries a program checks per step of its scan outside the band
NO_COLUMN = 2**31 - 1  # "no bad entry" in the scans: larger than any column
# the same numbers as the kernel reads them
_ENTRY, _LENGTH, _SCALE = tl.constexpr(ERROR_ENTRY), tl.constexpr(ERROR_LENGTH), tl.constexpr(ERROR_SCALE)
_SCALE_K, _SCALE_V = tl.constexpr(SCALE_K), tl.constexpr(SCALE_V)
_SCAN, _NO_COLUMN = tl.constexpr(ENTRY_SCAN), tl.constexpr(NO_COLUMN)


@triton.jit
def first_bad_column(table, key_lo, key_hi, NUM_PAGES, PAGE_SIZE: tl.constexpr, SCAN: tl.constexpr):
    """The first column of a block-table row (``table``) whose block holds some of the keys ``[key_lo, key_hi)``
    and whose entry lies outside ``[0, NUM_PAGES)``; ``NO_COLUMN`` if none. Reads ``SCAN`` entries a step."""
    col_lo = key_lo // PAGE_SIZE
    col_hi = tl.where(key_hi > key_lo, (key_hi + PAGE_SIZE - 1) // PAGE_SIZE, col_lo)
    first = tl.zeros([], dtype=tl.int32) + _NO_COLUMN
    for c0 in range(col_lo, col_hi, SCAN):
        cols = c0 + tl.arange(0, SCAN)
        inside = cols < col_hi
        entry = tl.load(table + cols, mask=inside, other=0)
        bad = inside & ((entry < 0) | (entry >= NUM_PAGES))
        first = tl.minimum(first, tl.min(tl.where(bad, cols, _NO_COLUMN), 0))
    return first


@triton.jit
def e4m3_to_float16(x):
    """float8 e4m3 values widened to float16 in registers, four at a time, by the hardware's conversion
    (``cvt.rn.f16x2.e4m3x2``, exact). Written out rather than ``x.to(tl.float16)`` so that the widening happens
    where the tile was loaded: left to itself, Triton moves the tile into the dot's operand layout while it is
    still 8-bit, and for V, which that layout transposes, it reads shared memory a byte at a time, which, not the
    halved bytes from memory, then bounds the loop."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


# fmt: off
@triton.jit
def _cache_tile(Q, q, acc, m_i, l_i, start_n, k_head, v_head, table, diag, win_left, win_right, hi, NUM_PAGES,
                score_scale, offs_n, offs_d, d_ok, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                DOT_UPCAST: tl.constexpr, KV_SCALED: tl.constexpr, MASKED: tl.constexpr):
    # fmt: on
    """One key tile, keys ``[start_n, start_n + BLOCK_N)``, of ``_kvcache_partial``'s loop: its K and V tiles
    found through the block table, one online-softmax step, ``(acc, m_i, l_i)`` updated. ``MASKED``: the tile
    crosses the band's edge or the last key, so each score is masked to the band and to keys whose table entry
    lies in the pool; without it every row sees every key of the tile. Either way a table entry outside the pool
    is never followed (its keys load as zeros), and the scan after the loop turns the sequence's rows to NaN."""
    cols = start_n + offs_n  # (BLOCK_N,) logical key positions in the sequence
    # -- where the tile's keys live: (page, slot) for each key
    if PAGE_SIZE == 0:  # one slab per sequence: k_head, v_head point into it
        page = tl.zeros([], dtype=tl.int64)
        slot = cols
    elif PAGE_SIZE % BLOCK_N == 0:  # the tile lies inside one block: one table entry
        page = tl.load(table + start_n // PAGE_SIZE).to(tl.int64)
        slot = start_n % PAGE_SIZE + offs_n
    else:  # the tile spans several blocks: one table entry per key
        page = tl.load(table + cols // PAGE_SIZE, mask=cols < hi, other=0).to(tl.int64)
        slot = cols % PAGE_SIZE
    if PAGE_SIZE == 0:
        key_ok = cols < hi
    elif PAGE_SIZE % BLOCK_N == 0:  # one entry for the tile: a bad one hides the whole tile
        key_ok = cols < tl.where((page >= 0) & (page < NUM_PAGES), hi, 0)
    else:
        key_ok = (cols < hi) & (page >= 0) & (page < NUM_PAGES)
    k_off = page * stride_kp + slot * stride_ks  # (BLOCK_N,) or broadcast scalar page
    v_off = page * stride_vp + slot * stride_vs
    # -- K tile: BLOCK_N * D * bytes(dtype), read once for all GROUP query heads
    k = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
    if DOT_UPCAST:
        k = k.to(tl.float32)
    elif KV_SCALED:  # e4m3 -> float16, exactly: the dot runs on the tensor cores with 16-bit inputs
        k = k.to(tl.float16)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    if MASKED:
        visible = softmax_step.band_mask(diag, cols, win_left, win_right, hi) & key_ok[None, :]
        s = tl.where(visible, s * score_scale, float("-inf"))
    else:
        s = s * score_scale
    p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
    # -- V tile: BLOCK_N * D * bytes(dtype)
    v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        v = v.to(tl.float32)
    elif KV_SCALED:
        v = e4m3_to_float16(v)
    acc = acc * alpha[:, None]
    p = p.to(tl.float16 if KV_SCALED and not DOT_UPCAST else Q.dtype.element_ty)  # P enters in q's dtype
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# fmt: off
@triton.jit
def _attend_rows(
    Q, K, V, BLOCK_TABLE, SEQLENS, K_DESCALE, V_DESCALE, O_PART, LSE_PART, O, LSE, COUNTERS, ERRORS,
    stride_qb, stride_qh, stride_qm, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tb,
    stride_ob, stride_oh, stride_om, HQ, GROUP, NQ, NUM_PAGES, CAPACITY, win_left, win_right, keys_per_split,
    NUM_SPLITS, qk_scale, TOTAL_Q, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    pid_s, pid_bk, off_b, off_hk, pid_m, row_blocks, q_start, nq,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, DIRECT: tl.constexpr,
    MERGE_HERE: tl.constexpr, MERGE_GROUP: tl.constexpr, RAGGED_Q: tl.constexpr, KV_SCALED: tl.constexpr,
    SPLIT_BAND: tl.constexpr,
):
    # fmt: on
    """One program's work in ``_kvcache_partial`` (whose parameters these are): block ``pid_m`` of ``BLOCK_M``
    packed rows of sequence ``off_b``'s query rows ``q[q_start : q_start + nq]`` (uniform: ``nq = NQ``) against
    its K/V head ``off_hk``'s keys in chunk ``pid_s``; writes the chunk's partial result, or the merged answer."""
    seqlen = tl.load(SEQLENS + off_b)  # this sequence's length, as given
    length_bad = (seqlen < 0) | (seqlen > CAPACITY)
    nk = tl.minimum(tl.maximum(seqlen, 0), CAPACITY)  # clamped: the keys read never leave the sequence's blocks
    offset = nk - nq  # masks are aligned to the sequence's own end

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * nq
    qi = rows % nq  # (BLOCK_M,) query position
    off_h = off_hk * GROUP + rows // nq  # (BLOCK_M,) query head
    if RAGGED_Q:  # rows outside q are never read nor written, whatever cu_seqlens_q holds
        row_ok = row_ok & (q_start + qi >= 0) & (q_start + qi < TOTAL_Q)
        q_base = Q + q_start.to(tl.int64) * stride_qm  # the sequence's first query row
    else:
        q_base = Q + off_b.to(tl.int64) * stride_qb
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # -- the packed Q tile, loaded once: every query row that shares this K/V head
    q_ptrs = q_base + off_h[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_ptrs + qi[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    if PAGE_SIZE == 0:  # no block table: the sequence's own slab of the cache
        k_head += off_b.to(tl.int64) * stride_kp
        v_head += off_b.to(tl.int64) * stride_vp
    table = BLOCK_TABLE + off_b.to(tl.int64) * stride_tb
    score_scale = qk_scale
    if KV_SCALED:  # this (sequence, K/V head)'s scales: two float32 loads for the whole chunk
        k_scale = tl.load(K_DESCALE + off_b.to(tl.int64) * stride_ksb + off_hk * stride_ksh)
        v_scale = tl.load(V_DESCALE + off_b.to(tl.int64) * stride_vsb + off_hk * stride_vsh)
        k_scale_bad = ~((k_scale > 0) & (k_scale < float("inf")))  # NaN fails both comparisons
        v_scale_bad = ~((v_scale > 0) & (v_scale < float("inf")))
        # a key is k_scale * k8 (k8 the stored e4m3 value): its score q . (k_scale * k8) = k_scale * (q . k8), so
        # the scale joins the softmax scale, one multiply per score as before, none per loaded element. A bad scale
        # is replaced by 1 in the arithmetic (its rows are NaN after the loop), so no inf or NaN is computed with
        score_scale = qk_scale * tl.where(k_scale_bad, 1.0, k_scale)
        if not DOT_UPCAST:
            # the dots take float16 operands, whatever q's 16-bit dtype: e4m3 widens to float16 in one conversion
            # per pair of values (to bfloat16 it takes a second one per value, and those conversions, not the
            # bytes, then bound the loop). Every e4m3 value, and every p in [0, 1], is exact in float16. So is a
            # bfloat16 q once scaled by the power of two that puts its largest |q| in [2^14, 2^15): inside float16's
            # range, above its subnormals; the scores are scaled back by the same power of two (NaN and inf in q
            # still reach the output)
            q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
            q_exp = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF  # its biased exponent
            q_fit = (tl.minimum(tl.maximum(268 - q_exp, 1), 254) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
            q = (q.to(tl.float32) * q_fit).to(tl.float16)
            score_scale = score_scale / q_fit

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- this chunk's keys, cut to the band of the query positions in this block
    r_lo = pid_m * BLOCK_M
    r_hi = tl.minimum(r_lo + BLOCK_M, GROUP * nq) - 1
    one_head = r_lo // nq == r_hi // nq
    qi_lo = tl.where(one_head, r_lo % nq, 0)
    qi_hi = tl.where(one_head, r_hi % nq, nq - 1)
    split_lo = pid_s * keys_per_split
    lo = tl.maximum(split_lo, qi_lo + offset - win_left)
    hi = tl.minimum(tl.minimum(split_lo + keys_per_split, nk), qi_hi + offset + win_right + 1)
    lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    diag = qi + offset

    if SPLIT_BAND:
        # tiles that every row of the block sees whole, [mid_lo, mid_hi), need no mask: a causal prefill chunk's
        # tiles before its diagonal. The band's edge tiles, before and after, are masked
        full_lo = qi_hi + offset - win_left  # the first key every row sees
        full_hi = tl.minimum(qi_lo + offset + win_right + 1, hi)  # past the last key every row sees
        mid_lo = tl.minimum(tl.maximum(lo, (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N), hi)
        mid_hi = tl.maximum(mid_lo, full_hi // BLOCK_N * BLOCK_N)
        for start_n in range(lo, mid_lo, BLOCK_N):
            acc, m_i, l_i = _cache_tile(
                Q, q, acc, m_i, l_i, start_n, k_head, v_head, table, diag, win_left, win_right, hi, NUM_PAGES,
                score_scale, offs_n, offs_d, d_ok, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_SCALED, MASKED=True,
            )  # fmt: skip
        for start_n in range(mid_lo, mid_hi, BLOCK_N):
            acc, m_i, l_i = _cache_tile(
                Q, q, acc, m_i, l_i, start_n, k_head, v_head, table, diag, win_left, win_right, hi, NUM_PAGES,
                score_scale, offs_n, offs_d, d_ok, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_SCALED, MASKED=False,
            )  # fmt: skip
        for start_n in range(mid_hi, hi, BLOCK_N):
            acc, m_i, l_i = _cache_tile(
                Q, q, acc, m_i, l_i, start_n, k_head, v_head, table, diag, win_left, win_right, hi, NUM_PAGES,
                score_scale, offs_n, offs_d, d_ok, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_SCALED, MASKED=True,
            )  # fmt: skip
    else:  # one loop, every tile masked: three loops cost the small-block kernel registers (docs/decode.md)
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _cache_tile(
                Q, q, acc, m_i, l_i, start_n, k_head, v_head, table, diag, win_left, win_right, hi, NUM_PAGES,
                score_scale, offs_n, offs_d, d_ok, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_UPCAST, KV_SCALED, MASKED=True,
            )  # fmt: skip
    if KV_SCALED:  # acc = sum_j p_j (v_scale * v8_j) = v_scale * sum_j p_j v8_j: one multiply per row, after the loop
        acc = acc * tl.where(v_scale_bad, 1.0, v_scale)

    # -- the values' check: a bad length, or a bad entry among the chunk's used keys [split_lo, used_end), read
    # or not by its band (a window; a block of rows before a causal diagonal). One scan of the chunk's entries
    # after the loop, not a flag carried through it: a flag vector held across the loop cost registers, and with
    # them occupancy, in the small-block kernel (docs/kernel-notes.md)
    failed = length_bad
    used_end = tl.minimum(split_lo + keys_per_split, nk)
    column = tl.full([], _NO_COLUMN, dtype=tl.int32)
    if PAGE_SIZE != 0:
        column = first_bad_column(table, split_lo, used_end, NUM_PAGES, PAGE_SIZE, _SCAN)
        failed = failed | (column < _NO_COLUMN)
    if KV_SCALED:
        failed = failed | k_scale_bad | v_scale_bad
    # a failed program's partial is NaN (lse included): the merge, and so every row of the sequence, gives NaN
    acc = tl.where(failed, float("nan"), acc)
    m_i = tl.where(failed, float("nan"), m_i)
    l_i = tl.where(failed, 1.0, l_i)
    if failed:  # the rare path: find what to report
        if length_bad:
            report_error(ERRORS, _LENGTH, off_b, -1, seqlen, CAPACITY)
        elif column < _NO_COLUMN:
            entry = tl.load(table + column)
            report_error(ERRORS, _ENTRY, off_b, column, entry, NUM_PAGES)
        elif KV_SCALED:  # a scale: the first bad one of the two, its float32 bits as the value
            bad = tl.where(k_scale_bad, k_scale, v_scale).to(tl.int32, bitcast=True)
            report_error(ERRORS, _SCALE, off_b, off_hk, bad, tl.where(k_scale_bad, _SCALE_K, _SCALE_V))

    # -- a sequence of length 0, or a chunk past its end, gives zeros and lse = -inf
    if RAGGED_Q:  # o (total_q, Hq, D), lse (Hq, total_q)
        out = O + (q_start + qi).to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh
        lse_row = off_h * TOTAL_Q + q_start + qi  # (BLOCK_M,)
    else:  # o (B, Hq, Nq, D), lse (B, Hq, Nq)
        out = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + qi.to(tl.int64) * stride_om
        lse_row = (off_b * HQ + off_h) * NQ + qi
    first = lse_row.to(tl.int64) * NUM_SPLITS  # (BLOCK_M,) each row's chunk 0
    block = pid_bk * row_blocks + pid_m  # this block of rows' merge counters
    softmax_step.finish_chunk(acc, m_i, l_i, out, LSE + lse_row, row_ok, offs_d, d_ok, O_PART,
                              LSE_PART, first, COUNTERS, block, pid_s, NUM_SPLITS, HEAD_DIM, BLOCK_M, BLOCK_D, DIRECT,
                              MERGE_HERE, MERGE_GROUP)


# fmt: off
@triton.jit
def _kvcache_partial(
    Q, K, V, BLOCK_TABLE, SEQLENS,  # q; the K/V cache; the block table (unused when PAGE_SIZE == 0); lengths
    K_DESCALE, V_DESCALE,  # with KV_SCALED: float32 scales of the 8-bit cache per (sequence, K/V head); else unused
    CU_SEQLENS_Q,  # with RAGGED_Q: (B + 1,) int32, sequence b's query rows are q[cu[b]:cu[b + 1]]; else unused
    ROW_ORDER,  # with ORDERED: (B * row blocks,) int32, the (sequence, row block) pairs heaviest first; else unused
    O_PART, LSE_PART, O, LSE,  # partial outputs (fp32) and lse (log2) per chunk; the output and its lse
    COUNTERS,  # int32, one per (sequence, K/V head, row block): chunks finished; zero between launches
    ERRORS,  # int32 error record (ERROR_FIELDS): the first bad length or table entry a program meets
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1 (RAGGED_Q:
                                      # q is (total_q, Hq, D), its batch stride unused)
    stride_kp, stride_ks, stride_kh,  # K over (page, slot in page, head): a block, or a sequence without a table
    stride_vp, stride_vs, stride_vh,
    stride_tb,  # block table row stride
    stride_ob, stride_oh, stride_om,  # the output, written only with DIRECT
    HQ, HK, GROUP, NQ,  # query heads, K/V heads, query heads per K/V head, query length (RAGGED_Q: the longest)
    NUM_PAGES, CAPACITY,  # blocks in the pool, keys a sequence can hold: a bad entry or length is reported
    win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    keys_per_split, NUM_SPLITS,  # each chunk's keys: [split * keys_per_split, (split + 1) * keys_per_split)
    qk_scale,  # softmax scale * log2(e)
    TOTAL_Q,  # with RAGGED_Q: q's rows, all sequences together (lse is (Hq, total_q)); else unused
    stride_ksb, stride_ksh, stride_vsb, stride_vsh,  # the descales' strides over (sequence, K/V head): 0 broadcasts
    TUNE_KEY_N, TUNE_KEY_UNITS,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # packed query rows per program: (query head in the group, query position)
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    PAGE_SIZE: tl.constexpr,  # tokens per cache block; 0: no block table, the page is the whole sequence
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,  # one chunk: normalise and write o and lse here, no partials, no counter
    MERGE_HERE: tl.constexpr,  # several chunks: the last to finish merges them (else split_kv_merge does)
    MERGE_GROUP: tl.constexpr,  # chunks per group of the merge's tree; 0: one level (softmax_step.finish_chunk)
    RAGGED_Q: tl.constexpr = False,  # q packed (total_q, Hq, D), each sequence's rows found through CU_SEQLENS_Q
    KV_SCALED: tl.constexpr = False,  # an 8-bit cache: K, V float8 e4m3, their scales in K_DESCALE, V_DESCALE
    SPLIT_BAND: tl.constexpr = False,  # the key loop in three: the tiles inside every row's band unmasked
    SHORT_M: tl.constexpr = 0,  # RAGGED_Q: a sequence of at most SHORT_M packed rows takes SHORT_M-row blocks
    ORDERED: tl.constexpr = False,  # the grid's third axis walks ROW_ORDER (order_row_blocks) instead of the rows
):
    # fmt: on
    pid_s = tl.program_id(0)  # which chunk of keys
    # The GPU starts a grid's programs in order, so the heavy ones should come first and the light ones fill the
    # SMs at the end.
    if ORDERED:  # a ragged launch: the (sequence, row block) pairs sorted by their work on the device
        row_blocks = (GROUP * NQ + BLOCK_M - 1) // BLOCK_M
        item = tl.load(ROW_ORDER + tl.program_id(2))
        off_b = item // row_blocks
        pid_m = item % row_blocks
        off_hk = tl.program_id(1)
        pid_bk = off_b * HK + off_hk  # which (sequence, K/V head)
    else:  # which block of packed rows, the last first: a causal row block of later rows sees more keys
        row_blocks = tl.num_programs(2)
        pid_bk = tl.program_id(1)
        pid_m = row_blocks - 1 - tl.program_id(2)
        off_b = pid_bk // HK
        off_hk = pid_bk % HK
    if RAGGED_Q:  # this sequence's own query rows: q[q_start : q_start + nq]
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        nq = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        if pid_m * BLOCK_M >= GROUP * nq:  # a block of rows past this sequence's rows (all of them for nq = 0)
            return
    else:
        q_start = 0
        nq = NQ
    if SHORT_M > 0:
        if GROUP * nq <= SHORT_M:  # a decode row (or a few) in a launch whose blocks are cut for long chunks
            _attend_rows(
                Q, K, V, BLOCK_TABLE, SEQLENS, K_DESCALE, V_DESCALE, O_PART, LSE_PART, O, LSE, COUNTERS, ERRORS,
                stride_qb, stride_qh, stride_qm, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_tb, stride_ob, stride_oh, stride_om, HQ, GROUP, NQ, NUM_PAGES, CAPACITY, win_left, win_right,
                keys_per_split, NUM_SPLITS, qk_scale, TOTAL_Q, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                pid_s, pid_bk, off_b, off_hk, pid_m, row_blocks, q_start, nq,
                HEAD_DIM, BLOCK_D, SHORT_M, BLOCK_N, PAGE_SIZE, DOT_PRECISION, DOT_UPCAST, DIRECT, MERGE_HERE,
                MERGE_GROUP, RAGGED_Q, KV_SCALED, False,
            )  # fmt: skip
            return
    _attend_rows(
        Q, K, V, BLOCK_TABLE, SEQLENS, K_DESCALE, V_DESCALE, O_PART, LSE_PART, O, LSE, COUNTERS, ERRORS,
        stride_qb, stride_qh, stride_qm, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_tb, stride_ob, stride_oh, stride_om, HQ, GROUP, NQ, NUM_PAGES, CAPACITY, win_left, win_right,
        keys_per_split, NUM_SPLITS, qk_scale, TOTAL_Q, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        pid_s, pid_bk, off_b, off_hk, pid_m, row_blocks, q_start, nq,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, DOT_PRECISION, DOT_UPCAST, DIRECT, MERGE_HERE, MERGE_GROUP,
        RAGGED_Q, KV_SCALED, SPLIT_BAND,
    )  # fmt: skip



@triton.jit
def row_block_work(CU_SEQLENS_Q, SEQLENS, item, ITEMS, ROW_BLOCKS, GROUP, CAPACITY, win_left, win_right,
                   BLOCK_M: tl.constexpr, SHORT_M: tl.constexpr):
    """The products of (sequence, row block) pairs ``item`` (``sequence * ROW_BLOCKS + row block``) of a ragged
    launch, as the block's rows times the keys its band reaches, float32; -1 for a block past its sequence's rows
    or an item past ``ITEMS``. What ``_order_row_blocks`` sorts by: a decode row's short block counts its few rows,
    a causal block its reach to its last row."""
    valid = item < ITEMS
    b = tl.where(valid, item // ROW_BLOCKS, 0)
    m = item % ROW_BLOCKS
    q_lo = tl.load(CU_SEQLENS_Q + b, mask=valid, other=0)
    nq = tl.load(CU_SEQLENS_Q + b + 1, mask=valid, other=0) - q_lo
    nk = tl.minimum(tl.maximum(tl.load(SEQLENS + b, mask=valid, other=0), 0), CAPACITY)
    rows = GROUP * nq
    height = nq * 0 + BLOCK_M
    if SHORT_M > 0:
        height = tl.where(rows <= SHORT_M, SHORT_M, BLOCK_M)
    r_lo = m * height
    r_hi = tl.minimum(r_lo + height, rows) - 1
    per_head = tl.maximum(nq, 1)
    one_head = r_lo // per_head == r_hi // per_head  # else the block holds every query position
    qi_lo = tl.where(one_head, r_lo % per_head, 0).to(tl.int64)
    qi_hi = tl.where(one_head, r_hi % per_head, nq - 1).to(tl.int64)
    offset = (nk - nq).to(tl.int64)
    key_lo = tl.maximum(qi_lo + offset - win_left, 0)
    key_hi = tl.minimum(qi_hi + offset + win_right + 1, nk)
    keys = tl.maximum(key_hi - key_lo, 0).to(tl.float32)
    return tl.where(valid & (r_lo < rows), height.to(tl.float32) * keys, -1.0)


@triton.jit
def _order_row_blocks(CU_SEQLENS_Q, SEQLENS, ROW_ORDER, ITEMS, ROW_BLOCKS, GROUP, CAPACITY, win_left, win_right,
                      BLOCK_M: tl.constexpr, SHORT_M: tl.constexpr, BLOCK: tl.constexpr):
    """``ROW_ORDER``: the ``ITEMS`` (sequence, row block) pairs of a ragged launch, the most work first (ties in
    their own order), as a rank sort: each item counts the items ahead of it and writes itself at that place.
    ``BLOCK`` items a program, each compared with all; the order is a permutation whatever the lengths hold."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    work_i = row_block_work(CU_SEQLENS_Q, SEQLENS, i, ITEMS, ROW_BLOCKS, GROUP, CAPACITY, win_left, win_right,
                            BLOCK_M, SHORT_M)  # fmt: skip
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, ITEMS, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        work_j = row_block_work(CU_SEQLENS_Q, SEQLENS, j, ITEMS, ROW_BLOCKS, GROUP, CAPACITY, win_left, win_right,
                                BLOCK_M, SHORT_M)  # fmt: skip
        more = work_j[None, :] > work_i[:, None]
        tie = (work_j[None, :] == work_i[:, None]) & (j[None, :] < i[:, None])
        ahead = (more | tie) & (j[None, :] < ITEMS)
        rank += tl.sum(ahead.to(tl.int32), 1)
    tl.store(ROW_ORDER + rank, i, mask=i < ITEMS)


# (BLOCK_N, num_warps, num_stages): a subset of split_kv's space (its pruning applies), small enough that a decode
# grid's first calls do not spend a minute compiling; fp32 inputs take split_kv's fp32 configs. Two stages suit
# small blocks (a tile then spans several, each a table lookup away): on the H200, 16-token blocks with 128-key
# tiles and two stages ran within 2-6% of contiguous decode, three stages up to a third behind (docs/decode.md).
TUNING_SPACE = [(64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3)]
# Blocks smaller than this many tokens (16-bit inputs) take SMALL_BLOCK_CONFIG without autotuning (the best or
# within 3% of it in every cell of the H200's decode sweep, where the autotuner's own pick was up to 15% slower).
# Their kernel merges up to split_kv.MAX_FOLD_SPLITS chunks in one level (split_kv.merge_arguments' tree=False, 160
# registers a thread: three programs an SM). Where more chunks would fill three programs an SM, it takes the tree
# instead, which needs 196 registers (two programs an SM), and chunks for SMALL_BLOCK_TREE_PROGRAMS_PER_SM programs
# an SM: one launch, where the fold's chunk limit used to leave a second merge kernel (docs/decode.md).
SMALL_BLOCK_TOKENS = 128
SMALL_BLOCK_CONFIG = (128, 4, 2)
SMALL_BLOCK_TREE_PROGRAMS_PER_SM = 2
# An 8-bit cache takes fixed tiles too. Its tiles carry half the bytes of a 16-bit one's, so with as many
# programs in flight half as many bytes are on their way from memory, and the step waits on latency: a third stage
# of tiles in flight took it from 0.81-0.85x to 0.71-0.76x of the 16-bit cache's step on the H200 (256-token
# blocks, B = 1 and 8, 32K and 128K keys), where more chunks (programs an SM) or 128-key tiles did not help. In
# 16-token blocks the third stage helps one sequence (0.74-0.76x) more than it costs eight (1.08x against 1.24x
# with two stages) (docs/decode.md).
EIGHT_BIT_CONFIG = (64, 4, 3)
EIGHT_BIT_SMALL_BLOCK_CONFIG = (128, 4, 3)
# A launch whose sequences hold many query rows (chunked prefill against a cache, a mixed batch's prefill chunks)
# is bound by its products, not by streaming the cache. From TALL_ROWS packed rows a sequence (query heads of a
# group x query rows) its key loop is split in three (SPLIT_BAND): the tiles inside every row's band skip the
# mask. With 16-bit inputs on a GPU its row blocks are also TALL_BLOCK_M rows of TALL_CONFIG's eight warps, twice
# the decode blocks' rows for each key tile loaded. On an H100 the mixed batch of
# ``python -m flashlab.bench --mode varlen --mixed-batch`` ran 1.12x faster with the split loop and 1.86x with
# both (docs/decode.md); decode's own launches keep one masked loop (three cost the small-block kernel 13-20 %).
TALL_ROWS = 256
TALL_BLOCK_M = 128
TALL_CONFIG = (128, 8, 2)
TALL_PROGRAMS_PER_SM = 1  # 255 registers a thread and 161 KB of shared memory (H100): the keys are cut for one an SM
# In a ragged launch whose row blocks are cut for long chunks, a sequence of at most SHORT_BLOCK_M packed rows (a
# decode row's query heads) takes a block of SHORT_BLOCK_M rows instead (SHORT_M, the same grid): its products
# on the rows it has, not on a tall block's worth of padding.
SHORT_BLOCK_M = 16
# A ragged launch cut for long chunks walks its (sequence, row block) pairs in the order of their work, heaviest
# first (ORDERED, ``order_row_blocks``), not row block by row block: one tall block of a long cache runs for as long
# as dozens of a short one's, and a program started last sets the launch's end. A grid's third axis holds at most
# ORDER_LIMIT pairs; a launch with more keeps the plain order. ORDER_BLOCK pairs a program of the sort.
ORDER_LIMIT = 65535
ORDER_BLOCK = 64

kvcache_partial_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bn, w, st in TUNING_SPACE + split_kv.FP32_TUNING_SPACE + [(32, 4, 1)]
    ],
    key=["TUNE_KEY_N", "TUNE_KEY_UNITS", "HEAD_DIM", "BLOCK_M", "PAGE_SIZE", "DOT_PRECISION", "DIRECT", "MERGE_HERE",
         "MERGE_GROUP", "RAGGED_Q", "KV_SCALED"],
    prune_configs_by={"early_config_prune": split_kv.prune_configs},
)(_kvcache_partial)

class KVCacheArguments:
    """The arguments of one KV-cache launch, from a call's shapes, strides and band, as ``split_kv.SplitArguments``
    holds them for contiguous decode: the chunks (cut to cover ``capacity`` keys without reading the lengths, so a
    decode step can be captured in a CUDA graph; a chunk past a sequence's end, or outside its window, exits at
    once), the grid, the scalars, the autotuner's key, the constexprs and the scratch it takes.

    ``q`` is prepared (unit stride along D, negated for a negative scale), ``table`` is the block table (or, with
    ``page_size`` 0, any int32 tensor: it is never read) at unit stride along its columns, and ``win_left``,
    ``win_right``, ``qk_scale`` are the band as ``flashlab.kernels.device.kernel_band`` gives them for ``capacity``
    keys. Blocks smaller than ``SMALL_BLOCK_TOKENS`` tokens (16-bit inputs on a GPU) take ``SMALL_BLOCK_CONFIG``
    and fold their chunks in one level, or the tree at ``SMALL_BLOCK_TREE_PROGRAMS_PER_SM`` programs an SM past
    ``split_kv.MAX_FOLD_SPLITS`` chunks. An 8-bit cache on a GPU takes ``EIGHT_BIT_CONFIG`` (or, in small blocks,
    ``EIGHT_BIT_SMALL_BLOCK_CONFIG``). A 16-bit launch on a GPU with at least ``TALL_ROWS`` packed rows a sequence
    takes ``TALL_BLOCK_M``-row blocks and ``TALL_CONFIG``, its keys cut for ``TALL_PROGRAMS_PER_SM``.

    ``ragged`` ``(B, max_seqlen_q)`` says q is packed ``(total_q, Hq, D)``, sequence b's rows found on the device
    through ``cu_seqlens_q`` (``RAGGED_Q``): the row blocks and chunks are cut for ``max_seqlen_q`` rows a sequence,
    and o is ``(total_q, Hq, D)``, lse ``(Hq, total_q)``. ``nq`` is the query rows a sequence (the most, ragged).

    ``descales`` ``(k_descale, v_descale)``, each ``(B, Hk)`` or ``(Hk,)`` float32, any strides, says the cache is
    8-bit (``KV_SCALED``); None: a 16-bit or fp32 cache."""

    __slots__ = ("num_splits", "direct", "parts", "d", "rows", "counters", "grid", "scalars", "tune", "meta", "nq",
                 "order", "order_call")

    def __init__(self, q, k_cache, v_cache, table, page_size, capacity, win_left, win_right, qk_scale, ragged=None,
                 descales=None):  # fmt: skip
        if ragged is None:
            b, hq, nq, d = q.shape
            total = b * nq
            strides_q = (q.stride(0), q.stride(1), q.stride(2))
            strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
        else:
            (b, nq), (total, hq, d) = ragged, q.shape
            strides_q = (0, q.stride(1), q.stride(0))  # (batch: unused, head, row)
            strides_o = (0, d, hq * d)  # o (total_q, Hq, D), allocated contiguous
        self.nq = nq
        hk = k_cache.shape[2]
        group = hq // hk
        rows = group * nq
        split_band = rows >= TALL_ROWS  # the products bound it: the tiles inside the band skip the mask
        tall = split_band and q.is_cuda and q.element_size() == 2 and descales is None
        block_m = TALL_BLOCK_M if tall else split_kv.packed_block_m(rows)
        row_blocks = cdiv(rows, block_m)
        sms = sm_count(device_index(q)) if q.is_cuda else split_kv.CPU_SM_COUNT
        small_blocks = q.is_cuda and q.element_size() == 2 and 0 < page_size < SMALL_BLOCK_TOKENS
        per_sm = TALL_PROGRAMS_PER_SM if tall else split_kv.PROGRAMS_PER_SM
        num_splits = split_kv.choose_splits(b * hk * row_blocks, capacity, sms, programs_per_sm=per_sm)
        tree = not small_blocks or num_splits > split_kv.MAX_FOLD_SPLITS
        if small_blocks and tree and not tall:  # more chunks than a fold takes: the tree, at its registers' occupancy
            per_sm = SMALL_BLOCK_TREE_PROGRAMS_PER_SM
            num_splits = split_kv.choose_splits(b * hk * row_blocks, capacity, sms, programs_per_sm=per_sm)
        keys_per_split, num_splits = split_kv.split_keys(capacity, num_splits)
        self.d, self.direct, self.num_splits = d, num_splits == 1, num_splits
        # scratch: partial outputs and lse, an lse nobody asked for, the merge's counters
        self.parts, self.rows = total * hq * num_splits, total * hq
        self.scalars = strides_q
        self.scalars += (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        self.scalars += (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        self.scalars += (table.stride(0), *strides_o)
        self.scalars += (hq, hk, group, nq, k_cache.shape[0], capacity, win_left, win_right, keys_per_split)
        self.scalars += (num_splits, qk_scale, total)
        if descales is None:
            self.scalars += (0, 0, 0, 0)  # never read
        else:
            for x in descales:  # (B, Hk), or (Hk,): the same scales for every sequence
                self.scalars += x.stride() if x.ndim == 2 else (0, x.stride(0))
        self.tune = (next_power_of_2(capacity), next_power_of_2(b * hk * row_blocks * num_splits))
        merge = split_kv.merge_arguments(num_splits, b * hk * row_blocks, tree=tree)
        self.counters = merge.counters
        self.meta = dict(
            HEAD_DIM=d,
            BLOCK_D=block_d(d),
            BLOCK_M=block_m,
            PAGE_SIZE=page_size,
            DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
            DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
            RAGGED_Q=ragged is not None,
            KV_SCALED=descales is not None,
            SPLIT_BAND=split_band,
            SHORT_M=SHORT_BLOCK_M if ragged is not None and block_m > SHORT_BLOCK_M else 0,
            ORDERED=False,
        )
        fixed = None  # tiles fixed without the table: tall blocks', an 8-bit cache's, small blocks'
        if tall:
            fixed = TALL_CONFIG
        elif descales is not None and q.is_cuda:
            fixed = EIGHT_BIT_SMALL_BLOCK_CONFIG if small_blocks else EIGHT_BIT_CONFIG
        elif small_blocks:
            fixed = SMALL_BLOCK_CONFIG
        if fixed is not None:
            bn, warps, stages = fixed
            self.meta.update(BLOCK_N=bn, num_warps=warps, num_stages=stages)
        self.meta.update(merge.constexprs)
        self.grid = (num_splits, b * hk, row_blocks)
        # the (sequence, row block) pairs heaviest first: the sort's grid, scalars and constexprs
        self.order, self.order_call = 0, None
        if ragged is not None and split_band and b * row_blocks <= ORDER_LIMIT:
            self.order = b * row_blocks
            self.meta["ORDERED"] = True
            self.grid = (num_splits, hk, self.order)
            order_meta = dict(BLOCK_M=block_m, SHORT_M=self.meta["SHORT_M"], BLOCK=ORDER_BLOCK)
            self.order_call = ((cdiv(self.order, ORDER_BLOCK),), (self.order, row_blocks, group, capacity, win_left,
                                                                   win_right), order_meta)  # fmt: skip


# the modules whose device functions the kernel calls: what a CPU launch lets the interpreter call
DEVICE_MODULES = (softmax_step, error_record, sys.modules[__name__])
# the kernel's tensor parameters, in order
PARTIAL_TENSORS = ("Q", "K", "V", "BLOCK_TABLE", "SEQLENS", "K_DESCALE", "V_DESCALE", "CU_SEQLENS_Q", "ROW_ORDER",
                   "O_PART", "LSE_PART", "O", "LSE", "COUNTERS", "ERRORS")  # fmt: skip


def order_row_blocks(args: KVCacheArguments, cu_seqlens_q, cache_seqlens, row_order):
    """Write into ``row_order`` (int32, ``args.order`` of them) the order in which an ``ORDERED`` launch of ``args``
    walks its (sequence, row block) pairs: the most work first (``row_block_work``), read from ``cu_seqlens_q``
    and ``cache_seqlens`` on the device, one small launch before the kernel's."""
    grid, scalars, meta = args.order_call
    if not row_order.is_cuda:
        with interpreted_language(*DEVICE_MODULES):
            interpreted(_order_row_blocks)[grid](cu_seqlens_q, cache_seqlens, row_order, *scalars, **meta)
        return
    _order_row_blocks[grid](cu_seqlens_q, cache_seqlens, row_order, *scalars, **meta, num_warps=4)


def row_order_argument(args: KVCacheArguments, cu_seqlens_q, cache_seqlens, row_order):
    """The ``ROW_ORDER`` tensor a launch of ``args`` passes: for an ``ORDERED`` launch ``row_order`` (``args.order``
    int32 places), written by ``order_row_blocks`` first; else the lengths, which the kernel never reads there."""
    if not args.order:
        return cache_seqlens
    order_row_blocks(args, cu_seqlens_q, cache_seqlens, row_order)
    return row_order


def bucket_query(q, nq: int):
    """q as ``flashlab.kernels.configs.launch_fields`` reads it, ``(B, Hq, Nq, D)``: a packed q ``(total_q, Hq, D)``
    as one sequence of ``nq`` rows (a view of its first row: only the shape, dtype and device count)."""
    return q if q.ndim == 4 else q[:1].unsqueeze(2).expand(-1, -1, nq, -1)


def launch(q, k_cache, v_cache, table, cache_seqlens, o, lse, page_size, capacity, win_left, win_right, qk_scale,
           errors=None, cu_seqlens_q=None, max_seqlen_q=None, k_descale=None, v_descale=None):  # fmt: skip
    """Run the kernel once on prepared inputs (``KVCacheArguments`` says which), writing ``o`` and ``lse``; with
    ``cu_seqlens_q`` (and ``max_seqlen_q``, the most rows a sequence has) q, o are packed ``(total_q, Hq, D)`` and
    lse is ``(Hq, total_q)``. Returns
    the error record it wrote into (``errors``, ``ERROR_RECORD_INTS`` int32 zeros, or a fresh one): its "kind"
    field (``ERROR_FIELDS``) is nonzero once the launch has met a bad length, table entry or scale. An 8-bit
    cache (float8 e4m3) comes with ``k_descale`` and ``v_descale``, float32 ``(B, Hk)``. On a GPU the
    tiles are ``SMALL_BLOCK_CONFIG`` or ``flashlab.kernels.configs.pick``'s (``FLASHLAB_AUTOTUNE=1``: the
    autotuner's pick)."""
    ragged = None if cu_seqlens_q is None else (cu_seqlens_q.shape[0] - 1, max_seqlen_q)
    descales = None if k_descale is None else (k_descale, v_descale)
    args = KVCacheArguments(q, k_cache, v_cache, table, page_size, capacity, win_left, win_right, qk_scale, ragged,
                            descales)  # fmt: skip
    o_part, lse_part, _, counters = split_kv.fresh_workspace(args, q.device)
    if errors is None:
        errors = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=q.device)
    cu = cache_seqlens if cu_seqlens_q is None else cu_seqlens_q  # never read without RAGGED_Q
    ks, vs = (cache_seqlens, cache_seqlens) if descales is None else descales  # never read without descales
    row_order = torch.empty(args.order, dtype=torch.int32, device=q.device) if args.order else None
    row_order = row_order_argument(args, cu, cache_seqlens, row_order)
    tensors = (q, k_cache, v_cache, table, cache_seqlens, ks, vs, cu, row_order, o_part, lse_part, o, lse, counters,
               errors)  # fmt: skip
    if not q.is_cuda:
        with interpreted_language(*DEVICE_MODULES):
            interpreted(_kvcache_partial)[args.grid](*tensors, *args.scalars, *args.tune, **args.meta,
                                                     BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip
        return errors
    with torch.cuda.device(q.device):
        if "num_warps" in args.meta:  # a fixed config
            _kvcache_partial[args.grid](*tensors, *args.scalars, *args.tune, **args.meta)
        elif configs.autotune_enabled():
            kvcache_partial_tuned[args.grid](*tensors, *args.scalars, *args.tune, **args.meta)
        else:  # the tuned table's config for this bucket (flashlab.kernels.configs)
            fields = configs.launch_fields(bucket_query(q, args.nq), k_cache.shape[2], capacity, capacity - args.nq,
                                           win_left, win_right)  # fmt: skip
            config = configs.pick("kvcache", **fields, page_size=page_size)
            _kvcache_partial[args.grid](*tensors, *args.scalars, *args.tune, **args.meta, **config)
    return errors


def paged_kv_cache(k, v, block_size: int, lengths=None, seed: int = 0):
    """The keys and values of contiguous ``k``, ``v`` ``(B, Hk, N, D)`` copied into a paged pool, blocks shuffled:
    ``(k_cache, v_cache, block_table, cache_seqlens)`` with the pool ``(B * ceil(N / block_size), block_size, Hk,
    D)``, the block table ``(B, ceil(N / block_size))`` int32 (a random permutation of the pool's blocks) and the
    lengths ``(B,)`` int32 (``lengths``, default N for every sequence). For benchmarks and demonstrations; a
    serving engine writes its pool one token at a time instead."""
    b, hk, n, d = k.shape
    max_blocks = cdiv(n, block_size)
    perm = torch.randperm(b * max_blocks, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = perm.view(b, max_blocks).to(torch.int32)

    def pool(x):  # block i of sequence b goes to pool[table[b, i]]
        x = torch.nn.functional.pad(x, (0, 0, 0, max_blocks * block_size - n))  # (B, Hk, max_blocks * bs, D)
        x = x.permute(0, 2, 1, 3).reshape(b * max_blocks, block_size, hk, d)
        out = torch.empty_like(x)
        out[perm] = x
        return out

    lengths = [n] * b if lengths is None else list(lengths)
    return pool(k), pool(v), table, torch.tensor(lengths, dtype=torch.int32, device=k.device)


kvcache_partial = _kvcache_partial

__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "DEVICE_MODULES",
    "ENTRY_SCAN",
    "ERROR_ENTRY",
    "ERROR_FIELDS",
    "ERROR_LENGTH",
    "ERROR_RECORD_INTS",
    "ERROR_SCALE",
    "KVCacheArguments",
    "PARTIAL_TENSORS",
    "SCALE_K",
    "SCALE_V",
    "EIGHT_BIT_CONFIG",
    "EIGHT_BIT_SMALL_BLOCK_CONFIG",
    "TALL_BLOCK_M",
    "TALL_CONFIG",
    "SHORT_BLOCK_M",
    "TALL_PROGRAMS_PER_SM",
    "TALL_ROWS",
    "SMALL_BLOCK_CONFIG",
    "SMALL_BLOCK_TOKENS",
    "SMALL_BLOCK_TREE_PROGRAMS_PER_SM",
    "NO_COLUMN",
    "TUNING_SPACE",
    "bucket_query",
    "first_bad_column",
    "kvcache_partial",
    "kvcache_partial_tuned",
    "launch",
    "ORDER_BLOCK",
    "ORDER_LIMIT",
    "order_row_blocks",
    "paged_kv_cache",
    "report_error",
    "row_order_argument",
]
