"""The FP8 forward: attention over float8 (e4m3) q, k and v, with the products on Hopper's 8-bit tensor cores.

Hopper multiplies 8-bit operands at twice the 16-bit rate, so a forward whose two products take e4m3 inputs can
go faster than any 16-bit kernel -- at the cost of its numerics: e4m3 keeps 3 mantissa bits. The inputs come
quantised with one scale per (sequence, K/V head), as FlashAttention-3 takes them: the true q is ``q8 * q_descale``
(and k, v alike), so

    S = (q8 k8^T) * (q_descale * k_descale * scale)     the first product on 8-bit operands, fp32 accumulate
    P = exp2(S - m)  in [0, 1], rounded to e4m3          the probabilities, 8-bit operands of the second product
    O = (P v8) * v_descale / l                           normalised, written in bfloat16

Three kernels run it. On Hopper at D = 64 and 128, rung 4's Gluon kernel with its ``FP8`` flag
(``flashlab.kernels.ladder.rung4_overlap.launch_fp8``: the softmax of one key tile under the tensor cores' work on
the last, the warpgroups taking turns; P reaches the second product through shared memory). Otherwise on Hopper,
``_attn_fwd_fp8_tma`` is rung 3's loop (``flashlab.kernels.ladder.rung3_hopper``):
tiles copied by the tensor-memory engine, one branch-free loop whose copies run in warps of their own. Elsewhere
(and on the CPU) ``_attn_fwd_fp8`` is rung 2's (``flashlab.kernels.ladder.rung2_skip_split``): pointer loads, the
tiles every row sees fully without an element mask, the edges with it. Both walk the band's key tiles only, keep
the online softmax in fp32 and log2 units, and read a K/V head of a GQA group in place; what changes from the
16-bit rungs is the operands' type, the scale folded into the first product's result, and V, which comes
transposed (``transposed_v``) so that its tiles have the keys along the 8-bit product's inner dimension. A NaN
byte in a key or value a row does not see still reaches that row (0 times NaN): e4m3 has no infinities, and the
quantiser writes no NaN.

    per program: BLOCK_M * D (Q, 1 byte each) + per visible key tile 2 * BLOCK_N * D (K, V), write BLOCK_M * D * 2
    (O, bf16) + BLOCK_M * 4 (lse)

On the CPU (Triton's interpreter) the operands are widened to fp32 before each product, and P enters the second
product unrounded: the interpreter's fp32 -> e4m3 conversion does not round as the GPU's does, so the CPU path
checks the algorithm (scales, band, softmax) against float64 of the dequantised inputs, and the GPU tests check
P's rounding too. The ground truth is ``flashlab.reference.attention`` on the dequantised inputs.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import error_record as error_record_module
from flashlab.kernels import softmax_step
from flashlab.kernels.device import CPU_CONFIG, block_d, ensure_allocator
from flashlab.kernels.error_record import report_error
from flashlab.kernels.interpreter import interpreted, interpreted_language

# Lengths and the band are runtime values: a new length never compiles another binary.
RUNTIME_LENGTHS = ("HQ", "HK", "GROUP", "NQ", "NK", "offset", "win_left", "win_right")
HEAD_DIMS = (64, 128, 256)  # the head dims the FP8 forward takes (the fast rung's)
# Tiles on a GPU (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim, the fastest measured on the H200 of those
# tried (docs/forward-ladder.md, "FP8")
GPU_TILES = {64: (128, 128, 4, 3), 128: (128, 128, 8, 3), 256: (128, 64, 8, 2)}
# The tensor-memory-engine kernel's tiles: four warps, warp-specialised, as in rung 3; the fastest measured on the
# H200 (docs/forward-ladder.md, "FP8"). Three stages gave NaN outputs there on Triton 3.6, as they did for rung 3.
TMA_TILES = {64: (128, 128, 4, 2), 128: (128, 128, 4, 2), 256: (128, 64, 4, 2)}
FP8_DTYPE = torch.float8_e4m3fn
# P enters the second product times 2^8: in [0, 256] its values stay in e4m3's normal range (from 2^-6) down to
# weights of 2^-14, each with e4m3's 3 bits; unscaled, every weight below 2^-6 would lose bits (below 2^-10, all).
# A power of two, so the scaling and its undoing are exact; O is divided by it with V's scale.
P_SCALE_VALUE = 256.0
P_SCALE = tl.constexpr(P_SCALE_VALUE)
KEY_ALIGN = 16  # V^T's rows (one per head-dim column) padded to this many keys: 16-byte aligned vector loads
# The descales are checked on the device, never read on the host (a synchronisation a call): a (sequence, K/V
# head) whose q, k or v descale is not finite and > 0 gets NaN in every output row and lse of its group, and
# ``_check_descales`` reports the first such scale in the device's error record (``flashlab.kernels.error_record``;
# the host raises it at the next call, ``flashlab.host.kvcache_errors``): kind ERROR_FP8_SCALE, batch and column
# the sequence and K/V head, value the scale's float32 bits, limit which scale (an index into SCALE_NAMES).
ERROR_FP8_SCALE = 8
_FP8_SCALE = tl.constexpr(ERROR_FP8_SCALE)  # a kernel reads a module's constant only as a constexpr
SCALE_NAMES = ("q_descale", "k_descale", "v_descale")
CHECK_BLOCK = 1024  # descales one step of the check reads


@triton.jit
def scales_ok(qd, kd, vd):
    """Whether three descales are all finite and > 0 (a NaN fails every comparison)."""
    return (qd > 0) & (qd < float("inf")) & (kd > 0) & (kd < float("inf")) & (vd > 0) & (vd < float("inf"))


@triton.jit
def _check_descales(Q_DESCALE, K_DESCALE, V_DESCALE, ERRORS, N, HK, BLOCK: tl.constexpr):
    """One program: report the first descale (q's, then k's, then v's, each in (sequence, K/V head) order) that is
    not finite and > 0. The main kernel writes NaN where one is; this says which, without the host reading them."""
    for which in tl.static_range(3):
        if which == 0:
            scales = Q_DESCALE
        elif which == 1:
            scales = K_DESCALE
        else:
            scales = V_DESCALE
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(scales + offs, mask=offs < N, other=1.0)
            bad = (offs < N) & ~((x > 0) & (x < float("inf")))
            first = tl.min(tl.where(bad, offs, N), 0)
            if first < N:
                value = tl.load(scales + first)
                report_error(ERRORS, _FP8_SCALE, first // HK, first % HK, value.to(tl.int32, bitcast=True),
                             which)  # fmt: skip


@triton.jit
def _fp8_tile(q, acc, m_i, l_i, k_base, vt_base, n0, stride_kn, stride_vd, offs_n, offs_d, d_ok, rows_diag, NK,
              win_left, win_right, qk_scale, MASKED: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One key tile of the loop: the scores, the online softmax step, ``P V`` added in. ``MASKED``: the tile cuts
    the band or the keys' end (an element mask), else every row sees every key of it. V comes transposed,
    ``(D, Nk)`` with the keys contiguous: the tile the 8-bit product wants, keys along its inner dimension, loaded
    as it is (a ``(BLOCK_N, D)`` tile would be transposed in shared memory a byte at a time)."""
    cols = n0 + offs_n
    if MASKED:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=(cols[:, None] < NK) & d_ok[None, :],
                    other=0.0)  # fmt: skip
        vt = tl.load(vt_base + offs_d[:, None] * stride_vd + cols[None, :], mask=d_ok[:, None] & (cols[None, :] < NK),
                     other=0.0)  # fmt: skip
    else:
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        vt = tl.load(vt_base + offs_d[:, None] * stride_vd + cols[None, :], mask=d_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N): 8-bit operands, fp32 sums, the scales folded in
    if MASKED:
        s = tl.where(softmax_step.band_mask(rows_diag, cols, win_left, win_right, NK), s, float("-inf"))
    p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p * P_SCALE, tl.trans(vt), acc)
    else:  # P in [0, 1], times 2^8 into e4m3's normal range, rounded: the second product on 8-bit operands
        acc = tl.dot((p * P_SCALE).to(vt.dtype), tl.trans(vt), acc)
    return acc, m_new, l_i


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=RUNTIME_LENGTHS)
def _attn_fwd_fp8(
    Q, K, VT, O, LSE,  # q, k (B, H, N, D) and v transposed, (B, Hk, D, Nk'), float8 e4m3; O bf16; LSE float32
    Q_DESCALE, K_DESCALE, V_DESCALE,  # float32 (B, Hk): the true q of K/V head h's group is q8 * Q_DESCALE[b, h]
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vd,  # V^T's strides over batch, head, head-dim row; keys have stride 1
    stride_ob, stride_oh, stride_om,
    HQ, HK, GROUP, NQ, NK,  # heads, query heads per K/V head, lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    sm_scale_log2,  # |softmax scale| * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: fp32 operands, P unrounded (see the module docstring)
):
    # fmt: on
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    vt_base = VT + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    scales = off_b * HK + off_hk
    qd, kd, v_descale = tl.load(Q_DESCALE + scales), tl.load(K_DESCALE + scales), tl.load(V_DESCALE + scales)
    qk_scale = qd * kd * sm_scale_log2
    ok = scales_ok(qd, kd, v_descale)  # else NaN rows (_check_descales reports which scale)

    row_lo = pid_m * BLOCK_M
    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < NQ
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    rows_diag = offs_m + offset

    # the keys any row of the tile sees, [lo, hi); inside it, the tiles every row sees whole: [full_lo, full_hi)
    lo, hi, row_hi = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    lo = lo // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum((row_hi + offset - win_left + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
    full_hi = tl.maximum((tl.minimum(row_lo + offset + win_right + 1, NK) // BLOCK_N) * BLOCK_N, full_lo)
    full_hi = tl.minimum(full_hi, hi)
    for n0 in range(lo, full_lo, BLOCK_N):  # the window's left edge
        acc, m_i, l_i = _fp8_tile(q, acc, m_i, l_i, k_base, vt_base, n0, stride_kn, stride_vd, offs_n, offs_d, d_ok,
                                  rows_diag, NK, win_left, win_right, qk_scale, True, UPCAST)  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):  # every row sees every key: no element mask
        acc, m_i, l_i = _fp8_tile(q, acc, m_i, l_i, k_base, vt_base, n0, stride_kn, stride_vd, offs_n, offs_d, d_ok,
                                  rows_diag, NK, win_left, win_right, qk_scale, False, UPCAST)  # fmt: skip
    for n0 in range(full_hi, hi, BLOCK_N):  # the diagonal and the keys' end
        acc, m_i, l_i = _fp8_tile(q, acc, m_i, l_i, k_base, vt_base, n0, stride_kn, stride_vd, offs_n, offs_d, d_ok,
                                  rows_diag, NK, win_left, win_right, qk_scale, True, UPCAST)  # fmt: skip

    # acc holds P_SCALE * P V, l the sum of P: o comes out P_SCALE times too large, undone with V's scale (exactly:
    # a power of two), and the log-sum-exp is P's own
    o, lse = softmax_step.normalise(acc, m_i, l_i)
    o = tl.where(ok, o * (v_descale / P_SCALE), float("nan"))
    tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, tl.where(ok, lse, float("nan")), mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=RUNTIME_LENGTHS)
