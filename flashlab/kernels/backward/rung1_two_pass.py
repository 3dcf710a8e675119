"""The FlashAttention-2 backward pass as Triton kernels: gradients of q, k and v without the attention matrix.

The forward saved only O and the per-row log-sum-exp L. With P = exp(scale * Q K^T - L) (the probabilities,
recomputed tile by tile from Q, K and L, never stored), the gradients of ``O = P V`` given dO are

    dV = P^T dO                    dP = dO V^T
    dS = P * (dP - delta)          delta = rowsum(dO * O)  ( = rowsum(P * dP), one number per query row)
    dQ = scale * dS K              dK = scale * dS^T Q

and three kernels compute them:

1. ``_bwd_preprocess``: one program per (query tile, batch, query head) computes delta = rowsum(dO * O) in fp32
   and turns L into log2 units for the exp2 of the other two kernels (+inf where L = -inf: a row that sees no key
   then gives P = 0 and a zero gradient, never NaN).
2. ``_bwd_dkdv``: one program per (key tile, batch, K/V head). It holds its K and V tiles and the fp32
   accumulators dK and dV for the whole run, and walks the query tiles that see its keys -- of *every* query head
   of the K/V head's group (grouped-query attention), so the group's sum is formed in registers: no atomics, no
   copy of K/V, and the same result every run.
3. ``_bwd_dq``: one program per (query tile, batch, query head). It holds Q, dO and the fp32 accumulator dQ and
   walks the key tiles its rows see, recomputing P and dS once more.

dQ has its own pass because each of its rows sums over key tiles that different dK/dV programs own: adding the
pieces from those programs would need atomics (nondeterministic order) or memory of size N^2. The price is two
extra matrix products (Q K^T and dO V^T, recomputed) on top of the five that define the gradient.

Both main kernels visit tiles by the same mask band as the forward (``flashlab.core.masking``): tiles the band
hides are never loaded; tiles every row sees run without an element mask; the band's edges run masked. The forward's
three-stage split, seen from a key tile in the dK/dV kernel, reads: query tiles cut by the diagonal, query tiles
that see the whole key tile, query tiles cut by the window's left edge.

CUDA tensors run the compiled kernels. Lengths, the band and the head counts are runtime values (a new length
compiles nothing), and each launch's tiles are looked up by bucket (``flashlab.kernels.configs.pick``, kernels
"backward_dkdv" and "backward_dq"), never tuned inside the call; ``FLASHLAB_AUTOTUNE=1`` brings back the
autotuners over ``TUNING_SPACE``. CPU tensors run the same source through Triton's interpreter with ``CPU_CONFIG``
tiles, as the forward does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.device import (
    CPU_CONFIG,
    LOG2_E,
    block_d,
    device_index,
    dot_precision,
    dot_upcast,
    fits_smem,
    kernel_band,
    smem_limit,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language

# ----------------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------------

_LOG2_E = tl.constexpr(LOG2_E)

# The runtime values of each kernel: never specialised on (a value of 1, divisibility by 16), so one binary serves
# every length, band and head count of a bucket. Strides stay specialised (whether rows are 16-element aligned is
# what lets the compiler vectorise the loads).
PREPROCESS_RUNTIME = ("stride_lb", "stride_lh", "HQ", "NQ", "ROWS")  # the lse's strides: (Hq Nq, Nq)
DKDV_RUNTIME = ("HQ", "HK", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "TUNE_KEY_N", "TUNE_KEY_ROWS",
                "TUNE_KEY_BAND")  # fmt: skip
DQ_RUNTIME = ("HQ", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "reverse_m", "TUNE_KEY_N",
              "TUNE_KEY_ROWS", "TUNE_KEY_BAND")  # fmt: skip


# fmt: off
@triton.jit(do_not_specialize=PREPROCESS_RUNTIME, do_not_specialize_on_alignment=PREPROCESS_RUNTIME)
def _bwd_preprocess(
    O, DO, LSE, DELTA, LSE2,  # output, its gradient, the forward's lse (natural log); outputs delta and lse2
    stride_ob, stride_oh, stride_om,  # strides (elements) over batch, head, row; D has stride 1
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    HQ, NQ,
    ROWS,  # rows per head of delta and lse2: NQ, or more where a kernel reads whole tiles (padding: 0 and +inf)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # fmt: on
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < NQ
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(
        O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0,
    ).to(tl.float32)
    delta = tl.sum(o * do, 1)  # (BLOCK_M,) rowsum(dO * O) in fp32
    lse = tl.load(
        LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_lm,
        mask=row_ok, other=0.0,
    )
    # log2 units for exp2(s * scale * log2(e) - lse2); a row that saw no key (lse = -inf) gets +inf, so P = 0
    lse2 = tl.where((lse == float("-inf")) | (offs_m >= NQ), float("inf"), lse * _LOG2_E)
    tl.store(DELTA + pid_bh.to(tl.int64) * ROWS + offs_m, delta, mask=offs_m < ROWS)
    tl.store(LSE2 + pid_bh.to(tl.int64) * ROWS + offs_m, lse2, mask=offs_m < ROWS)


# fmt: off
@triton.jit(do_not_specialize=DKDV_RUNTIME, do_not_specialize_on_alignment=DKDV_RUNTIME)
def _bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE2, DELTA,  # inputs, upstream gradient, gradients of k and v; lse2, delta (B*HQ, NQ)
    stride_qb, stride_qh, stride_qm,  # strides (elements) over batch, head, row; D has stride 1
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,  # dk and dv share one layout
    HQ, HK, GROUP, NQ, NK,  # query heads, K/V heads, query heads per K/V head, query and key lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale, dk_scale,  # softmax scale * log2(e); the softmax scale
    TUNE_KEY_N, TUNE_KEY_ROWS, TUNE_KEY_BAND,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per inner-loop step
    BLOCK_N: tl.constexpr,  # keys per program
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # fmt: on
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    off_b = pid_bk // HK
    off_hk = pid_bk % HK

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) the keys this program owns
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows, relative to the tile start
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n[:, None] < NK) & d_ok[None, :]

    # -- the K and V tiles stay for the whole program; the padding keys beyond NK are zeros and are never stored
    k = tl.load(
        K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0,
    )  # (BLOCK_N, BLOCK_D)
    v = tl.load(
        V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
        + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0,
    )
    if DOT_UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # -- the query rows that see these keys, from the band (the forward's ranges with rows and keys swapped)
    col_lo = pid_n * BLOCK_N  # first key of the tile
    col_hi = tl.minimum(col_lo + BLOCK_N, NK) - 1  # last real key of the tile
    lo = tl.maximum(col_lo - offset - win_right, 0)  # first row that sees any of the keys
    hi = tl.minimum(col_hi - offset + win_left + 1, NQ)  # one past the last such row
    hi = tl.maximum(hi, lo)
    full_lo = tl.maximum(col_hi - offset - win_right, 0)  # rows >= full_lo see the tile's last key ...
    full_hi = tl.minimum(col_lo - offset + win_left + 1, NQ)  # ... and rows < full_hi its first: all of them
    t_lo = lo // BLOCK_M
    t_hi = (hi + BLOCK_M - 1) // BLOCK_M
    t_full_lo = tl.minimum(tl.maximum((full_lo + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_M, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)

    # One flat loop per stage over (query head of the group, query tile): the GQA sum stays in registers, and a
    # single loop level leaves the compiler the registers that a nested head loop would take (measured in spills).
    for stage in tl.static_range(3):  # rows cut by the diagonal / right edge, rows that see all, the left edge
        if stage == 0:
            t_start, t_end = t_lo, t_full_lo
        elif stage == 1:
            t_start, t_end = t_full_lo, t_full_hi
        else:
            t_start, t_end = t_full_hi, t_hi
        n_tiles = t_end - t_start
        for step in range(0, GROUP * n_tiles):
            g = step // n_tiles
            start_m = (t_start + step - g * n_tiles) * BLOCK_M
            off_h = off_hk * GROUP + g
            q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
            row_base = (off_b * HQ + off_h).to(tl.int64) * NQ  # this head's rows of lse2 and delta
            rows = start_m + offs_m
            q_ptrs = q_base + rows[:, None] * stride_qm + offs_d[None, :]
            do_ptrs = do_base + rows[:, None] * stride_dom + offs_d[None, :]
            if stage == 1:  # every row of the tile is real and sees every key
                if BLOCK_D == HEAD_DIM:
                    q = tl.load(q_ptrs)
                    do = tl.load(do_ptrs)
                else:
                    q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
                    do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
                lse2 = tl.load(LSE2 + row_base + rows)
                delta = tl.load(DELTA + row_base + rows)
            else:  # rows beyond NQ: zeros and lse2 = +inf, so they add nothing
                rmask = (rows[:, None] < NQ) & d_ok[None, :]
                q = tl.load(q_ptrs, mask=rmask, other=0.0)
                do = tl.load(do_ptrs, mask=rmask, other=0.0)
                lse2 = tl.load(LSE2 + row_base + rows, mask=rows < NQ, other=float("inf"))
                delta = tl.load(DELTA + row_base + rows, mask=rows < NQ, other=0.0)
            if DOT_UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)

            # -- S^T = K Q^T and P^T, recomputed from the saved lse: 2 * BLOCK_N * BLOCK_M * D FLOPs
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            s_t = s_t * qk_scale - lse2[None, :]
            if stage != 1:
                # the band's element mask, transposed: key j (axis 0) is seen by row i (axis 1) when
                # j - win_right <= diag_i <= j + win_left; diag_i < NK drops the padding rows beyond NQ
                visible = softmax_step.band_mask(offs_n, rows + offset, win_right, win_left, NK)
                s_t = tl.where(visible, s_t, float("-inf"))
            p_t = tl.math.exp2(s_t)  # (BLOCK_N, BLOCK_M) P^T, normalised: exp(scale * s - lse)

            # -- dV += P^T dO: P enters the dot in the input dtype, as in the forward
            p_in = p_t.to(Q.dtype.element_ty).to(do.dtype)
            dv = tl.dot(p_in, do, dv, input_precision=DOT_PRECISION)
            # -- dP^T = V dO^T, dS^T = P^T * (dP^T - delta), dK += dS^T Q
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])
            ds_in = ds_t.to(Q.dtype.element_ty).to(q.dtype)
            dk = tl.dot(ds_in, q, dk, input_precision=DOT_PRECISION)

    dk = dk * dk_scale
    out = off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
    tl.store(DK + out + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


# fmt: off
@triton.jit(do_not_specialize=DQ_RUNTIME, do_not_specialize_on_alignment=DQ_RUNTIME)  # reverse_m: 0 or 1, one binary
def _bwd_dq(
    Q, K, V, DO, DQ, LSE2, DELTA,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    HQ, GROUP, NQ, NK,
    offset, win_left, win_right,
    qk_scale, dq_scale,  # softmax scale * log2(e); the caller's (signed) scale
    reverse_m,  # 1: start the query tiles with the most work first (causal); a plain int, so no recompile
    TUNE_KEY_N, TUNE_KEY_ROWS, TUNE_KEY_BAND,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # fmt: on
    pid_m = tl.program_id(0)
    if reverse_m != 0:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < NQ
    q_mask = row_ok[:, None] & d_ok[None, :]

    # -- Q, dO, lse2 and delta of the tile stay for the whole program
    q = tl.load(
        Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0,
    )
    do = tl.load(
        DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        + offs_m[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0,
    )
    if DOT_UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE2 + pid_bh.to(tl.int64) * NQ + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * NQ + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- the key tiles this query tile sees: exactly the forward's ranges and stages
    row_lo = pid_m * BLOCK_M
    lo, hi, row_hi = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    full_lo = tl.maximum(row_hi + offset - win_left, 0)
    full_hi = tl.minimum(row_lo + offset + win_right + 1, NK)
    t_lo = lo // BLOCK_N
    t_hi = (hi + BLOCK_N - 1) // BLOCK_N
    t_full_lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_N, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)

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
            if stage == 1:
                if BLOCK_D == HEAD_DIM:
                    k = tl.load(k_ptrs)
                    v = tl.load(v_ptrs)
                else:
                    k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                    v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                kmask = (cols[:, None] < NK) & d_ok[None, :]
                k = tl.load(k_ptrs, mask=kmask, other=0.0)  # (BLOCK_N, BLOCK_D)
                v = tl.load(v_ptrs, mask=kmask, other=0.0)
            if DOT_UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            # -- P, recomputed: 2 * BLOCK_M * BLOCK_N * D FLOPs
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None]
            if stage != 1:
                visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)
                s = tl.where(visible, s, float("-inf"))
            p = tl.math.exp2(s)  # (BLOCK_M, BLOCK_N)
            # -- dP = dO V^T, dS = P * (dP - delta), dQ += dS K
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            ds_in = ds.to(Q.dtype.element_ty).to(k.dtype)
            dq = tl.dot(ds_in, k, dq, input_precision=DOT_PRECISION)

    dq = dq * dq_scale
    tl.store(
        DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
        + offs_m[:, None] * stride_dqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), mask=q_mask,
    )


# ----------------------------------------------------------------------------------------------------------------
# Configs: looked up per bucket on a GPU (or autotuned on request), CPU_CONFIG on the interpreter
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head-dim class: what the autotuners try under
# FLASHLAB_AUTOTUNE=1 and ``python -m flashlab.tune``; a plain launch takes its config from
# ``configs.pick`` (the tuned table, else ``configs.BACKWARD_DEFAULTS``: these lists, the measured pick first). The
# dK/dV kernel holds two fp32 accumulators of BLOCK_N x D (dK and dV): at D = 128 with BLOCK_N = 128 that is 128 KiB
# of registers, which needs 8 warps (with 4 warps every thread would need 256 registers for them alone: the spills
# behind the upstream Triton tutorial's D = 128 slowness). Its streamed tiles are Q and dO (BLOCK_M rows each). The
# dQ kernel holds one accumulator of BLOCK_M x D and streams K and V. At most two configs per class, chosen among
# those whose inner loops compile (sm_90) without register spills, or with only a few (docs/backward.md).
TUNING_SPACE = {
    "dkdv": {
        "d<=64": [(64, 128, 8, 3), (64, 64, 4, 3)],
        "d=128": [(64, 128, 8, 2), (32, 128, 8, 2)],
        "d=256": [(32, 64, 4, 2)],
        "fp32": [(32, 64, 4, 2)],
    },
    "dq": {
        "d<=64": [(128, 64, 8, 3), (64, 64, 4, 3)],
        "d=128": [(128, 64, 8, 2), (64, 64, 8, 3)],
        "d=256": [(64, 32, 4, 2)],
        "fp32": [(64, 32, 4, 2)],
    },
}
# for GPUs with less shared memory, used only when none of the class's own configs fits
FALLBACK_SPACE = [(32, 64, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)]
PREPROCESS_BLOCK_M = 64
CONFIG_KERNELS = {"dkdv": "backward_dkdv", "dq": "backward_dq"}  # each kernel's name in flashlab.kernels.configs


def tuning_class(bd: int, dtype) -> str:
    if dtype == torch.float32:
        return "fp32"
    return "d<=64" if bd <= 64 else ("d=128" if bd == 128 else "d=256")


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _all_configs(kernel):
    return [_config(*c) for c in sorted({c for configs in TUNING_SPACE[kernel].values() for c in configs})]


def _tile(c) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _pruner(kernel):
    def prune(candidates, named_args, **kwargs):
        bd = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs["BLOCK_D"]
        q = named_args["Q"]
        limit = smem_limit(device_index(q))

        def fits(bm, bn, stages):
            rows = configs.resident_and_streamed(CONFIG_KERNELS[kernel], (bm, bn, 0, stages))
            return fits_smem(*rows, stages, bd, q.element_size(), limit)

        wanted = set(TUNING_SPACE[kernel][tuning_class(bd, q.dtype)])
        kept = [c for c in candidates if _tile(c) in wanted]
        kept = [c for c in kept if fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages)]
        if not kept:
            small = [c for c in FALLBACK_SPACE if fits(c[0], c[1], c[3])] or FALLBACK_SPACE[-1:]
            kept = [_config(*c) for c in small]
        return kept

    return prune


_TUNE_KEY = ["TUNE_KEY_N", "TUNE_KEY_ROWS", "TUNE_KEY_BAND", "HEAD_DIM", "DOT_PRECISION"]
_bwd_dkdv_tuned = triton.autotune(
    configs=_all_configs("dkdv"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("dkdv")}
)(_bwd_dkdv)
_bwd_dq_tuned = triton.autotune(
    configs=_all_configs("dq"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("dq")}
)(_bwd_dq)


# ----------------------------------------------------------------------------------------------------------------
# The Python entry point
# ----------------------------------------------------------------------------------------------------------------


# Run the dQ kernel on a second CUDA stream, concurrently with the dK/dV kernel (see attention_backward).
CONCURRENT_DQ = True
_SIDE_STREAMS: dict = {}


def side_stream(x):
    """The second CUDA stream of ``x``'s device on which the dQ kernel runs beside dK/dV (``CONCURRENT_DQ``)."""
    index = device_index(x)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def check_backward_inputs(do, q, k, v, o, lse):
    for name, x in (("do", do), ("o", o), ("lse", lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if do.shape != q.shape or o.shape != q.shape:
        raise ValueError(f"do and o must have q's shape {tuple(q.shape)}; got {tuple(do.shape)} and {tuple(o.shape)}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(q.shape[:-1])} (batch, heads, rows); got {tuple(lse.shape)}")
    if do.dtype != q.dtype or o.dtype != q.dtype:
        raise TypeError(f"do and o must have q's dtype {q.dtype}; got {do.dtype} and {o.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32 (the forward's log-sum-exp); got {lse.dtype}")
    for name, x in (("do", do), ("o", o), ("lse", lse)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}; they must be on the same device")


@dataclass(frozen=True)
class BackwardArguments:
    """What the three kernels of one backward call are launched with: the gradients they write (dq, dk, dv), each
    kernel's non-constexpr arguments in order (``pre_args``, ``dkdv_args``, ``dq_args``, the last two followed by
    ``tune``), the constexprs both main kernels take but their tiles (``common``), and the band (offset,
    win_left, win_right) that picks their configs."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    pre_args: tuple
    dkdv_args: tuple
    dq_args: tuple
    tune: tuple
    common: dict
    band: tuple


def backward_arguments(do, q, k, v, o, lse, causal, window, scale) -> BackwardArguments:
    """The launch arguments of a backward call on checked inputs (``attention_backward`` launches them), with the
    gradients allocated."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    q, k, v, do, o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, do, o))
    if max(nq * q.stride(2), nk * k.stride(2), nk * v.stride(2), nq * do.stride(2), nq * o.stride(2)) >= 2**31:
        raise ValueError("sequence too long for this memory layout (row offsets exceed 2**31); pass contiguous tensors")
    signed_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, nk, d, causal, window, scale)
    # The forward runs a negative scale as (-q, -scale), since its running max needs max(s) * scale = max(s *
    # scale); the backward does the same. Then dK = |scale| dS^T (-q) = scale dS^T q as it should, and the gradient
    # with respect to -q is negated, which multiplying by the signed scale does: dQ = scale dS K.
    q_run = -q if negate else q
    dk_scale = abs(signed_scale)

    delta = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    dq = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hk, nk, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)

    bd = block_d(d)
    pre_args = (o, do, lse, delta, lse2, *o.stride()[:3], *do.stride()[:3], *lse.stride(), hq, nq, nq)
    common = dict(HEAD_DIM=d, BLOCK_D=bd, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda))
    common["DOT_UPCAST"] = dot_upcast(q.dtype, q.is_cuda)
    strides = (*q_run.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    band = (offset, win_left, win_right)
    dkdv_args = (q_run, k, v, do, dk, dv, lse2, delta, *strides, *dk.stride()[:3], hq, hk, hq // hk, nq, nk, *band)
    dkdv_args += (qk_scale, dk_scale)
    dq_args = (q_run, k, v, do, dq, lse2, delta, *strides, *dq.stride()[:3], hq, hq // hk, nq, nk, *band)
    dq_args += (qk_scale, signed_scale, int(bool(causal)))
    band_kind = 0 if window is None and not causal else (1 if window is None else 2)
    tune = (next_power_of_2(max(nq, nk)), next_power_of_2(b * hq * max(nq, nk)), band_kind)

    return BackwardArguments(dq, dk, dv, pre_args, dkdv_args, dq_args, tune, common, band)


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` of ``o = flash_attention(q, k, v, causal, window, scale)`` given ``do = dL/do``.

    q, k, v as for the forward (already checked by ``forward.check_inputs``); ``o`` and ``lse`` are the forward's
    outputs (``lse`` float32, natural log, -inf on rows that see no key); ``do`` has o's shape and dtype. Any
    strides (a last dim that is not contiguous is copied once). The gradients come back in the inputs' dtype, with
    dk and dv shaped like k and v (summed over the query heads of each group). Deterministic: no atomics, so the
    same inputs give bit-identical gradients.

    ``config`` chooses the tiles: ``{"dkdv": {...}, "dq": {...}}``, each a dict of BLOCK_M, BLOCK_N, num_warps,
    num_stages (GPU only; the interpreter always uses ``CPU_CONFIG``). None: each kernel's ``configs.pick`` for the
    call's bucket, or its autotuner when ``FLASHLAB_AUTOTUNE=1``.
    """
    check_backward_inputs(do, q, k, v, o, lse)
    args = backward_arguments(do, q, k, v, o, lse, causal, window, scale)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    bd, dq, dk, dv = args.common["BLOCK_D"], args.dq, args.dk, args.dv
    pre_args, dkdv_args, dq_args, common, tune, band = (args.pre_args, args.dkdv_args, args.dq_args, args.common,
                                                         args.tune, args.band)  # fmt: skip

    if q.is_cuda:
        with torch.cuda.device(q.device):
            _bwd_preprocess[(cdiv(nq, PREPROCESS_BLOCK_M), b * hq)](
                *pre_args, HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=PREPROCESS_BLOCK_M
            )

            def dkdv_grid(meta):
                return (cdiv(nk, meta["BLOCK_N"]), b * hk)

            def dq_grid(meta):
                return (cdiv(nq, meta["BLOCK_M"]), b * hq)

            # dK/dV and dQ need only the preprocess's output, not each other: with CONCURRENT_DQ the dQ kernel runs
            # on a second stream, so its programs fill the SMs the dK/dV kernel's last (causal: shortest) programs
            # leave idle. Each writes only its own gradients, so the results do not depend on the overlap.
            main = torch.cuda.current_stream()
            side = side_stream(q) if CONCURRENT_DQ else main
            side.wait_stream(main)  # the preprocess's delta and lse2
            autotune = config is None and configs.autotune_enabled()
            if config is None and not autotune:
                config = picked_configs(q, hk, nk, band)
            if autotune:
                _bwd_dkdv_tuned[dkdv_grid](*dkdv_args, *tune, **common)
            else:
                _bwd_dkdv[dkdv_grid](*dkdv_args, *tune, **common, **config["dkdv"])
            with torch.cuda.stream(side):
                if autotune:
                    _bwd_dq_tuned[dq_grid](*dq_args, *tune, **common)
                else:
                    _bwd_dq[dq_grid](*dq_args, *tune, **common, **config["dq"])
            main.wait_stream(side)  # everything after this call sees dq (and no buffer is reused while dq runs)
    else:
        bm, bn = CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"]
        with interpreted_language(softmax_step):
            interpreted(_bwd_preprocess)[(cdiv(nq, bm), b * hq)](*pre_args, HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm)
            interpreted(_bwd_dkdv)[(cdiv(nk, bn), b * hk)](*dkdv_args, *tune, **common, **CPU_CONFIG)
            interpreted(_bwd_dq)[(cdiv(nq, bm), b * hq)](*dq_args, *tune, **common, **CPU_CONFIG)
    return dq, dk, dv


def picked_configs(q, kv_heads: int, nk: int, band: tuple) -> dict:
    """``{"dkdv": {...}, "dq": {...}}``: each kernel's tiles for a launch of ``q (B, Hq, Nq, D)`` against
    ``kv_heads`` K/V heads of ``nk`` keys with ``band = (offset, win_left, win_right)``, from
    ``configs.pick`` (the bucket's tuned entry, else the fixed default)."""
    fields = configs.launch_fields(q, kv_heads, nk, *band)  # the group is not in a backward bucket
    return {name: configs.pick(kernel, **fields) for name, kernel in CONFIG_KERNELS.items()}


def best_configs() -> dict:
    """The autotuners' last picks for the two backward kernels under ``FLASHLAB_AUTOTUNE=1`` (for the
    benchmark's records); None for a kernel that has not autotuned (without it, ``picked_configs`` says what a
    launch takes)."""
    picks = {"dkdv": getattr(_bwd_dkdv_tuned, "best_config", None), "dq": getattr(_bwd_dq_tuned, "best_config", None)}
    return {name: None if c is None else str(c) for name, c in picks.items()}


bwd_preprocess = _bwd_preprocess  # the preprocess kernel, for the rungs that share it (rung2_hopper)

__all__ = [
    "CONCURRENT_DQ",
    "TUNING_SPACE",
    "attention_backward",
    "best_configs",
    "bwd_preprocess",
    "check_backward_inputs",
    "picked_configs",
    "side_stream",
    "tuning_class",
]
