"""The backward's Hopper rung: ``rung1_two_pass``'s two tile loops, fed by the tensor-memory accelerator, with the
copies handed to warps of their own.

It computes what ``rung1_two_pass`` computes -- delta = rowsum(dO * O) first, then dK and dV per key tile and dQ
per query tile, each gradient element written once, in a fixed order, with no atomics (the same inputs give
bit-identical gradients) -- and changes what the forward's rung 3 changed for the forward:

- **TMA tensor descriptors, made on the device.** Q, dO, K and V are each described as one 2-D tensor, the rows
  of all heads one after another, and the row statistics as 1-D tensors; every tile either kernel reads, resident
  or streamed, is one copy-engine instruction. No address arithmetic, no load masks, no registers spent on
  pointers.
- **The row statistics padded to whole tiles.** The preprocess writes delta and the lse (log2 units) with
  ``ROWS`` = Nq rounded up to ``ROW_ALIGN`` rows per head, the padding 0 and +inf: a query tile that runs past its
  head's last row (into the next head's rows, or past the end of the tensor) gets P = exp2(s - inf) = 0 there, so
  those rows add nothing, without a mask.
- **A warp-specialised loop** (``tl.range(..., warp_specialize=True)``, four-warp programs): a producer warpgroup
  issues the copies for the tiles ahead while two consumer warpgroups run the products and the element-wise work,
  each on half the tile's rows -- the keys in the dK/dV kernel, the queries in the dQ kernel. At D = 256 the
  accumulators do not fit two consumer warpgroups; eight warps run the same loop unspecialised (``GPU_TILES``).

What that costs, as in the forward's rung 3: the pass takes one loop with no branch, so where the band has an edge
every tile gets the element mask (two compares and a select per score; ``softmax_step.edge_visible``), and the dQ
kernel masks the last key tile's keys past Nk (the next head's first rows) the same way. Two more things Triton
3.6's pass refuses, found by compiling for sm_90: a plain (pointer) load before the loop whose value the loop
reads (the pass fails), and a runtime branch before the loop (specialisation silently off); so every resident tile
comes through a descriptor, and the causal tile order is a constexpr.

Where it runs: compiled on a CUDA GPU with compute capability >= 9 (Hopper), 16-bit q, k and v whose heads are
stacked row after row (``unavailable`` says why not otherwise; a dO in another layout is copied into that one). On
CPU tensors the same source runs through Triton's interpreter, descriptors and all. Its speed against rung 1 is in
``docs/backward.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.backward import rung1_two_pass as two_pass
from flashlab.kernels.device import (
    CPU_CONFIG,
    TMA_MIN_CAPABILITY,
    block_d,
    dot_precision,
    dot_upcast,
    ensure_allocator,
    hidden_sides,
    kernel_band,
    rows_stacked,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language

NAME = "hopper"  # the rung's name in flashlab.kernels.backward
ROW_ALIGN = 128  # delta and lse2 rows per head are padded to a multiple of this (every BLOCK_M divides it)
WARP_SPECIALIZED_WARPS = configs.HOPPER_WARP_SPECIALIZED_WARPS  # Triton's Hopper pass specialises four-warp programs

DKDV_RUNTIME = ("HQ", "GROUP", "NQ", "NK", "ROWS", "offset", "win_left", "win_right")
DQ_RUNTIME = DKDV_RUNTIME


# ----------------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------------


# fmt: off
@triton.jit(do_not_specialize=DKDV_RUNTIME, do_not_specialize_on_alignment=DKDV_RUNTIME)
def _bwd_dkdv_hopper(
    Q, K, V, DO, DK, DV, LSE2, DELTA,  # lse2 and delta: (B * HQ, ROWS), padded rows +inf and 0
    DQ_ACC,  # DQ_ATOMIC: float32 (B * HQ, ROWS, BLOCK_D), zeros, where every program adds its part of dQ / scale
    LOCKS,  # DQ_ORDERED: int32 (B * HQ, ROWS // BLOCK_M), zeros: how many key tiles have added into each query tile
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dkn,  # row strides (heads stacked, D contiguous)
    HQ, GROUP, NQ, NK, ROWS,
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale, dk_scale,  # softmax scale * log2(e); the softmax scale
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per loop step
    BLOCK_N: tl.constexpr,  # keys per program
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HIDE_BEFORE: tl.constexpr,  # the diagonal or a window's right edge hides a key from rows before it
    HIDE_AFTER: tl.constexpr,  # a window's left edge hides a key from rows after it
    WARP_SPECIALIZE: tl.constexpr,
    DQ_ATOMIC: tl.constexpr = False,  # rungs 3 and 4: dQ from this loop too (dS K added into DQ_ACC), no dQ kernel
    DQ_ORDERED: tl.constexpr = False,  # rung 4: the key tiles add into a query tile one after another, in order
):
    # fmt: on
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)  # (batch, K/V head); its query heads are pid_bk * GROUP + g
    rows_all = tl.num_programs(1) * GROUP  # query heads in all (B * HQ)
    desc_q = tl.make_tensor_descriptor(Q, [rows_all * NQ, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
    desc_do = tl.make_tensor_descriptor(DO, [rows_all * NQ, HEAD_DIM], [stride_dom, 1], [BLOCK_M, BLOCK_D])
    desc_l = tl.make_tensor_descriptor(LSE2, [rows_all * ROWS], [1], [BLOCK_M])
    desc_dl = tl.make_tensor_descriptor(DELTA, [rows_all * ROWS], [1], [BLOCK_M])
    kv_rows = tl.num_programs(1) * NK
    desc_k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
    desc_v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])

    col_lo = pid_n * BLOCK_N
    offs_n = col_lo + tl.arange(0, BLOCK_N)  # (BLOCK_N,) the keys this program owns
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = (offs_n[:, None] < NK) & (offs_d[None, :] < HEAD_DIM)
    kv_row0 = pid_bk.to(tl.int64) * NK
    # K and V stay for the whole program; keys past NK (the next head's, or zeros) are never stored
    k = desc_k.load([pid_bk * NK + col_lo, 0])
    v = desc_v.load([pid_bk * NK + col_lo, 0])
    if DOT_UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # -- the query tiles that see any of these keys (the two-pass rung's range); each key's first and last row
    col_hi = tl.minimum(col_lo + BLOCK_N, NK) - 1
    lo = tl.maximum(col_lo - offset - win_right, 0)
    hi = tl.maximum(tl.minimum(col_hi - offset + win_left + 1, NQ), lo)
    t_lo = lo // BLOCK_M
    n_tiles = (hi + BLOCK_M - 1) // BLOCK_M - t_lo
    first_row, last_row = softmax_step.edge_rows(offs_n, offset, win_left, win_right)

    # One loop over (query head of the group, query tile), no branch in it (the warp-specialising pass takes
    # straight-line code): the GQA sum stays in registers, the mask is arithmetic.
    for step in tl.range(0, GROUP * n_tiles, warp_specialize=WARP_SPECIALIZE):
        g = step // n_tiles
        start_m = (t_lo + step - g * n_tiles) * BLOCK_M
        head = pid_bk * GROUP + g  # (batch, query head) flattened
        q = desc_q.load([head * NQ + start_m, 0])  # rows past NQ: the next head's, or zeros; P = 0 there
        do = desc_do.load([head * NQ + start_m, 0])
        lse2 = desc_l.load([head * ROWS + start_m])  # +inf past NQ
        delta = desc_dl.load([head * ROWS + start_m])
        if DOT_UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # -- P^T from the saved lse; dV += P^T dO; dK += dS^T Q
        dk, dv, ds_t = softmax_step.backward_key_tile(Q, k, v, q, do, lse2, delta, dk, dv, start_m, offs_m,
                                                      first_row, last_row, qk_scale, HIDE_BEFORE, HIDE_AFTER,
                                                      DOT_PRECISION)  # fmt: skip
        if DQ_ATOMIC:  # dQ += dS K for these rows: the keys past NK (the next head's) must add nothing here
            ds_real = tl.where((offs_n < NK)[:, None], ds_t, 0.0).to(Q.dtype.element_ty).to(k.dtype)
            dq_part = tl.dot(tl.trans(ds_real), k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
            acc_rows = head.to(tl.int64) * ROWS + start_m + offs_m  # rows past NQ land in the padding
            acc_ptrs = DQ_ACC + acc_rows[:, None] * BLOCK_D + offs_d[None, :]
            if DQ_ORDERED:
                # Key tile pid_n is the turn-th of the key tiles that see this query tile (they are consecutive:
                # the band is convex): wait until the turn earlier ones have added theirs, add, pass the turn on.
                # Programs of lower key tiles are launched first, and none waits on a later one: no deadlock.
                lock = LOCKS + head.to(tl.int64) * (ROWS // BLOCK_M) + start_m // BLOCK_M
                turn = pid_n - tl.maximum(start_m + offset - win_left, 0) // BLOCK_N
                seen = tl.atomic_add(lock, 0, sem="acquire")
                while seen != turn:
                    seen = tl.atomic_add(lock, 0, sem="acquire")
                # past the L1 cache, which another program's adds never reach
                tl.store(acc_ptrs, tl.load(acc_ptrs, cache_modifier=".cg") + dq_part)
                tl.debug_barrier()  # every thread's stores are in before the turn is passed on
                tl.atomic_xchg(lock, turn + 1, sem="release")
            else:
                tl.atomic_add(acc_ptrs, dq_part, sem="relaxed")

    out = (kv_row0 + offs_n[:, None]) * stride_dkn + offs_d[None, :]
    tl.store(DK + out, (dk * dk_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


# fmt: off
@triton.jit(do_not_specialize=DQ_RUNTIME, do_not_specialize_on_alignment=DQ_RUNTIME)
def _bwd_dq_hopper(
    Q, K, V, DO, DQ, LSE2, DELTA,
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
    HQ, GROUP, NQ, NK, ROWS,
    offset, win_left, win_right,
    qk_scale, dq_scale,  # softmax scale * log2(e); the caller's (signed) scale
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    MASK_LEFT: tl.constexpr,  # a window's left edge can cut a key tile
    MASK_RIGHT: tl.constexpr,  # the diagonal, a window's right edge or the end of the keys can cut a key tile
    REVERSE_M: tl.constexpr,  # causal: the query tiles with the most keys first (a runtime branch here turns
    WARP_SPECIALIZE: tl.constexpr,  # Triton 3.6's warp specialisation off, silently)
):
    # fmt: on
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    kv_rows = tl.num_programs(1) // GROUP * NK  # K/V rows of every head
    desc_k = tl.make_tensor_descriptor(K, [kv_rows, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
    desc_v = tl.make_tensor_descriptor(V, [kv_rows, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
    kv_row0 = (pid_bh // GROUP) * NK

    row_lo = pid_m * BLOCK_M
    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = (offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_DIM)
    q_rows = pid_bh.to(tl.int64) * NQ + offs_m
    q_all = tl.num_programs(1) * NQ
    desc_q = tl.make_tensor_descriptor(Q, [q_all, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
    desc_do = tl.make_tensor_descriptor(DO, [q_all, HEAD_DIM], [stride_dom, 1], [BLOCK_M, BLOCK_D])
    # Q, dO, lse2 and delta stay for the whole program; rows past NQ (the next head's, or zeros) have P = 0
    q = desc_q.load([pid_bh * NQ + row_lo, 0])
    do = desc_do.load([pid_bh * NQ + row_lo, 0])
    if DOT_UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # (a plain load here, before the loop, makes Triton 3.6's warp-specialisation pass fail: the copy engine's)
    desc_l = tl.make_tensor_descriptor(LSE2, [tl.num_programs(1) * ROWS], [1], [BLOCK_M])
    desc_dl = tl.make_tensor_descriptor(DELTA, [tl.num_programs(1) * ROWS], [1], [BLOCK_M])
    lse2 = desc_l.load([pid_bh * ROWS + row_lo])  # rows past NQ: +inf, so P = 0
    delta = desc_dl.load([pid_bh * ROWS + row_lo])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([kv_row0 + start_n, 0])  # keys past NK: the next head's, or zeros; masked below
        v = desc_v.load([kv_row0 + start_n, 0])
        if DOT_UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dq = softmax_step.backward_query_tile(Q, q, do, lse2, delta, k, v, dq, start_n, offs_n, first_key, last_key,
                                              qk_scale, MASK_LEFT, MASK_RIGHT, DOT_PRECISION)  # fmt: skip

    out = q_rows[:, None] * stride_dqm + offs_d[None, :]
    tl.store(DQ + out, (dq * dq_scale).to(DQ.dtype.element_ty), mask=q_ok)


# ----------------------------------------------------------------------------------------------------------------
# Configs, where it runs, the launch
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class and kernel, chosen by compiling for sm_90 (Triton
# 3.6) for the fewest spills. Four warps are warp-specialised: a producer warpgroup and two consumer warpgroups that
# split the accumulators' rows (keys for dK/dV, queries for dQ); at D <= 128 that compiles without spills, or with
# a few bytes. At D = 256 the accumulators do not fit two consumer warpgroups (4 KB of spills at every tile size
# tried), so eight warps run the loop without the specialisation: the copy engine's tiles, software-pipelined, no
# spills.
GPU_TILES = {
    "dkdv": {"d<=64": (64, 128, 4, 2), "d=128": (64, 128, 4, 2), "d=256": (32, 64, 8, 2)},
    "dq": {"d<=64": (128, 64, 4, 2), "d=128": (128, 64, 4, 2), "d=256": (64, 32, 8, 2)},
}


# Rung 3's dK/dV loop (``DQ_ATOMIC``) on eight warps, never warp-specialised: with four, Triton 3.6's pass failed
# at 128-key tiles and, at 64-key tiles, compiled the atomic adds away (no atomic instruction left in the sm_90
# code). Eight plain warps keep them, vectorised four floats at a time, spill-free with these tiles.
ATOMIC_TILES = {"d<=64": (64, 128, 8, 2), "d=128": (32, 128, 8, 2), "d=256": (32, 64, 8, 2)}


def tiles(kernel: str, d: int) -> dict:
    """The launch config of ``kernel`` ("dkdv", "dq", or "dkdv_atomic": rung 3's) at head dim ``d`` on a GPU."""
    table = ATOMIC_TILES if kernel == "dkdv_atomic" else GPU_TILES[kernel]
    bm, bn, warps, stages = table[configs.head_dim_class(NAME, "bfloat16", block_d(d))]
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                WARP_SPECIALIZE=warps == WARP_SPECIALIZED_WARPS)  # fmt: skip