def _attn_fwd_fp8_tma(
    Q, K, VT, O, LSE,  # as _attn_fwd_fp8's, all contiguous: rows of every head one after another
    Q_DESCALE, K_DESCALE, V_DESCALE,
    HQ, HK, GROUP, NQ, NK, NK_PAD,  # heads, lengths, V^T's padded row length
    offset, win_left, win_right,
    sm_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr,  # the window's left edge can cut a tile
    MASK_RIGHT: tl.constexpr,  # the diagonal, the window's right edge or the end of the keys can cut a tile
    EVEN_M: tl.constexpr,  # NQ is a multiple of BLOCK_M: O goes out through the copy engine
    WARP_SPECIALIZE: tl.constexpr,  # the copies in warps of their own
):
    # fmt: on
    """The FP8 forward as rung 3 (``flashlab.kernels.ladder.rung3_hopper``) runs the bf16 one: every tile copied by
    the tensor-memory engine from 2-D views (the rows of every head one after another), one loop with no branch
    (the mask applied arithmetically where the band has an edge), its copies warp-specialised. A key tile that runs
    past its head reads the next head's first keys, which the mask hides; V^T's padding columns are zeros."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    kv_head = pid_bh // GROUP  # = batch * HK + the K/V head
    q_row0 = pid_bh * NQ
    kv_row0 = kv_head * NK
    vt_row0 = kv_head * HEAD_DIM
    heads = tl.num_programs(1)
    desc_q = tl.make_tensor_descriptor(Q, [heads * NQ, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, BLOCK_D])
    desc_k = tl.make_tensor_descriptor(K, [heads // GROUP * NK, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, BLOCK_D])
    desc_vt = tl.make_tensor_descriptor(VT, [heads // GROUP * HEAD_DIM, NK_PAD], [NK_PAD, 1], [BLOCK_D, BLOCK_N])
    desc_o = tl.make_tensor_descriptor(O, [heads * NQ, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, BLOCK_D])
    qd, kd, v_descale = tl.load(Q_DESCALE + kv_head), tl.load(K_DESCALE + kv_head), tl.load(V_DESCALE + kv_head)
    qk_scale = qd * kd * sm_scale_log2
    ok = scales_ok(qd, kd, v_descale)  # else NaN rows (_check_descales reports which scale)

    row_lo = pid_m * BLOCK_M
    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_row0 + row_lo, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([kv_row0 + start_n, 0])
        s = tl.dot(q, k.T) * qk_scale
        if MASK_LEFT or MASK_RIGHT:
            visible = softmax_step.edge_visible(start_n + offs_n, first_key, last_key, MASK_LEFT, MASK_RIGHT)
            s = tl.where(visible, s, float("-inf"))
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        vt = desc_vt.load([vt_row0, start_n])  # (BLOCK_D, BLOCK_N): the keys along the product's inner dimension
        acc = tl.dot((p * P_SCALE).to(vt.dtype), vt.T, acc * alpha[:, None])
        m_i = m_new

    o, lse = softmax_step.normalise(acc, m_i, l_i)  # o P_SCALE times too large, undone with V's scale
    tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, tl.where(ok, lse, float("nan")), mask=offs_m < NQ)
    o = tl.where(ok, o * (v_descale / P_SCALE), float("nan")).to(O.dtype.element_ty)
    if EVEN_M:
        desc_o.store([q_row0 + row_lo, 0], o)
    else:  # the last tile would spill into the next head's rows: masked stores
        offs_d = tl.arange(0, BLOCK_D)
        o_ptrs = O + (q_row0 + offs_m).to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, o, mask=(offs_m < NQ)[:, None] & (offs_d < HEAD_DIM)[None, :])


def tma_available(q) -> bool:
    """Whether ``launch_tma`` can run for q's GPU: device-side tensor descriptors in this Triton, a Hopper or
    later GPU (the tensor-memory engine)."""
    return hasattr(tl, "make_tensor_descriptor") and torch.cuda.get_device_capability(q.device) >= (9, 0)


def launch_tma(q, k, v, o, lse, q_descale, k_descale, v_descale, band, causal, window, tiles=None):
    """``launch``'s work through ``_attn_fwd_fp8_tma`` (a GPU with device-side tensor descriptors, sm_90): q, k
    contiguous, o contiguous. ``tiles`` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides ``TMA_TILES``."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, sm_scale_log2 = band
    vt = transposed_v(v)
    bm, bn, warps, stages = tiles or TMA_TILES[d]
    mask_left = window is not None and window[0] is not None
    mask_right = bool(causal) or (window is not None and window[1] is not None) or nk % bn != 0
    ensure_allocator()
    with torch.cuda.device(q.device):
        _attn_fwd_fp8_tma[(cdiv(nq, bm), b * hq)](
            q, k, vt, o, lse, q_descale, k_descale, v_descale, hq, hk, hq // hk, nq, nk, vt.shape[3], offset,
            win_left, win_right, sm_scale_log2, HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn,
            MASK_LEFT=mask_left, MASK_RIGHT=mask_right, EVEN_M=nq % bm == 0, WARP_SPECIALIZE=warps == 4,
            num_warps=warps, num_stages=stages)  # fmt: skip


