"""Packed variable-length attention on Hopper: the varlen forward with its tiles copied by the tensor-memory
accelerator and its loop warp-specialised, as the ladder's rung 3 (``flashlab.kernels.ladder.rung3_hopper``) does
for one sequence.

It computes what the pointer kernels of ``flashlab.kernels.varlen`` compute (the float64 reference of each
sequence; the same layout: q ``(total_q, Hq, D)``, k and v ``(total_k, Hk, D)``, ``cu_seqlens``); what changes is
how tiles arrive. The backward's two loops (dK/dV, dQ) are the backward ladder's rung 2 made packed the same way.

- **Descriptors cut at the sequence's end.** Each program describes q, k, v and o as 2-D tensors of packed rows by
  ``heads * D`` columns, its head's tile at column ``head * D``, and gives each descriptor as many rows as reach
  its own sequence's end (``cu_seqlens[b + 1]``). The copy engine then fills a key tile's rows past the sequence
  with zeros (the next sequence's keys, and whatever their values hold, never enter a product) and drops an output
  tile's rows past it (the next sequence's rows are never written). Nothing is masked by hand but the scores at
  the band's edges, so the loop is one straight-line body that Triton's warp-specialising pass can split into a
  producer of copies and consumers of products.
- **A grid of the tiles that exist.** Instead of every sequence cut for the longest one (most programs of a
  long-tailed batch would find nothing to do), program ``slot`` of a head finds its sequence on the device:
  sequence b's query tiles sit at slots ``cu_seqlens_q[b] // BLOCK_M + b`` onwards, which leaves room for every
  tile and at most one empty slot a sequence, ``cdiv(total_q, BLOCK_M) + B`` slots in all, known on the host
  without reading the lengths.

Where it runs: a Hopper GPU (or the interpreter), 16-bit inputs, head dims 64 and 128 (a tile's columns are one
head's), rows 16-byte aligned and unit stride along D. ``unavailable`` says why not otherwise; the pointer kernel
of ``flashlab.kernels.varlen`` runs everything else.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.device import (
    CPU_CONFIG,
    TMA_ALIGN_BYTES,
    TMA_MIN_CAPABILITY,
    dot_precision,
    dot_upcast,
    ensure_allocator,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language

# The backward's statistics (lse2, delta) are read as tiles of the copy engine, which start 16-byte aligned: each
# sequence's rows of them start at a multiple of STATS_ALIGN floats (``stats_start``)
STATS_ALIGN = 4
_STATS_ALIGN = tl.constexpr(STATS_ALIGN)
HEAD_DIMS = (64, 128)  # a tile's columns are exactly one head's: the descriptor's column offset is head * D
CU_BLOCK = 256  # boundaries a program reads a step while it finds its sequence
RUNTIME = ("HQ", "GROUP", "TOTAL_Q", "TOTAL_K", "B", "win_left", "win_right")


@triton.jit
def find_sequence(CU, slot, B, BLOCK: tl.constexpr, CU_BLOCK: tl.constexpr):
    """``(b, first)``: the sequence whose tiles of ``BLOCK`` packed rows hold ``slot`` (``CU[b] // BLOCK + b`` is
    its first slot: the last such first slot at or before ``slot``; the first slots increase strictly, so counting
    them finds it), and that first slot."""
    found = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, B, CU_BLOCK):
        idx = c0 + tl.arange(0, CU_BLOCK)
        first = tl.load(CU + idx, mask=idx < B, other=0) // BLOCK + idx
        found += tl.sum(((first <= slot) & (idx < B)).to(tl.int32), 0)
    b = tl.maximum(found - 1, 0)
    return b, tl.load(CU + b) // BLOCK + b


# fmt: off
@triton.jit(do_not_specialize=RUNTIME, do_not_specialize_on_alignment=RUNTIME)
def _attn_fwd_varlen_hopper(
    Q, K, V, O, LSE,  # q (total_q, Hq, D), k and v (total_k, Hk, D), the output like q, lse (Hq, total_q)
    CU_Q, CU_K,  # int32 (B + 1,): sequence b owns rows CU_Q[b]:CU_Q[b + 1] of q and CU_K[b]:CU_K[b + 1] of k, v
    stride_qm, stride_km, stride_vm, stride_om,  # row strides (elements): heads * D for packed tensors
    HQ, GROUP, TOTAL_Q, TOTAL_K, B,  # query heads, query heads per K/V head, packed rows, sequences
    win_left, win_right,  # the band: query i of a sequence sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    REVERSE_M: tl.constexpr,  # causal: the slots from the last (a sequence's last tiles see the most keys)
    MASK_LEFT: tl.constexpr,  # a window's left edge can cut a tile
    WARP_SPECIALIZE: tl.constexpr,
    CU_BLOCK: tl.constexpr,
):
    # fmt: on
    slot = tl.program_id(0)
    if REVERSE_M:
        slot = tl.num_programs(0) - 1 - slot
    off_h = tl.program_id(1)
    off_hk = off_h // GROUP

    off_b, first = find_sequence(CU_Q, slot, B, BLOCK_M, CU_BLOCK)  # which sequence, and its first slot
    q_start = tl.load(CU_Q + off_b)
    q_end = tl.load(CU_Q + off_b + 1)
    k_start = tl.load(CU_K + off_b)
    k_end = tl.load(CU_K + off_b + 1)
    NQ = q_end - q_start
    NK = k_end - k_start
    offset = NK - NQ
    row_lo = (slot - first) * BLOCK_M  # a slot past the sequence's tiles: row_lo >= NQ

    # -- the descriptors end at this sequence's last row: past it, loads give zeros and stores are dropped (at least
    # one row: a first sequence of no rows ends at row 0, and a descriptor has no empty dimension)
    q_rows = tl.maximum(q_end, 1)
    k_rows = tl.maximum(k_end, 1)
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HQ * HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K, [k_rows, HQ // GROUP * HEAD_DIM], [stride_km, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [k_rows, HQ // GROUP * HEAD_DIM], [stride_vm, 1], [BLOCK_N, HEAD_DIM])
    desc_o = tl.make_tensor_descriptor(O, [q_rows, HQ * HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM])

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_start + row_lo, off_h * HEAD_DIM])
    if DOT_UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # -- the key tiles the band reaches (none for an empty slot); every tile takes the mask at its edges: the
    # sequence's keys rarely end on a tile boundary
    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    hi = tl.where(row_lo < NQ, hi, lo)
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([k_start + start_n, off_hk * HEAD_DIM])  # (BLOCK_N, D), zeros past the sequence
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
        visible = softmax_step.edge_visible(start_n + offs_n, first_key, last_key, MASK_LEFT, True)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        v = desc_v.load([k_start + start_n, off_hk * HEAD_DIM])
        if DOT_UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    o, lse = softmax_step.normalise(acc, m_i, l_i)
    tl.store(LSE + off_h.to(tl.int64) * TOTAL_Q + q_start + offs_m, lse, mask=offs_m < NQ)
    # rows past q_end are dropped; a slot with no rows of its own stores wholly past the descriptor's end
    o_row = tl.where(row_lo < NQ, q_start + row_lo, q_rows)
    desc_o.store([o_row, off_h * HEAD_DIM], o.to(O.dtype.element_ty))


# ----------------------------------------------------------------------------------------------------------------
# The backward: rung 2's two loops (flashlab.kernels.backward.rung2_hopper) walking the packed sequences
# ----------------------------------------------------------------------------------------------------------------

BWD_RUNTIME = ("HQ", "GROUP", "TOTAL_Q", "TOTAL_K", "B", "STATS_STRIDE", "win_left", "win_right")


@triton.jit
def stats_start(q_start, b):
    """Where sequence ``b`` (its query rows from packed row ``q_start``) keeps its rows of the backward's statistics
    when they are laid out for the copy engine: a multiple of ``STATS_ALIGN`` floats, so that each tile of them
    starts 16-byte aligned; each sequence's rows end before the next one's start."""
    return (q_start // _STATS_ALIGN + b) * _STATS_ALIGN


def stats_stride(total_q: int, b: int) -> int:
    """The row stride (floats) of the backward's statistics laid out by ``stats_start``: room for every
    sequence's rows, a multiple of ``STATS_ALIGN``."""
    return (total_q // STATS_ALIGN + b + 1) * STATS_ALIGN


# fmt: off
@triton.jit(do_not_specialize=BWD_RUNTIME, do_not_specialize_on_alignment=BWD_RUNTIME)
def _bwd_dkdv_varlen_hopper(
    Q, K, V, DO, DK, DV, LSE2, DELTA,  # packed q, k, v, do; dk, dv like k; lse2, delta (Hq, STATS_STRIDE) at
    # each sequence's stats_start
    CU_Q, CU_K,
    stride_qm, stride_km, stride_vm, stride_dom, stride_dkm,  # row strides (heads * D)
    HQ, GROUP, TOTAL_Q, TOTAL_K, B, STATS_STRIDE,
    win_left, win_right,
    qk_scale, dk_scale,  # softmax scale * log2(e); the softmax scale
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per loop step
    BLOCK_N: tl.constexpr,  # keys per program
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HIDE_BEFORE: tl.constexpr,  # the diagonal or a window's right edge hides a key from rows before it
    HIDE_AFTER: tl.constexpr,  # a window's left edge hides a key from rows after it
    WARP_SPECIALIZE: tl.constexpr,
    CU_BLOCK: tl.constexpr,
):
    # fmt: on
    off_hk = tl.program_id(1)
    off_b, first = find_sequence(CU_K, tl.program_id(0), B, BLOCK_N, CU_BLOCK)
    q_start = tl.load(CU_Q + off_b)
    q_end = tl.load(CU_Q + off_b + 1)
    k_start = tl.load(CU_K + off_b)
    k_end = tl.load(CU_K + off_b + 1)
    NQ = q_end - q_start
    NK = k_end - k_start
    offset = NK - NQ
    col_lo = (tl.program_id(0) - first) * BLOCK_N  # a slot past the sequence's key tiles: col_lo >= NK

    # descriptors that end at the sequence's last row: rows past it arrive as zeros (q, dO, lse2, delta: they add
    # nothing; keys: their gradients are never stored)
    q_rows = tl.maximum(q_end, 1)
    k_rows = tl.maximum(k_end, 1)
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HQ * HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HQ * HEAD_DIM], [stride_dom, 1], [BLOCK_M, HEAD_DIM])
    s_start = stats_start(q_start, off_b)  # the statistics end at the sequence's last row too
    desc_l = tl.make_tensor_descriptor(LSE2, [HQ, s_start + tl.maximum(NQ, 1)], [STATS_STRIDE, 1], [1, BLOCK_M])
    desc_dl = tl.make_tensor_descriptor(DELTA, [HQ, s_start + tl.maximum(NQ, 1)], [STATS_STRIDE, 1], [1, BLOCK_M])
    desc_k = tl.make_tensor_descriptor(K, [k_rows, HQ // GROUP * HEAD_DIM], [stride_km, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [k_rows, HQ // GROUP * HEAD_DIM], [stride_vm, 1], [BLOCK_N, HEAD_DIM])

    offs_n = col_lo + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k = desc_k.load([k_start + col_lo, off_hk * HEAD_DIM])
    v = desc_v.load([k_start + col_lo, off_hk * HEAD_DIM])
    if DOT_UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # -- the query rows that see these keys, from the sequence's band; none for an empty slot
    col_hi = tl.minimum(col_lo + BLOCK_N, NK) - 1
    lo = tl.maximum(col_lo - offset - win_right, 0)
    hi = tl.maximum(tl.minimum(col_hi - offset + win_left + 1, NQ), lo)
    hi = tl.where(col_lo < NK, hi, lo)
    t_lo = lo // BLOCK_M
    n_tiles = (hi + BLOCK_M - 1) // BLOCK_M - t_lo
    first_row, last_row = softmax_step.edge_rows(offs_n, offset, win_left, win_right)
    for step in tl.range(0, GROUP * n_tiles, warp_specialize=WARP_SPECIALIZE):
        g = step // n_tiles
        start_m = (t_lo + step - g * n_tiles) * BLOCK_M
        head = off_hk * GROUP + g
        q = desc_q.load([q_start + start_m, head * HEAD_DIM])
        do = desc_do.load([q_start + start_m, head * HEAD_DIM])
        lse2 = tl.reshape(desc_l.load([head, s_start + start_m]), [BLOCK_M])
        delta = tl.reshape(desc_dl.load([head, s_start + start_m]), [BLOCK_M])
        if DOT_UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        dk, dv, _ = softmax_step.backward_key_tile(Q, k, v, q, do, lse2, delta, dk, dv, start_m, offs_m, first_row,
                                                   last_row, qk_scale, HIDE_BEFORE, HIDE_AFTER,
                                                   DOT_PRECISION)  # fmt: skip

    offs_d = tl.arange(0, HEAD_DIM)
    keys = k_start.to(tl.int64) + offs_n
    out = keys[:, None] * stride_dkm + off_hk * HEAD_DIM + offs_d[None, :]
    kv_ok = (offs_n < NK)[:, None]
    tl.store(DK + out, (dk * dk_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


# fmt: off
@triton.jit(do_not_specialize=BWD_RUNTIME, do_not_specialize_on_alignment=BWD_RUNTIME)
def _bwd_dq_varlen_hopper(
    Q, K, V, DO, DQ, LSE2, DELTA,
    CU_Q, CU_K,
    stride_qm, stride_km, stride_vm, stride_dom, stride_dqm,
    HQ, GROUP, TOTAL_Q, TOTAL_K, B, STATS_STRIDE,
    win_left, win_right,
    qk_scale, dq_scale,  # softmax scale * log2(e); the caller's (signed) scale
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    MASK_LEFT: tl.constexpr,  # a window's left edge can cut a key tile
    MASK_RIGHT: tl.constexpr,  # the diagonal or a window's right edge can cut a key tile
    REVERSE_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    CU_BLOCK: tl.constexpr,
):
    # fmt: on
    slot = tl.program_id(0)
    if REVERSE_M:
        slot = tl.num_programs(0) - 1 - slot
    off_h = tl.program_id(1)
    off_hk = off_h // GROUP
    off_b, first = find_sequence(CU_Q, slot, B, BLOCK_M, CU_BLOCK)
    q_start = tl.load(CU_Q + off_b)
    q_end = tl.load(CU_Q + off_b + 1)
    k_start = tl.load(CU_K + off_b)
    k_end = tl.load(CU_K + off_b + 1)
    NQ = q_end - q_start
    NK = k_end - k_start
    offset = NK - NQ
    row_lo = (slot - first) * BLOCK_M

    q_rows = tl.maximum(q_end, 1)
    k_rows = tl.maximum(k_end, 1)
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HQ * HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [q_rows, HQ * HEAD_DIM], [stride_dom, 1], [BLOCK_M, HEAD_DIM])
    # the statistics as one row of all heads' (a 2-D tile of one row, split between the two consumer warpgroups,
    # does not compile with Triton 3.9): rows past the sequence read whatever lies there, which only reaches the
    # dQ rows past the sequence, never stored
    desc_l = tl.make_tensor_descriptor(LSE2, [HQ * STATS_STRIDE], [1], [BLOCK_M])
    desc_dl = tl.make_tensor_descriptor(DELTA, [HQ * STATS_STRIDE], [1], [BLOCK_M])
    s_row = off_h * STATS_STRIDE + stats_start(q_start, off_b) + row_lo
    desc_k = tl.make_tensor_descriptor(K, [k_rows, HQ // GROUP * HEAD_DIM], [stride_km, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [k_rows, HQ // GROUP * HEAD_DIM], [stride_vm, 1], [BLOCK_N, HEAD_DIM])

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Q, dO and the row statistics stay for the whole program; rows past the sequence are zeros and add nothing
    q = desc_q.load([q_start + row_lo, off_h * HEAD_DIM])
    do = desc_do.load([q_start + row_lo, off_h * HEAD_DIM])
    lse2 = desc_l.load([s_row])
    delta = desc_dl.load([s_row])
    if DOT_UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # keys past the sequence arrive as zeros: their P is not 0, but dS times a zero key row adds nothing to dQ
    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    hi = tl.where(row_lo < NQ, hi, lo)
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([k_start + start_n, off_hk * HEAD_DIM])
        v = desc_v.load([k_start + start_n, off_hk * HEAD_DIM])
        if DOT_UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dq = softmax_step.backward_query_tile(Q, q, do, lse2, delta, k, v, dq, start_n, offs_n, first_key, last_key,
                                              qk_scale, MASK_LEFT, MASK_RIGHT, DOT_PRECISION)  # fmt: skip

    offs_d = tl.arange(0, HEAD_DIM)
    rows = q_start.to(tl.int64) + offs_m
    out = rows[:, None] * stride_dqm + off_h * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out, (dq * dq_scale).to(DQ.dtype.element_ty), mask=(offs_m < NQ)[:, None])


def unavailable(q, k, v, o=None) -> str | None:
    """Why this kernel cannot run packed q ``(total_q, Hq, D)``, k, v ``(total_k, Hk, D)`` (writing ``o``, if
    given) here, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "it runs 16-bit inputs only (its dots are the tensor cores')"
    if q.shape[-1] not in HEAD_DIMS:
        return f"its tiles are one head wide: head dims {HEAD_DIMS}, not {q.shape[-1]}"
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"Triton {triton.__version__} has no device-side tensor descriptors (needs Triton >= 3.4)"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < TMA_MIN_CAPABILITY:
            return f"it needs a Hopper GPU or newer (compute capability >= {TMA_MIN_CAPABILITY}.0), not {major}.{minor}"
    for name, x in (("q", q), ("k", k), ("v", v), ("o", q if o is None else o)):
        heads_packed = x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) == x.shape[1] * x.shape[2]
        if not heads_packed or x.data_ptr() % TMA_ALIGN_BYTES:
            return f"its copy engine reads {name} as packed rows of heads (contiguous, 16-byte aligned)"
    return None


def launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, band,
           config=None, launcher=None):  # fmt: skip
    """Run the kernel once on prepared inputs, as ``flashlab.kernels.varlen.launch`` takes them (boundaries
    already checked), writing ``o`` (contiguous, like q) and ``lse (Hq, total_q)``. ``config`` fixes the tiles
    (BLOCK_M, BLOCK_N, num_warps, num_stages; four warps mean warp-specialised); None: rung 3's tuned table's for
    the longest sequence. ``launcher`` as ``flashlab.kernels.varlen.launch`` takes it (the host engine's planned
    launches, which hand the descriptors their global scratch). CPU tensors run the interpreter."""
    why = unavailable(q, k, v, o)
    if why is not None:
        raise RuntimeError(f"the Hopper varlen kernel cannot run these inputs: {why}")
    total_q, hq, d = q.shape
    hk = k.shape[1]
    b = cu_seqlens_q.shape[0] - 1
    if max_seqlen_q == 0 or b == 0 or total_q == 0:
        return
    win_left, win_right, qk_scale = band
    args = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, q.stride(0), k.stride(0), v.stride(0), o.stride(0))
    args += (hq, hq // hk, total_q, k.shape[0], b, win_left, win_right, qk_scale)
    meta = dict(HEAD_DIM=d, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda), DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
                REVERSE_M=bool(causal), MASK_LEFT=win_left < max_seqlen_k, CU_BLOCK=CU_BLOCK)  # fmt: skip
    if not q.is_cuda:
        bm = CPU_CONFIG["BLOCK_M"]
        with interpreted_language(softmax_step, sys.modules[__name__]):
            interpreted(_attn_fwd_varlen_hopper)[(cdiv(total_q, bm) + b, hq)](
                *args, **meta, BLOCK_M=bm, BLOCK_N=CPU_CONFIG["BLOCK_N"], WARP_SPECIALIZE=False)  # fmt: skip
        return
    if config is None:
        mask = "window" if window is not None else "causal" if causal else "none"
        config = configs.pick("hopper", device=q.device, dtype=q.dtype, head_dim=d, mask=mask, group=hq // hk,
                              nq=max(max_seqlen_q, 1), nk=max(max_seqlen_k, 1))  # fmt: skip
    config = dict(config)
    config.setdefault("WARP_SPECIALIZE", config["num_warps"] == configs.HOPPER_WARP_SPECIALIZED_WARPS)
    grid = (cdiv(total_q, config["BLOCK_M"]) + b, hq)
    ensure_allocator()
    with torch.cuda.device(q.device):
        if launcher is None:
            _attn_fwd_varlen_hopper[grid](*args, **meta, **config)
        else:
            launcher(_attn_fwd_varlen_hopper, grid, args, {**meta, **config}, PLANNED_RUNTIME, ("O", "LSE"))


# the scalars a planned launch passes per call: what changes between calls of one binary
PLANNED_RUNTIME = ("TOTAL_Q", "TOTAL_K", "B", "win_left", "win_right", "qk_scale")


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the backward's kernels on a GPU: the backward ladder's rung 2 tiles
# at D <= 128 (``flashlab.kernels.backward.rung2_hopper``), four warps warp-specialised: the dK/dV kernel 64 query
# rows a step over 128 resident keys, the dQ kernel 128 resident rows over 64 keys a step.
BACKWARD_TILES = {"dkdv": (64, 128, 4, 2), "dq": (128, 64, 4, 2)}


def backward_unavailable(q, k, v, do) -> str | None:
    """Why the backward's kernels cannot run these packed tensors here, or None (``unavailable``'s reasons, and dO
    laid out as q)."""
    return unavailable(q, k, v, do)


def launch_backward(q, k, v, do, dq, dk, dv, lse2, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    band, dk_scale, dq_scale, launcher=None):  # fmt: skip
    """The dK/dV and dQ launches of the varlen backward on prepared inputs (q negated for a negative scale, the
    boundaries checked): ``lse2`` and ``delta`` ``(Hq, stats_stride(total_q, B))`` float32 from
    ``flashlab.kernels.varlen``'s preprocess, each sequence's rows at its ``stats_start``; writes dq, dk, dv
    (contiguous, like q and k).
    ``BACKWARD_TILES`` on a GPU; CPU tensors run the interpreter."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    b = cu_seqlens_q.shape[0] - 1
    win_left, win_right, qk_scale = band
    stride = lse2.stride(0)
    if stride % STATS_ALIGN or delta.stride(0) != stride:
        raise ValueError(f"lse2 and delta rows must share a stride that is a multiple of {STATS_ALIGN}")
    sizes = (hq, hq // hk, total_q, total_k, b, stride, win_left, win_right, qk_scale)
    dkdv_args = (q, k, v, do, dk, dv, lse2, delta, cu_seqlens_q, cu_seqlens_k, q.stride(0), k.stride(0),
                 v.stride(0), do.stride(0), dk.stride(0), *sizes, dk_scale)  # fmt: skip
    dq_args = (q, k, v, do, dq, lse2, delta, cu_seqlens_q, cu_seqlens_k, q.stride(0), k.stride(0), v.stride(0),
               do.stride(0), dq.stride(0), *sizes, dq_scale)  # fmt: skip
    common = dict(HEAD_DIM=d, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
                  DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda), CU_BLOCK=CU_BLOCK)  # fmt: skip
    dkdv_meta = dict(common, HIDE_BEFORE=win_right < max_seqlen_q, HIDE_AFTER=win_left < max_seqlen_k)
    dq_meta = dict(common, MASK_LEFT=win_left < max_seqlen_k, MASK_RIGHT=win_right < max_seqlen_q,
                   REVERSE_M=win_right < max_seqlen_q)  # fmt: skip
    if not q.is_cuda:
        tiles = dict(BLOCK_M=CPU_CONFIG["BLOCK_M"], BLOCK_N=CPU_CONFIG["BLOCK_N"], WARP_SPECIALIZE=False)
        with interpreted_language(softmax_step, sys.modules[__name__]):
            interpreted(_bwd_dkdv_varlen_hopper)[(cdiv(total_k, tiles["BLOCK_N"]) + b, hk)](*dkdv_args, **dkdv_meta,
                                                                                            **tiles)  # fmt: skip
            interpreted(_bwd_dq_varlen_hopper)[(cdiv(total_q, tiles["BLOCK_M"]) + b, hq)](*dq_args, **dq_meta,
                                                                                          **tiles)  # fmt: skip
        return
    launches = []
    for kernel, fn, args, meta, outputs, scale in (
        ("dkdv", _bwd_dkdv_varlen_hopper, dkdv_args, dkdv_meta, ("DK", "DV"), "dk_scale"),
        ("dq", _bwd_dq_varlen_hopper, dq_args, dq_meta, ("DQ",), "dq_scale"),
    ):
        bm, bn, warps, stages = BACKWARD_TILES[kernel]
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                     WARP_SPECIALIZE=warps == configs.HOPPER_WARP_SPECIALIZED_WARPS)  # fmt: skip
        grid = (cdiv(total_k, bn) + b, hk) if kernel == "dkdv" else (cdiv(total_q, bm) + b, hq)
        launches.append((fn, grid, args, {**meta, **tiles}, (*BWD_PLANNED_RUNTIME, scale), outputs))
    ensure_allocator()
    with torch.cuda.device(q.device):
        for fn, grid, args, kwargs, runtime, outputs in launches:
            if launcher is None:
                fn[grid](*args, **kwargs)
            else:
                launcher(fn, grid, args, kwargs, runtime, outputs)


# the backward's scalars a planned launch passes per call (its scale's name added per kernel)
BWD_PLANNED_RUNTIME = ("TOTAL_Q", "TOTAL_K", "B", "STATS_STRIDE", "win_left", "win_right", "qk_scale")


# Where the benchmark measured it faster than the pointer kernel (one H100, bf16, the varlen bar's cells,
# docs/forward-ladder.md): head dim 128, by 1.21-1.28x; at 64 the pointer kernel was as fast or faster.
PREFERRED_HEAD_DIM = 128


def backward_preferred(q, k, v, do) -> bool:
    """Whether ``flashlab.kernels.varlen.backward`` runs this module's dK/dV and dQ kernels by default."""
    return q.is_cuda and q.shape[-1] == PREFERRED_HEAD_DIM and backward_unavailable(q, k, v, do) is None


def preferred(q, k, v, o) -> bool:
    """Whether ``flashlab.kernels.varlen.launch`` runs this kernel for packed q, k, v (into o) by default."""
    return q.is_cuda and q.shape[-1] == PREFERRED_HEAD_DIM and unavailable(q, k, v, o) is None

# the kernels under public names (the @triton.jit functions keep theirs, what profilers show)
attn_fwd_varlen_hopper = _attn_fwd_varlen_hopper
bwd_dkdv_varlen_hopper = _bwd_dkdv_varlen_hopper
bwd_dq_varlen_hopper = _bwd_dq_varlen_hopper

__all__ = ["BACKWARD_TILES", "HEAD_DIMS", "PREFERRED_HEAD_DIM", "STATS_ALIGN", "attn_fwd_varlen_hopper",
           "bwd_dkdv_varlen_hopper", "bwd_dq_varlen_hopper", "backward_preferred", "backward_unavailable", "launch",
           "launch_backward", "preferred", "unavailable"]