def unavailable(q, k, v, do) -> str | None:
    """Why this rung cannot run the backward of these inputs here, or None."""
    if q.dtype == torch.float32:
        return "it runs 16-bit inputs only (its products are the tensor cores'); float32 goes to two_pass"
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"Triton {triton.__version__} has no device-side tensor descriptors (needs Triton >= 3.4)"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < TMA_MIN_CAPABILITY:
            return f"it needs a Hopper GPU or newer (compute capability >= {TMA_MIN_CAPABILITY}.0), not {major}.{minor}"
    if not all(rows_stacked(x) for x in (q, k, v)):
        return "its copy engine reads q, k and v as rows of heads one after another (contiguous, 16-byte aligned)"
    return None  # do in another layout is copied into one (one pass over dO, against the backward's many)


# Where the default backward runs this rung: the head dims that pad to this tile width. Measured against rung 1 on
# the backward grid (bf16, 16K tokens a batch, N 1K-16K, causal and not, one H100, 2026-12-06): 1.18-1.52x at
# D = 128; at D = 64 0.76-1.04x, geo-mean 0.94x, losing most at short and causal lengths (docs/backward.md).
PREFERRED_BLOCK_D = 128


def prefers_head_dim(d: int) -> bool:
    """Whether ``d`` pads to ``PREFERRED_BLOCK_D``, the tile width where this rung measured faster than rung 1."""
    return block_d(d) == PREFERRED_BLOCK_D


