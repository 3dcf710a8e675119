"""Packed variable-length attention: the skip-and-split forward kernel walking a batch of sequences of different
lengths, packed end to end without padding.

A batch of B sequences is stored as FlashAttention's ``flash_attn_varlen_func`` takes it: the queries of every
sequence one after the other in q ``(total_q, Hq, D)``, their keys and values in k, v ``(total_k, Hk, D)``, and
the boundaries in ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, ``(B + 1,)``, the running sums of the lengths):
sequence b owns rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]``
of k and v. Nothing is padded to the longest sequence and nothing is copied.

The kernel is rung 2 of the ladder (``flashlab.kernels.ladder.rung2_skip_split``) with one change: where that
kernel reads Nq and Nk from its arguments, each program here reads its own sequence's start and end from the
cu_seqlens arrays on the device. The grid covers the longest sequence, ``(cdiv(max_seqlen_q, BLOCK_M), B * Hq)``;
a program whose query tile starts past its sequence's end returns before loading anything. Inside a sequence the
mask band is that sequence's own (bottom-right aligned: offset = Nk_b - Nq_b), and the key tiles are split into the
same three stages (window's left edge masked, full tiles unmasked, diagonal / end of keys masked); tiles the band
hides are never loaded, and no tile reaches into a neighbouring sequence: the key loads stop at the sequence's end.

    per program: read 4 ints of cu_seqlens, then BLOCK_M * D (Q) + per visible key tile 2 * BLOCK_N * D (K, V),
    write BLOCK_M * D (O) + BLOCK_M * 4 bytes (lse)

On a Hopper GPU at head dim 128, ``launch`` runs ``flashlab.kernels.varlen.hopper`` instead: the same maths, its
tiles copied by the tensor-memory accelerator through descriptors cut at each sequence's end, its loop
warp-specialised (1.21-1.28x faster on the varlen bar's cells, docs/forward-ladder.md).

The float64 ground truth is ``flashlab.reference.attention`` on each sequence's slice. CUDA tensors run the
compiled kernel with the config ``flashlab.kernels.configs.pick("skip_split", ...)`` gives the longest sequence's
bucket; CPU tensors run the same source through Triton's interpreter with ``CPU_CONFIG``.
"""

from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import configs, error_record, softmax_step
from flashlab.kernels.device import CPU_CONFIG, LOG2_E, block_d, dot_precision, dot_upcast, kernel_band
from flashlab.kernels.error_record import report_error
from flashlab.kernels.interpreter import interpreted, interpreted_language
from flashlab.kernels.varlen import hopper as varlen_hopper

# Lengths, the band and the row counts are runtime values: a new batch of lengths never compiles another binary.
RUNTIME_LENGTHS = ("HQ", "GROUP", "TOTAL_Q", "win_left", "win_right")
# Each kernel's (scalars that change between calls of one binary, tensors it writes): what a launcher that plans
# launches (``launch``'s ``launcher``) passes per call, and checks a direct launch on
PLANNED = {
    "forward": (("TOTAL_Q", "win_left", "win_right", "qk_scale"), ("O", "LSE")),
    "check": (("N0", "N1", "N2", "B", "TOTAL_Q", "TOTAL_K", "MOST_Q", "MOST_K"), ("SAFE", "ERRORS")),
    "preprocess": (("TOTAL_Q", "STATS_STRIDE"), ("DELTA", "LSE2")),
    "dkdv": (("stride_part", "TOTAL_Q", "win_left", "win_right", "qk_scale", "dk_scale"), ("DK", "DV")),
    "dq": (("TOTAL_Q", "win_left", "win_right", "qk_scale", "dq_scale"), ("DQ",)),
}