def transposed_v(v):
    """V ``(B, Hk, Nk, D)`` as the kernel reads it: ``(B, Hk, D, Nk)`` with the keys contiguous, each row padded to
    ``KEY_ALIGN`` keys (one copy of V's bytes, a fraction of the products' time from a few hundred keys)."""
    b, hk, nk, d = v.shape
    padded = -(-nk // KEY_ALIGN) * KEY_ALIGN
    vt = torch.empty((b, hk, d, padded), dtype=v.dtype, device=v.device)
    vt[..., :nk].copy_(v.transpose(2, 3))
    if padded > nk:  # zeros, never garbage: a copy of a whole tile reads them (0 times a NaN byte would be NaN)
        vt[..., nk:].view(torch.uint8).zero_()
    return vt


def check_descales(q_descale, k_descale, v_descale, errors) -> None:
    """Launch ``_check_descales`` over the three ``(B, Hk)`` float32 descales (contiguous): the first that is not
    finite and > 0 goes into ``errors``, the device's error record. One program, a few loads."""
    b, hk = q_descale.shape
    args = (q_descale, k_descale, v_descale, errors, b * hk, hk)
    if not q_descale.is_cuda:
        with interpreted_language(error_record_module, sys.modules[__name__]):
            interpreted(_check_descales)[(1,)](*args, BLOCK=CHECK_BLOCK)
        return
    with torch.cuda.device(q_descale.device):
        _check_descales[(1,)](*args, BLOCK=CHECK_BLOCK)


def launch(q, k, v, o, lse, q_descale, k_descale, v_descale, band, tiles=None):
    """Run the FP8 forward on checked inputs: q ``(B, Hq, Nq, D)``, k and v ``(B, Hk, Nk, D)`` e4m3 with unit stride
    along D, the descales float32 ``(B, Hk)`` contiguous, o ``(B, Hq, Nq, D)`` bfloat16 and lse ``(B, Hq, Nq)``
    float32 contiguous; ``band = (offset, win_left, win_right, sm_scale_log2)`` as ``kernel_band`` gives it.
    ``tiles`` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides ``GPU_TILES`` on a GPU."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, sm_scale_log2 = band
    vt = transposed_v(v)
    args = (q, k, vt, o, lse, q_descale, k_descale, v_descale, *q.stride()[:3], *k.stride()[:3], *vt.stride()[:3],
            *o.stride()[:3], hq, hk, hq // hk, nq, nk, offset, win_left, win_right, sm_scale_log2)  # fmt: skip
    meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), UPCAST=not q.is_cuda)
    if not q.is_cuda:
        grid = (cdiv(nq, CPU_CONFIG["BLOCK_M"]), b * hq)
        with interpreted_language(softmax_step, sys.modules[__name__]):  # the device functions it calls
            interpreted(_attn_fwd_fp8)[grid](*args, **meta, **CPU_CONFIG)
        return
    bm, bn, warps, stages = tiles or GPU_TILES[d]
    with torch.cuda.device(q.device):
        _attn_fwd_fp8[(cdiv(nq, bm), b * hq)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                              num_stages=stages)  # fmt: skip


attn_fwd_fp8 = _attn_fwd_fp8
attn_fwd_fp8_tma = _attn_fwd_fp8_tma

__all__ = ["ERROR_FP8_SCALE", "FP8_DTYPE", "GPU_TILES", "HEAD_DIMS", "KEY_ALIGN", "P_SCALE_VALUE", "RUNTIME_LENGTHS",
           "SCALE_NAMES", "TMA_TILES", "attn_fwd_fp8", "attn_fwd_fp8_tma", "check_descales", "launch", "launch_tma",
           "tma_available", "transposed_v"]