def preferred(q, k, v, do) -> bool:
    """Whether the default backward picks this rung where it can run: on a GPU, at the head dims
    ``prefers_head_dim`` names (the interpreter keeps rung 1, the one the notebooks read)."""
    return q.is_cuda and prefers_head_dim(q.shape[-1])


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` as ``two_pass.attention_backward`` returns them, through this rung's
    kernels. ``config``: ``{"dkdv": {...}, "dq": {...}}`` (BLOCK_M, BLOCK_N, num_warps, num_stages and optionally
    WARP_SPECIALIZE) instead of ``tiles``; the interpreter runs ``CPU_CONFIG``. A RuntimeError where ``unavailable``
    says why it cannot run."""
    return run_backward(do, q, k, v, o, lse, causal, window, scale, config)


def run_backward(do, q, k, v, o, lse, causal, window, scale, config=None, dq_atomic=False, dq_ordered=False):
    """``attention_backward``'s work; ``dq_atomic``: rung 3's (``rung3_atomic_dq``): dQ added up in the dK/dV
    loop with atomic adds into a float32 buffer, then scaled and rounded, and no dQ kernel (``config["dq"]`` is
    not read); with ``dq_ordered`` too, rung 4's (``rung4_ordered_dq``): the same adds, in a fixed order."""
    two_pass.check_backward_inputs(do, q, k, v, o, lse)
    why = unavailable(q, k, v, do)
    if why is not None:
        raise RuntimeError(f"the hopper backward cannot run these inputs: {why}")
    do = do if rows_stacked(do) else do.contiguous()
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    signed_scale = 1.0 / d**0.5 if scale is None else float(scale)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, nk, d, causal, window, scale)
    q_run = -q if negate else q  # as rung 1: the running max's positive scale, dQ by the signed one
    rows = cdiv(nq, ROW_ALIGN) * ROW_ALIGN
    delta = torch.empty((b * hq, rows), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dq = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hk, nk, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    o = o if o.stride(-1) == 1 else o.contiguous()
    bd = block_d(d)
    # rung 3's dQ, summed over key tiles in float32 (rows padded as delta's: rows past NQ add into the padding)
    dq_acc = torch.zeros((b * hq, rows, bd), dtype=torch.float32, device=q.device) if dq_atomic else delta
    if config is None:
        config = {"dkdv": tiles("dkdv_atomic" if dq_atomic else "dkdv", d), "dq": tiles("dq", d)}
    locks_per_head = rows // (config["dkdv"]["BLOCK_M"] if q.is_cuda else CPU_CONFIG["BLOCK_M"])
    locks = torch.zeros((b * hq, locks_per_head), dtype=torch.int32, device=q.device) if dq_ordered else lse2
    pre_args = (o, do, lse, delta, lse2, *o.stride()[:3], *do.stride()[:3], *lse.stride(), hq, nq, rows)
    band = (offset, win_left, win_right)
    sizes = (hq, hq // hk, nq, nk, rows, *band)
    dkdv_args = (q_run, k, v, do, dk, dv, lse2, delta, dq_acc, locks, q.stride(2), k.stride(2), v.stride(2))
    dkdv_args += (do.stride(2), dk.stride(2), *sizes, qk_scale, abs(signed_scale))
    dq_args = (q_run, k, v, do, dq, lse2, delta, q.stride(2), k.stride(2), v.stride(2), do.stride(2), dq.stride(2))
    dq_args += (*sizes, qk_scale, signed_scale)
    left, right = hidden_sides(nq, nk, (*band, qk_scale))
    common = dict(HEAD_DIM=d, BLOCK_D=bd, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
                  DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda))  # fmt: skip
    if not q.is_cuda:
        bm, bn = CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"]
        run = dict(**common, **CPU_CONFIG, WARP_SPECIALIZE=False)
        with interpreted_language(softmax_step):
            interpreted(two_pass.bwd_preprocess)[(cdiv(rows, bm), b * hq)](*pre_args, HEAD_DIM=d,
                                                                                  BLOCK_D=bd, BLOCK_M=bm)  # fmt: skip
            interpreted(_bwd_dkdv_hopper)[(cdiv(nk, bn), b * hk)](*dkdv_args, **run, HIDE_BEFORE=right,
                                                                 HIDE_AFTER=left, DQ_ATOMIC=dq_atomic,
                                                                 DQ_ORDERED=dq_ordered)  # fmt: skip
            if not dq_atomic:
                interpreted(_bwd_dq_hopper)[(cdiv(nq, bm), b * hq)](*dq_args, **run, MASK_LEFT=left,
                                                                   MASK_RIGHT=right or nk % bn != 0,
                                                                   REVERSE_M=bool(causal))  # fmt: skip
        return _summed_dq(dq_acc, dq, signed_scale) if dq_atomic else dq, dk, dv
    kv_config, q_config = ({"WARP_SPECIALIZE": c["num_warps"] == WARP_SPECIALIZED_WARPS, **c} for c in
                           (config["dkdv"], config.get("dq", tiles("dq", d))))  # fmt: skip
    if dq_atomic:  # never specialised: the pass drops or refuses the atomic adds (ATOMIC_TILES)
        kv_config["WARP_SPECIALIZE"] = False
    ensure_allocator()
    with torch.cuda.device(q.device):
        pre_m = two_pass.PREPROCESS_BLOCK_M
        two_pass.bwd_preprocess[(cdiv(rows, pre_m), b * hq)](*pre_args, HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=pre_m)
        # dQ on a second stream beside dK/dV, as rung 1 does: each writes only its own gradients
        main = torch.cuda.current_stream()
        side = two_pass.side_stream(q) if two_pass.CONCURRENT_DQ else main
        side.wait_stream(main)
        flags = dict(HIDE_BEFORE=right, HIDE_AFTER=left, DQ_ATOMIC=dq_atomic, DQ_ORDERED=dq_ordered)
        _bwd_dkdv_hopper[(cdiv(nk, kv_config["BLOCK_N"]), b * hk)](*dkdv_args, **common, **kv_config, **flags)
        if dq_atomic:
            return _summed_dq(dq_acc, dq, signed_scale), dk, dv
        with torch.cuda.stream(side):
            _bwd_dq_hopper[(cdiv(nq, q_config["BLOCK_M"]), b * hq)](
                *dq_args, **common, **q_config, MASK_LEFT=left, MASK_RIGHT=right or nk % q_config["BLOCK_N"] != 0,
                REVERSE_M=bool(causal),
            )
        main.wait_stream(side)
    return dq, dk, dv


def _summed_dq(dq_acc, dq, signed_scale):
    """dQ from rung 3's float32 sums: the real rows and columns, times the (signed) scale, in q's dtype."""
    b, hq, nq, d = dq.shape
    dq.copy_(dq_acc.view(b, hq, -1, dq_acc.shape[-1])[:, :, :nq, :d] * signed_scale)
    return dq


bwd_dkdv_hopper = _bwd_dkdv_hopper
bwd_dq_hopper = _bwd_dq_hopper

__all__ = ["ATOMIC_TILES", "GPU_TILES", "NAME", "ROW_ALIGN", "attention_backward", "bwd_dkdv_hopper", "bwd_dq_hopper",
           "run_backward", "tiles", "unavailable"]  # fmt: skip