def _launch(jit_function, grid, args, kwargs, launcher, kernel):
    """``jit_function[grid](*args, **kwargs)``, or through ``launcher`` (``flashlab.host.launches.planned_launch``:
    the host engine's direct launches) with the kernel's ``PLANNED`` names."""
    if launcher is None:
        jit_function[grid](*args, **kwargs)
    else:
        launcher(jit_function, grid, args, kwargs, *PLANNED[kernel])


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=(*RUNTIME_LENGTHS, "LSE", "TILES"))
def _attn_fwd_varlen(
    Q, K, V, O, LSE,  # q (total_q, Hq, D), k and v (total_k, Hk, D), the output like q, lse (Hq, total_q)
    CU_Q, CU_K,  # int32 (B + 1,): sequence b owns rows CU_Q[b]:CU_Q[b + 1] of q and CU_K[b]:CU_K[b + 1] of k, v
    TILES,  # int32 (B * Hq,): key tiles visited per (sequence, head) when COUNT_TILES; unused otherwise
    stride_qm, stride_qh,  # strides (elements) of q over packed row and head; D has stride 1
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    stride_om, stride_oh,
    HQ, GROUP, TOTAL_Q,  # query heads, query heads per K/V head, packed query rows (the lse's row stride)
    win_left, win_right,  # the band: query i of a sequence sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (the tile's width)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    DOT_UPCAST: tl.constexpr,  # interpreter: feed 16-bit tiles to the dots as fp32 (NumPy has no bf16 matmul)
    REVERSE_M: tl.constexpr,  # causal: start the query tiles with the most work first
    COUNT_TILES: tl.constexpr,  # debugging and tests: count the key tiles each program visits in TILES
):
    # fmt: on
    # -- which tile of which head of which sequence this program owns
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP  # GQA: query head h reads K/V head h // group; K/V are never copied

    # -- the sequence's place in the packed tensors: 4 ints from memory
    q_start = tl.load(CU_Q + off_b)
    q_end = tl.load(CU_Q + off_b + 1)
    k_start = tl.load(CU_K + off_b)
    k_end = tl.load(CU_K + off_b + 1)
    NQ = q_end - q_start  # this sequence's query and key lengths (either may be 0)
    NK = k_end - k_start
    row_lo = pid_m * BLOCK_M  # first query row of the tile, within the sequence
    if row_lo >= NQ:  # the grid covers the longest sequence: a tile past this one's end has nothing to do
        return
    offset = NK - NQ  # bottom-right alignment, per sequence

    q_base = Q + q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
    k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
    o_base = O + q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh

    offs_m = row_lo + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this tile, within the sequence
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key columns, relative to the tile start
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) head-dim columns (padding beyond HEAD_DIM masked)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < NQ  # rows past the sequence's end belong to the next sequence: never read or written

    # -- load the Q tile once: BLOCK_M * D * bytes(dtype), reused for every key tile
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # -- the running state of the online softmax
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running output

    # -- the key range this tile needs, from the sequence's band, split into the three stages as in rung 2
    lo, hi, row_hi = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    full_lo = tl.maximum(row_hi + offset - win_left, 0)  # every row sees keys >= full_lo ...
    full_hi = tl.minimum(row_lo + offset + win_right + 1, NK)  # ... and < full_hi
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    t_full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_N, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)
    if COUNT_TILES:
        tl.atomic_add(TILES + pid_bh, t_hi - t_lo)

    diag = offs_m + offset  # (BLOCK_M,) key column on each row's diagonal

    for stage in tl.static_range(3):  # stage 0: left edge (masked), 1: full tiles (no mask), 2: diagonal / end
        if stage == 0:
            t_start, t_end = t_lo, t_full_lo
        elif stage == 1:
            t_start, t_end = t_full_lo, t_full_hi
        else:
            t_start, t_end = t_full_hi, t_hi
        for start_n in range(t_start * BLOCK_N, t_end * BLOCK_N, BLOCK_N):
            cols = start_n + offs_n  # (BLOCK_N,) key indices of this tile, within the sequence
            k_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None]
            v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
            # -- load K tile: BLOCK_N * D * bytes(dtype); a full tile lies inside the sequence, no row mask
            if stage == 1:
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            else:  # keys past the sequence's end are the next sequence's: masked out of the load
                k = tl.load(k_ptrs, mask=d_ok[:, None] & (cols[None, :] < NK), other=0.0)  # (BLOCK_D, BLOCK_N)
            if DOT_UPCAST:
                k = k.to(tl.float32)

            # -- S = Q K^T: the score tile, in registers only; 2 * BLOCK_M * BLOCK_N * D FLOPs
            s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)

            # -- update m and l
            if stage == 1:  # every real row sees every key of the tile: no element mask
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N)
                l_i = l_i * alpha + tl.sum(p, 1)
            else:  # the element mask on the band's edges; hidden scores -> -inf -> p = 0
                visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)  # (BLOCK_M, BLOCK_N)
                s = tl.where(visible, s * qk_scale, float("-inf"))
                p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)

            # -- load V tile: BLOCK_N * D * bytes(dtype)
            if stage == 1:
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=(cols[:, None] < NK) & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            if DOT_UPCAST:
                v = v.to(tl.float32)

            # -- rescale the output and accumulate this tile's P V: 2 * BLOCK_M * BLOCK_N * D FLOPs
            acc = acc * alpha[:, None]
            p = p.to(O.dtype.element_ty)  # P enters the second dot in the input dtype, as in FlashAttention
            if stage == 1:
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            else:  # hidden keys (p = 0) add nothing, even where their V rows hold inf or NaN
                acc = softmax_step.accumulate_pv(acc, p.to(v.dtype), v, DOT_PRECISION)
            m_i = m_new

    # -- epilogue: normalise, write O (BLOCK_M * D * bytes) and lse (BLOCK_M * 4 bytes) of the sequence's rows
    o, lse = softmax_step.normalise(acc, m_i, l_i)  # rows with no visible key: zeros and lse = -inf
    tl.store(LSE + off_h.to(tl.int64) * TOTAL_Q + q_start + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The boundaries, checked on the device: no host read, no synchronisation
# ----------------------------------------------------------------------------------------------------------------

# Bad boundaries are recorded in the device's error record (``flashlab.kernels.error_record``'s ERROR_FIELDS;
# "batch" says which: 0 cu_seqlens_q, 1 cu_seqlens_k), in the order the host's check tests them:
ERROR_CU_START = 4  # entry 0 is value, not 0
ERROR_CU_DECREASE = 5  # entry column (value) < entry column - 1 (limit)
ERROR_CU_LAST = 6  # the last entry is value, not the packed rows' count (limit)
ERROR_CU_LONG = 7  # sequence column has value rows, more than max_seqlen (limit)
CHECK_BLOCK = 1024  # boundaries a program reads a step
FILL_BLOCK = 1024  # elements a program sets to NaN a step, where the boundaries are bad
CHECK_PROGRAMS = 256  # programs of the check on a GPU: what fills the outputs quickly where they are bad
_NO = tl.constexpr(2**31 - 1)
_START, _DECREASE = tl.constexpr(ERROR_CU_START), tl.constexpr(ERROR_CU_DECREASE)
_LAST, _LONG = tl.constexpr(ERROR_CU_LAST), tl.constexpr(ERROR_CU_LONG)


@triton.jit
def _first_bad(CU, B, TOTAL, MOST, BLOCK: tl.constexpr):
    """``(kind, column, value, limit)`` of the first thing wrong with the boundaries ``CU`` (``B + 1`` int32) in the
    host check's order -- entry 0 not 0, a decrease, a last entry other than ``TOTAL``, a sequence longer than
    ``MOST`` (the first of the longest) -- or kind 0."""
    decrease = tl.zeros([], dtype=tl.int32) + _NO
    longest = tl.zeros([], dtype=tl.int32) - 1
    longest_at = tl.zeros([], dtype=tl.int32)
    for start in range(0, B, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < B
        lo = tl.load(CU + i, mask=inside, other=0)
        hi = tl.load(CU + i + 1, mask=inside, other=0)
        n = tl.where(inside, hi - lo, -1)
        decrease = tl.minimum(decrease, tl.min(tl.where(inside & (n < 0), i + 1, _NO), 0))
        block_longest = tl.max(n, 0)
        at = tl.min(tl.where(n == block_longest, i, _NO), 0)
        longest_at = tl.where(block_longest > longest, at, longest_at)
        longest = tl.maximum(longest, block_longest)
    first = tl.load(CU)
    last = tl.load(CU + B)
    at = tl.minimum(decrease, B)
    after, before = tl.load(CU + at), tl.load(CU + tl.maximum(at - 1, 0))
    kind = tl.where(first != 0, _START, tl.where(decrease != _NO, _DECREASE,
                    tl.where(last != TOTAL, _LAST, tl.where(longest > MOST, _LONG, 0))))  # fmt: skip
    column = tl.where(kind == _DECREASE, decrease, tl.where(kind == _LONG, longest_at, tl.where(kind == _LAST, B, 0)))
    value = tl.where(kind == _DECREASE, after, tl.where(kind == _LONG, longest, tl.where(kind == _LAST, last, first)))
    limit = tl.where(kind == _DECREASE, before, tl.where(kind == _LONG, MOST, TOTAL))
    return kind, column, value, limit


@triton.jit(do_not_specialize=("N0", "N1", "N2", "B", "TOTAL_Q", "TOTAL_K", "MOST_Q", "MOST_K"))
def _check_boundaries(
    CU_Q, CU_K,  # the caller's boundaries, int32 (B + 1,) each
    SAFE,  # int32 (2 * (B + 1),): the boundaries the attention kernels walk (q's, then k's), written here
    ERRORS,  # the device's error record
    FILL0, FILL1, FILL2,  # outputs set to NaN where the boundaries are bad (flat; FILL2 may repeat FILL0)
    N0, N1, N2,  # their element counts (0: not filled)
    B, TOTAL_Q, TOTAL_K, MOST_Q, MOST_K,  # sequences, packed rows of q and k, max_seqlen_q and max_seqlen_k
    BLOCK: tl.constexpr, FILL: tl.constexpr,
):
    """Every program tests the boundaries; program 0 copies them into ``SAFE`` where they are good, or writes
    zeros there (every sequence empty: the attention kernels then read and write nothing) and fills the error
    record where they are not; then every program sets its share of the outputs to NaN if they are bad."""
    kind_q, column_q, value_q, limit_q = _first_bad(CU_Q, B, TOTAL_Q, MOST_Q, BLOCK)
    kind_k, column_k, value_k, limit_k = _first_bad(CU_K, B, TOTAL_K, MOST_K, BLOCK)
    bad = (kind_q != 0) | (kind_k != 0)
    pid = tl.program_id(0)
    if pid == 0:
        for start in range(0, B + 1, BLOCK):
            i = start + tl.arange(0, BLOCK)
            inside = i < B + 1
            tl.store(SAFE + i, tl.where(bad, 0, tl.load(CU_Q + i, mask=inside, other=0)), mask=inside)
            tl.store(SAFE + B + 1 + i, tl.where(bad, 0, tl.load(CU_K + i, mask=inside, other=0)), mask=inside)
        if bad:
            of_q = kind_q != 0
            report_error(ERRORS, tl.where(of_q, kind_q, kind_k), tl.where(of_q, 0, 1),
                         tl.where(of_q, column_q, column_k), tl.where(of_q, value_q, value_k),
                         tl.where(of_q, limit_q, limit_k))  # fmt: skip
    if bad:
        step = tl.num_programs(0) * FILL
        for start in range(pid * FILL, N0, step):
            i = start + tl.arange(0, FILL)
            tl.store(FILL0 + i, tl.full([FILL], float("nan"), FILL0.dtype.element_ty), mask=i < N0)
        for start in range(pid * FILL, N1, step):
            i = start + tl.arange(0, FILL)
            tl.store(FILL1 + i, tl.full([FILL], float("nan"), FILL1.dtype.element_ty), mask=i < N1)
        for start in range(pid * FILL, N2, step):
            i = start + tl.arange(0, FILL)
            tl.store(FILL2 + i, tl.full([FILL], float("nan"), FILL2.dtype.element_ty), mask=i < N2)


def checked_boundaries(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, errors, fills,
                       launcher=None):  # fmt: skip
    """``(cu_q, cu_k)`` for the attention kernels: the caller's boundaries where they are good, zeros where not,
    worked out on the device by one small launch (``_check_boundaries``) that also records what is bad in
    ``errors`` (an int32 error record) and sets every tensor of ``fills`` (up to three, contiguous) to NaN. The
    host reads nothing, so a call never waits for the GPU. ``launcher``: as ``launch`` takes it."""
    b = cu_seqlens_q.shape[0] - 1
    safe = torch.empty(2 * (b + 1), dtype=torch.int32, device=cu_seqlens_q.device)
    spare = fills[0] if fills else torch.empty(1, device=cu_seqlens_q.device)  # an unused slot's pointer
    flat = [x.view(-1) for x in fills] + [spare.view(-1)] * (3 - len(fills))
    counts = [x.numel() for x in fills] + [0] * (3 - len(fills))
    args = (cu_seqlens_q, cu_seqlens_k, safe, errors, *flat, *counts, b, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if not cu_seqlens_q.is_cuda:  # the device functions it calls: this module's and the error record's
        with interpreted_language(sys.modules[__name__], error_record):
            interpreted(_check_boundaries)[(1,)](*args, BLOCK=CHECK_BLOCK, FILL=FILL_BLOCK)
    else:
        with torch.cuda.device(cu_seqlens_q.device):
            _launch(_check_boundaries, (CHECK_PROGRAMS,), args, dict(BLOCK=CHECK_BLOCK, FILL=FILL_BLOCK, num_warps=4),
                    launcher, "check")  # fmt: skip
    return safe[: b + 1], safe[b + 1 :]


def mask_kind(causal: bool, window) -> str:
    """The tuned table's mask name for a varlen call: what its band can hide in general ("none", "causal",
    "window"), since the lengths differ from sequence to sequence."""
    if window is not None:
        return "window"
    return "causal" if causal else "none"


def launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, band,
           config=None, tiles=None, errors=None, launcher=None):  # fmt: skip
    """Run the kernel once on prepared inputs, writing ``o (total_q, Hq, D)`` and ``lse (Hq, total_q)``.

    q ``(total_q, Hq, D)``, k and v ``(total_k, Hk, D)`` with unit stride along D (negated q for a negative
    scale); ``cu_seqlens_*`` int32 on q's device; ``max_seqlen_*`` at least every sequence's length (they size
    the grid and the tuned table's bucket); ``band = (win_left, win_right, qk_scale)`` (``kernel_band``'s, the
    per-sequence offset is computed in the kernel). ``config`` fixes the tiles on a GPU (None: the tuned table's,
    ``configs.pick("skip_split", ...)``). ``tiles``, an int32 tensor of ``B * Hq`` zeros, turns on the count of
    the key tiles each (sequence, head) visits. ``errors``, an error record, has the boundaries checked on the
    device first (``checked_boundaries``: bad ones are recorded there, o and lse come out NaN, nothing is read
    outside the tensors); None trusts them (the host has checked them). ``launcher(jit_function, grid, args,
    kwargs, runtime, outputs)`` launches on a GPU instead of Triton's JIT (the host engine's
    ``planned_launch``: direct launches once checked); None: ``jit_function[grid](*args, **kwargs)``.
    """
    total_q, hq, d = q.shape
    hk = k.shape[1]
    b = cu_seqlens_q.shape[0] - 1
    if errors is not None:
        cu_seqlens_q, cu_seqlens_k = checked_boundaries(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], max_seqlen_q,
                                                        max_seqlen_k, errors, (o, lse), launcher)  # fmt: skip
    if max_seqlen_q == 0 or b == 0:
        return
    if config is None and tiles is None and varlen_hopper.preferred(q, k, v, o):  # the copy engine's kernel
        varlen_hopper.launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                             band, launcher=launcher)  # fmt: skip
        return
    win_left, win_right, qk_scale = band
    count = tiles is not None
    args = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, tiles if count else cu_seqlens_q)
    args += (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1))
    args += (hq, hq // hk, total_q, win_left, win_right, qk_scale)
    meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
                DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda), REVERSE_M=bool(causal), COUNT_TILES=count)  # fmt: skip
    if not q.is_cuda:
        grid = (cdiv(max_seqlen_q, CPU_CONFIG["BLOCK_M"]), b * hq)
        with interpreted_language(softmax_step):
            interpreted(_attn_fwd_varlen)[grid](*args, **meta, **CPU_CONFIG)
        return
    if config is None:
        config = configs.pick("skip_split", device=q.device, dtype=q.dtype, head_dim=d, mask=mask_kind(causal, window),
                              group=hq // hk, nq=max(max_seqlen_q, 1), nk=max(max_seqlen_k, 1))  # fmt: skip
    grid = (cdiv(max_seqlen_q, config["BLOCK_M"]), b * hq)
    with torch.cuda.device(q.device):
        # counting tiles adds into TILES: a launch that is not idempotent, so never a planned one
        _launch(_attn_fwd_varlen, grid, args, {**meta, **config}, launcher if tiles is None else None, "forward")


# ----------------------------------------------------------------------------------------------------------------
# The backward: flashlab.kernels.backward.rung1_two_pass's three kernels, each program reading its sequence from
# cu_seqlens
# ----------------------------------------------------------------------------------------------------------------

_LOG2_E = tl.constexpr(LOG2_E)
PREPROCESS_BLOCK_M = 64  # query rows per program of the preprocess on a GPU


# fmt: off
@triton.jit(do_not_specialize=("HQ", "TOTAL_Q", "STATS_STRIDE"))
def _bwd_preprocess_varlen(
    O, DO, LSE, DELTA, LSE2,  # o and do (total_q, Hq, D); lse (Hq, total_q); outputs delta and lse2 (Hq, stride)
    CU_Q,
    stride_om, stride_oh, stride_dom, stride_doh,
    HQ, TOTAL_Q, STATS_STRIDE,  # packed query rows (lse's row stride); delta's and lse2's row stride
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ALIGNED_STATS: tl.constexpr = False,  # each sequence's delta and lse2 at hopper.stats_start, not at its rows
):
    # fmt: on
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    q_start = tl.load(CU_Q + off_b)
    NQ = tl.load(CU_Q + off_b + 1) - q_start
    if pid_m * BLOCK_M >= NQ:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < NQ
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = q_start.to(tl.int64) + offs_m  # (BLOCK_M,) packed rows
    o = tl.load(O + rows[:, None] * stride_om + off_h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dom + off_h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,) rowsum(dO * O) in fp32
    lse = tl.load(LSE + off_h.to(tl.int64) * TOTAL_Q + rows, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2_E)  # a row that saw no key: P = 0
    stat = rows
    if ALIGNED_STATS:
        stat = varlen_hopper.stats_start(q_start, off_b).to(tl.int64) + offs_m
    tl.store(DELTA + off_h.to(tl.int64) * STATS_STRIDE + stat, delta, mask=row_ok)
    tl.store(LSE2 + off_h.to(tl.int64) * STATS_STRIDE + stat, lse2, mask=row_ok)


BWD_RUNTIME = ("stride_part", "HQ", "HK", "GROUP", "TOTAL_Q", "win_left", "win_right")


# fmt: off
@triton.jit(do_not_specialize=BWD_RUNTIME)
def _bwd_dkdv_varlen(
    Q, K, V, DO, DK, DV, LSE2, DELTA,  # packed q, k, v, do; outputs dk, dv; lse2 and delta (Hq, total_q)
    CU_Q, CU_K,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dkn, stride_dkh,  # dk and dv share one layout
    stride_part,  # GROUP_SPLIT > 1: elements between one part's dk (and dv) and the next's
    HQ, HK, GROUP, TOTAL_Q,
    win_left, win_right,
    qk_scale, dk_scale,  # softmax scale * log2(e); the softmax scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per inner-loop step
    BLOCK_N: tl.constexpr,  # keys per program
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    TILE_MAJOR: tl.constexpr = False,  # grid (B * HK * GROUP_SPLIT, key tiles): every sequence's first tile first
    GROUP_SPLIT: tl.constexpr = 1,  # programs sharing a GQA group's query heads, each writing its own part
):
    # fmt: on
    if TILE_MAJOR:  # the causal band's heaviest key tiles (the first of each sequence) start first
        pid_n = tl.program_id(1)
        pid_y = tl.program_id(0)
    else:
        pid_n = tl.program_id(0)
        pid_y = tl.program_id(1)
    part = pid_y % GROUP_SPLIT
    pid_bk = pid_y // GROUP_SPLIT
    off_b = pid_bk // HK
    off_hk = pid_bk % HK
    q_start = tl.load(CU_Q + off_b)
    NQ = tl.load(CU_Q + off_b + 1) - q_start
    k_start = tl.load(CU_K + off_b)
    NK = tl.load(CU_K + off_b + 1) - k_start
    col_lo = pid_n * BLOCK_N  # first key of the tile, within the sequence
    if col_lo >= NK:  # past this sequence's keys (a sequence without queries still writes its zero gradients)
        return
    offset = NK - NQ

    offs_n = col_lo + tl.arange(0, BLOCK_N)  # (BLOCK_N,) the keys this program owns
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n[:, None] < NK) & d_ok[None, :]
    keys = k_start.to(tl.int64) + offs_n  # (BLOCK_N,) packed key rows
    # -- the K and V tiles stay for the whole program; keys past the sequence's end are zeros, never stored
    k = tl.load(K + keys[:, None] * stride_kn + off_hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + keys[:, None] * stride_vn + off_hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # -- the query rows that see these keys, from the sequence's band (the two-pass backward's ranges)
    col_hi = tl.minimum(col_lo + BLOCK_N, NK) - 1
    lo = tl.maximum(col_lo - offset - win_right, 0)
    hi = tl.maximum(tl.minimum(col_hi - offset + win_left + 1, NQ), lo)
    full_lo = tl.maximum(col_hi - offset - win_right, 0)
    full_hi = tl.minimum(col_lo - offset + win_left + 1, NQ)
    t_lo = lo // BLOCK_M
    t_hi = (hi + BLOCK_M - 1) // BLOCK_M
    t_full_lo = tl.minimum(tl.maximum((full_lo + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_M, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)

    q_seq = Q + q_start.to(tl.int64) * stride_qm
    do_seq = DO + q_start.to(tl.int64) * stride_dom
    for stage in tl.static_range(3):  # rows cut by the diagonal / right edge, rows that see all, the left edge
        if stage == 0:
            t_start, t_end = t_lo, t_full_lo
        elif stage == 1:
            t_start, t_end = t_full_lo, t_full_hi
        else:
            t_start, t_end = t_full_hi, t_hi
        n_tiles = t_end - t_start
        heads = GROUP // GROUP_SPLIT  # this program's query heads of the group
        for step in range(0, heads * n_tiles):  # (query head of the group, query tile): the GQA sum in registers
            g = step // n_tiles
            start_m = (t_start + step - g * n_tiles) * BLOCK_M
            off_h = off_hk * GROUP + part * heads + g
            rows = start_m + offs_m  # (BLOCK_M,) within the sequence
            q_ptrs = q_seq + off_h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :]
            do_ptrs = do_seq + off_h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :]
            stat = off_h.to(tl.int64) * TOTAL_Q + q_start + rows  # this head's rows of lse2 and delta
            if stage == 1:  # every row of the tile lies inside the sequence and sees every key
                q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
                do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
                lse2 = tl.load(LSE2 + stat)
                delta = tl.load(DELTA + stat)
            else:  # rows past the sequence's end: zeros and lse2 = +inf, so they add nothing
                rmask = (rows[:, None] < NQ) & d_ok[None, :]
                q = tl.load(q_ptrs, mask=rmask, other=0.0)
                do = tl.load(do_ptrs, mask=rmask, other=0.0)
                lse2 = tl.load(LSE2 + stat, mask=rows < NQ, other=float("inf"))
                delta = tl.load(DELTA + stat, mask=rows < NQ, other=0.0)
            if DOT_UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)

            # -- S^T = K Q^T and P^T, recomputed from the saved lse
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :]
            if stage != 1:  # the band's element mask, transposed (diag_i < NK drops rows past NQ)
                visible = softmax_step.band_mask(offs_n, rows + offset, win_right, win_left, NK)
                s_t = tl.where(visible, s_t, float("-inf"))
            p_t = tl.math.exp2(s_t)  # (BLOCK_N, BLOCK_M)
            # -- dV += P^T dO; dP^T = V dO^T; dS^T = P^T * (dP^T - delta); dK += dS^T Q
            dv = tl.dot(p_t.to(Q.dtype.element_ty).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(Q.dtype.element_ty).to(q.dtype), q, dk, input_precision=DOT_PRECISION)

    dk = dk * dk_scale
    out = part.to(tl.int64) * stride_part + keys[:, None] * stride_dkn + off_hk * stride_dkh + offs_d[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


# fmt: off
@triton.jit(do_not_specialize=("HQ", "GROUP", "TOTAL_Q", "win_left", "win_right"))
def _bwd_dq_varlen(
    Q, K, V, DO, DQ, LSE2, DELTA,
    CU_Q, CU_K,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dqm, stride_dqh,
    HQ, GROUP, TOTAL_Q,
    win_left, win_right,
    qk_scale, dq_scale,  # softmax scale * log2(e); the caller's (signed) scale
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    TILE_MAJOR: tl.constexpr = False,  # grid (B * HQ, query tiles): every sequence's first tile first
    FROM_END: tl.constexpr = False,  # count the query tiles from each sequence's end (causal: the heaviest first)
):
    # fmt: on
    if TILE_MAJOR:
        pid_m = tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP
    q_start = tl.load(CU_Q + off_b)
    NQ = tl.load(CU_Q + off_b + 1) - q_start
    k_start = tl.load(CU_K + off_b)
    NK = tl.load(CU_K + off_b + 1) - k_start
    if pid_m * BLOCK_M >= NQ:
        return
    if FROM_END:
        pid_m = tl.cdiv(NQ, BLOCK_M) - 1 - pid_m
    row_lo = pid_m * BLOCK_M
    offset = NK - NQ

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < NQ
    q_mask = row_ok[:, None] & d_ok[None, :]
    rows = q_start.to(tl.int64) + offs_m  # (BLOCK_M,) packed rows
    # -- Q, dO, lse2 and delta of the tile stay for the whole program
    q = tl.load(Q + rows[:, None] * stride_qm + off_h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dom + off_h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat = off_h.to(tl.int64) * TOTAL_Q + rows
    lse2 = tl.load(LSE2 + stat, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- the key tiles this query tile sees: the forward's ranges and stages
    lo, hi, row_hi = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    full_lo = tl.maximum(row_hi + offset - win_left, 0)
    full_hi = tl.minimum(row_lo + offset + win_right + 1, NK)
    t_lo = lo // BLOCK_N
    t_hi = (hi + BLOCK_N - 1) // BLOCK_N
    t_full_lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_N, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)

    k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
    diag = offs_m + offset
    for stage in tl.static_range(3):
        if stage == 0:
            t_start, t_end = t_lo, t_full_lo
        elif stage == 1:
            t_start, t_end = t_full_lo, t_full_hi
        else:
            t_start, t_end = t_full_hi, t_hi
        for start_n in range(t_start * BLOCK_N, t_end * BLOCK_N, BLOCK_N):
            cols = start_n + offs_n
            k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
            if stage == 1:  # a full tile lies inside the sequence's keys
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                kmask = (cols[:, None] < NK) & d_ok[None, :]
                k = tl.load(k_ptrs, mask=kmask, other=0.0)  # (BLOCK_N, BLOCK_D)
                v = tl.load(v_ptrs, mask=kmask, other=0.0)
            if DOT_UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # -- P, recomputed; dP = dO V^T, dS = P * (dP - delta), dQ += dS K
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None]
            if stage != 1:
                visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)
                s = tl.where(visible, s, float("-inf"))
            p = tl.math.exp2(s)  # (BLOCK_M, BLOCK_N)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(Q.dtype.element_ty).to(k.dtype), k, dq, input_precision=DOT_PRECISION)

    dq = dq * dq_scale
    tl.store(DQ + rows[:, None] * stride_dqm + off_h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=q_mask)  # fmt: skip


def backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
             config=None, errors=None, launcher=None):  # fmt: skip
    """Gradients ``(dq, dk, dv)`` shaped like the packed q, k, v, of the forward's ``o`` and ``lse (Hq, total_q)``
    given ``do``: three launches for the whole batch (preprocess, dK/dV, dQ), each program reading its sequence
    from cu_seqlens. A sequence with no queries or no keys gets zero gradients. Deterministic (no atomics).

    ``config`` is required on a GPU: ``{"dkdv": {...}, "dq": {...}}``, each a dict of BLOCK_M, BLOCK_N, num_warps,
    num_stages (the host engine picks them); the interpreter uses ``CPU_CONFIG``'s tiles. Either dict may also hold
    the schedule (on the interpreter too): ``TILE_MAJOR`` (the grid walks every sequence's first tile, then every
    second, ...), ``FROM_END`` (dq: tiles counted from each sequence's end) and ``GROUP_SPLIT`` (dkdv: that many
    programs share a GQA group's query heads, each writing a float32 part of dK and dV that one fixed-order sum
    adds up: deterministic). ``errors`` and ``launcher``: as ``launch`` takes them (bad boundaries give NaN
    gradients)."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    b = cu_seqlens_q.shape[0] - 1
    q, k, v, do, o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, do, o))
    signed_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _, win_left, win_right, qk_scale, negate = kernel_band(max(max_seqlen_q, 1), max(max_seqlen_k, 1), d, causal,
                                                           window, scale)  # fmt: skip
    q_run = -q if negate else q  # as the forward: dK = |scale| dS^T (-q), dQ = scale dS K
    if b == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:  # no query sees a key: every gradient is zero
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if errors is not None:
            checked_boundaries(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, errors, grads,
                               launcher)  # fmt: skip
        return grads
    # every packed row is written: by its query tile (dq, even without keys) or its key tile (dk, dv, even without
    # queries)
    # the copy engine's kernels (Hopper, D = 128) unless the config names the pointer kernels' tiles or schedule
    copy_engine = (config or {}).get("copy_engine", True) and varlen_hopper.backward_preferred(q_run, k, v, do)
    dkdv_config, dq_config = split_schedule({n: c for n, c in (config or {}).items() if n != "copy_engine"},
                                            q.is_cuda, hq // hk)  # fmt: skip
    split = 1 if copy_engine else dkdv_config["GROUP_SPLIT"]
    stats_stride = varlen_hopper.stats_stride(total_q, b) if copy_engine else total_q
    delta = torch.empty((hq, stats_stride), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dq = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((total_k, hk, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    # with the group split, each part of dK and dV in float32, summed once all are written
    dk_out, dv_out = (dk, dv) if split == 1 else (torch.empty((split, total_k, hk, d), dtype=torch.float32,
                                                              device=q.device) for _ in "kv")  # fmt: skip
    if errors is not None:
        cu_seqlens_q, cu_seqlens_k = checked_boundaries(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                                                        max_seqlen_k, errors, (dq, dk_out, dv_out),
                                                        launcher)  # fmt: skip
    bd = block_d(d)
    common = dict(HEAD_DIM=d, BLOCK_D=bd, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
                  DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda))  # fmt: skip
    pre_args = (o, do, lse, delta, lse2, cu_seqlens_q, o.stride(0), o.stride(1), do.stride(0), do.stride(1))
    pre_args += (hq, total_q, stats_stride)
    strides = (q_run.stride(0), q_run.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    strides += (do.stride(0), do.stride(1))
    band = (win_left, win_right)
    dkdv_args = (q_run, k, v, do, dk_out, dv_out, lse2, delta, cu_seqlens_q, cu_seqlens_k, *strides,
                 dk_out.stride(-3), dk_out.stride(-2), dk_out.stride(0) if split > 1 else 0, hq, hk, hq // hk, total_q,
                 *band, qk_scale, abs(signed_scale))  # fmt: skip
    dq_args = (q_run, k, v, do, dq, lse2, delta, cu_seqlens_q, cu_seqlens_k, *strides, dq.stride(0), dq.stride(1),
               hq, hq // hk, total_q, *band, qk_scale, signed_scale)  # fmt: skip
    dkdv_grid = _grid(cdiv(max_seqlen_k, dkdv_config["BLOCK_N"]), b * hk * split, dkdv_config["TILE_MAJOR"])
    dq_grid = _grid(cdiv(max_seqlen_q, dq_config["BLOCK_M"]), b * hq, dq_config["TILE_MAJOR"])
    if not q.is_cuda:
        pre_m = CPU_CONFIG["BLOCK_M"]
        with interpreted_language(softmax_step):
            interpreted(_bwd_preprocess_varlen)[(cdiv(max_seqlen_q, pre_m), b * hq)](*pre_args, HEAD_DIM=d,
                                                                                      BLOCK_D=bd, BLOCK_M=pre_m)
            interpreted(_bwd_dkdv_varlen)[dkdv_grid](*dkdv_args, **common, **dkdv_config)
            interpreted(_bwd_dq_varlen)[dq_grid](*dq_args, **common, **dq_config)
    else:
        pre_m = PREPROCESS_BLOCK_M
        with torch.cuda.device(q.device):
            _launch(_bwd_preprocess_varlen, (cdiv(max_seqlen_q, pre_m), b * hq), pre_args,
                    dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=pre_m, ALIGNED_STATS=copy_engine), launcher,
                    "preprocess")  # fmt: skip
            if copy_engine:
                varlen_hopper.launch_backward(q_run, k, v, do, dq, dk, dv, lse2, delta, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, (win_left, win_right, qk_scale),
                                              abs(signed_scale), signed_scale, launcher)  # fmt: skip
            else:
                _launch(_bwd_dkdv_varlen, dkdv_grid, dkdv_args, {**common, **dkdv_config}, launcher, "dkdv")
                _launch(_bwd_dq_varlen, dq_grid, dq_args, {**common, **dq_config}, launcher, "dq")
    if split > 1:  # the parts in one fixed order: the same gradients every run
        dk.copy_(dk_out.sum(0))
        dv.copy_(dv_out.sum(0))
    return dq, dk, dv


SCHEDULE_DEFAULTS = {"dkdv": {"TILE_MAJOR": False, "GROUP_SPLIT": 1}, "dq": {"TILE_MAJOR": False, "FROM_END": False}}


def split_schedule(config, on_gpu: bool, group: int) -> tuple[dict, dict]:
    """The dK/dV and dQ launches' keyword arguments: the tiles (``config``'s on a GPU, ``CPU_CONFIG``'s on the
    interpreter) and the schedule (``config``'s where it says, else ``SCHEDULE_DEFAULTS``). A ``GROUP_SPLIT`` that
    does not divide the GQA group is an error."""
    config = config or {}
    if on_gpu and not {"dkdv", "dq"} <= set(config):
        raise ValueError("the varlen backward on a GPU needs config = {'dkdv': {...}, 'dq': {...}}")
    out = []
    for name in ("dkdv", "dq"):
        given = dict(config.get(name, {}))
        kwargs = {key: given.pop(key, default) for key, default in SCHEDULE_DEFAULTS[name].items()}
        if not on_gpu:  # the interpreter's tiles; the schedule as given
            given = dict(CPU_CONFIG)
        out.append({**given, **kwargs})
    split = out[0]["GROUP_SPLIT"]
    if not (isinstance(split, int) and split >= 1 and group % split == 0):
        raise ValueError(f"GROUP_SPLIT={split!r} must be a positive int dividing the GQA group ({group})")
    return out[0], out[1]


def _grid(tiles: int, rows: int, tile_major: bool) -> tuple[int, int]:
    return (rows, tiles) if tile_major else (tiles, rows)


bwd_preprocess_varlen = _bwd_preprocess_varlen
bwd_dkdv_varlen = _bwd_dkdv_varlen
bwd_dq_varlen = _bwd_dq_varlen


# The kernel under a public name (the @triton.jit function keeps ``_attn_fwd_varlen``, what profilers show).
attn_fwd_varlen = _attn_fwd_varlen
check_boundaries = _check_boundaries

__all__ = [
    "BWD_RUNTIME",
    "ERROR_CU_DECREASE",
    "ERROR_CU_LAST",
    "ERROR_CU_LONG",
    "ERROR_CU_START",
    "PLANNED",
    "check_boundaries",
    "checked_boundaries",
    "RUNTIME_LENGTHS",
    "SCHEDULE_DEFAULTS",
    "attn_fwd_varlen",
    "PREPROCESS_BLOCK_M",
    "backward",
    "bwd_dkdv_varlen",
    "bwd_dq_varlen",
    "bwd_preprocess_varlen",
    "launch",
    "mask_kind",
    "split_schedule",
]
