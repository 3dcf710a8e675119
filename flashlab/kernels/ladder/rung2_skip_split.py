"""Rung 2 of the kernel ladder, "skip and split": the forward kernel that loads only the key tiles a mask leaves
visible, and runs the tiles every row sees without any mask.

It is the tiled loop of ``flashlab.reference.tiled_attention``, line for line. One program of the grid owns one tile
of ``BLOCK_M`` query rows of one head. It loads its Q tile once, then walks the key/value tiles of ``BLOCK_N`` keys
that the mask leaves visible, keeping only the three running quantities of the online softmax in registers:

    m_i  (BLOCK_M,)          running max of the scores (in log2 units: the scale carries log2(e))
    l_i  (BLOCK_M,)          running sum of exp2(s - m_i)
    acc  (BLOCK_M, BLOCK_D)  running un-normalised output, sum of exp2(s - m_i) * v

and writes O and the log-sum-exp once at the end. The score tile S (BLOCK_M x BLOCK_N) lives in registers only;
the Nq x Nk score matrix is never written to memory. The float64 ground truth is ``flashlab.reference.attention``.

What it removes against rung 1 (``rung1_lesson_loop``, which visits every key tile and masks every one):
the key tiles a query tile visits are split into three stages by the mask band (``flashlab.core.masking``):

    stage 0: tiles cut by the window's left edge      (element mask)
    stage 1: tiles every row of the query tile sees    (no mask: the fast inner loop)
    stage 2: tiles cut by the diagonal / right edge, or by the end of the keys (element mask)

Tiles outside the band are never loaded: the loop bounds come from the band, not from a per-tile test. In the two
masked stages a hidden key gets p = 0 and adds nothing to a row's output, even if its V row holds inf or NaN
(``softmax_step.accumulate_pv``; a plain ``tl.dot`` would make 0 * inf = NaN for every row of the tile); a row that
does see such a value comes out NaN. Stage 1 keeps the plain dot, since every row sees every key there. Under a
causal mask the query tiles start with the ones that have the most key tiles to walk (``REVERSE_M``), so the
longest programs do not run last.

Loads: plain pointer loads with masks (``tl.load``) everywhere; on Hopper at head dims <= 64 the tiles are moved
by the tensor-memory accelerator instead (``desc.load``, TMA: one instruction per tile, out-of-bounds rows and
columns filled with zeros), which measured 5-10 % faster there (``docs/forward-ladder.md``).

On CUDA tensors the kernel is compiled (autotuned over block sizes, warps and pipeline stages). On CPU tensors the
very same kernel source runs through Triton's interpreter (``device.CPU_CONFIG``), so every notebook runs without a
GPU. The host engine (``flashlab.host``) checks the inputs, plans a call and launches this kernel (its fast path for
repeated calls lives there); ``launch`` here is the plain launch, with the benchmark's switches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.device import (
    CPU_CONFIG,
    block_d,
    device_index,
    dot_precision,
    dot_upcast,
    fits_smem,
    smem_limit,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language

NAME = "skip_split"  # the rung's name in flashlab.kernels.ladder

# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


# Lengths and the band are runtime values: a new length never compiles another binary (Triton would otherwise
# specialise an integer that is 1 or divisible by 16). The strides stay specialised: whether each is divisible by
# 16 (aligned vector loads) is part of the host engine's plan key. The lse is stored one float a row.
RUNTIME_LENGTHS = ("HQ", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "TUNE_KEY_N", "TUNE_KEY_ROWS",
                   "TUNE_KEY_BAND")  # fmt: skip


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=(*RUNTIME_LENGTHS, "LSE"))
def _attn_fwd(
    Q, K, V, O, LSE,  # tensors: q, k, v, the output, the log-sum-exp
    desc_q, desc_k, desc_v, desc_o,  # TMA tensor descriptors of q, k, v, o (Hopper); unused without USE_TMA
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HQ, GROUP, NQ, NK,  # query heads, query heads per K/V head, query and key lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    TUNE_KEY_N, TUNE_KEY_ROWS, TUNE_KEY_BAND,  # only read by the autotuner (its cache key)
    HEAD_DIM,  # D: a runtime value, so head dims of one padded width share a binary (80 and 96, 160 and 192)
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (the tile's width)
    PADDED: tl.constexpr,  # BLOCK_D > D: the columns past D are masked (read as 0, never written)
    D_ALIGN: tl.constexpr,  # the largest power of two (at most 16) dividing D: lets the masked loads vectorise
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact fp32 dots), "tf32" otherwise (ignored for 16-bit)
    DOT_UPCAST: tl.constexpr,  # interpreter: feed 16-bit tiles to the dots as fp32 (NumPy has no bf16 matmul)
    REVERSE_M: tl.constexpr,  # causal: start the query tiles with the most work first
    USE_TMA: tl.constexpr,  # load/store whole tiles with the tensor-memory accelerator (out-of-bounds -> zeros)
):
    # fmt: on
    # -- which tile of which head this program owns
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = pid_bh // HQ
    off_h = pid_bh % HQ
    off_hk = off_h // GROUP  # GQA: query head h reads K/V head h // group; K/V are never copied

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key columns, relative to the tile start
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,) head-dim columns (padding beyond HEAD_DIM masked)
    if PADDED:  # D as (D // D_ALIGN) * D_ALIGN, the same number, which the compiler knows divides by D_ALIGN
        d_ok = offs_d < (HEAD_DIM // D_ALIGN) * D_ALIGN
    else:
        d_ok = offs_d < BLOCK_D

    # -- load the Q tile once: BLOCK_M * D * bytes(dtype) from HBM, reused for every key tile
    if USE_TMA:
        q = desc_q.load([off_b, off_h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(
            q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
            mask=(offs_m[:, None] < NQ) & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)
    if DOT_UPCAST:  # exact: a 16-bit value is also an fp32 value, and the tensor cores multiply them exactly too
        q = q.to(tl.float32)

    # -- the running state of the online softmax
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running output

    # -- the key range this tile needs, from the band (flashlab.core.masking.visible_band / tile_state)
    row_lo = pid_m * BLOCK_M  # first query row of the tile
    # [lo, hi): the keys any row sees (hi == lo for an empty band, e.g. causal with Nq > Nk: no tile at all)
    lo, hi, row_hi = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    full_lo = tl.maximum(row_hi + offset - win_left, 0)  # every row sees keys >= full_lo ...
    full_hi = tl.minimum(row_lo + offset + win_right + 1, NK)  # ... and < full_hi
    # in tiles: [t_lo, t_full_lo) stage 0, [t_full_lo, t_full_hi) stage 1, [t_full_hi, t_hi) stage 2
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    t_full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(full_hi, 0) // BLOCK_N, t_hi)
    t_full_hi = tl.maximum(t_full_hi, t_full_lo)

    diag = offs_m + offset  # (BLOCK_M,) key column on each row's diagonal

    for stage in tl.static_range(3):  # unrolled at compile time: three copies of the loop, masked or not
        if stage == 0:
            t_start, t_end = t_lo, t_full_lo
        elif stage == 1:
            t_start, t_end = t_full_lo, t_full_hi
        else:
            t_start, t_end = t_full_hi, t_hi
        for start_n in range(t_start * BLOCK_N, t_end * BLOCK_N, BLOCK_N):
            cols = start_n + offs_n  # (BLOCK_N,) key indices of this tile
            k_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None]
            v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
            # -- load K tile: BLOCK_N * D * bytes(dtype) (from L2 when the other query tiles of this head read it)
            if USE_TMA:
                k = desc_k.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D).T
            elif stage == 1:
                if not PADDED:
                    k = tl.load(k_ptrs)
                else:
                    k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=d_ok[:, None] & (cols[None, :] < NK), other=0.0)  # (BLOCK_D, BLOCK_N)
            if DOT_UPCAST:
                k = k.to(tl.float32)

            # -- S = Q K^T: the score tile, in registers only; 2 * BLOCK_M * BLOCK_N * D FLOPs
            s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)

            # -- update m and l: new running max, rescale what was summed against the old one
            if stage == 1:  # every row sees every key of the tile: no mask, no -inf guard
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                alpha = tl.math.exp2(m_i - m_new)  # 0 on the row's first tile (m_i = -inf)
                p = tl.math.exp2(s * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N) exp(scale * (s - m))
                l_i = l_i * alpha + tl.sum(p, 1)
            else:  # the element mask, only on the band's edges; hidden scores -> -inf -> p = 0
                visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)  # (BLOCK_M, BLOCK_N)
                s = tl.where(visible, s * qk_scale, float("-inf"))
                p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)

            # -- load V tile: BLOCK_N * D * bytes(dtype)
            if USE_TMA:
                v = desc_v.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            elif stage == 1:
                if not PADDED:
                    v = tl.load(v_ptrs)
                else:
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

    # -- epilogue: normalise, write O (BLOCK_M * D * bytes) and lse (BLOCK_M * 4 bytes) once per query tile
    o, lse = softmax_step.normalise(acc, m_i, l_i)  # rows with no visible key: zeros and lse = -inf
    row_ok = offs_m < NQ
    tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)
    if USE_TMA:
        desc_o.store([off_b, off_h, pid_m * BLOCK_M, 0], o.to(O.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        tl.store(
            o_base + offs_m[:, None] * stride_om + offs_d[None, :],
            o.to(O.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


# ----------------------------------------------------------------------------------------------------------------
# Configs: compiled (autotuned) on a GPU, one small config on the interpreter
# ----------------------------------------------------------------------------------------------------------------


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried per head-dim class. Hopper (sm_90) and Ampere (sm_80/86/89) both
# like BLOCK_M = 128 with 8 warps once D reaches 128 (two 64-row warpgroups share the Q tile), 4-8 warps at D <= 64,
# and 2-4 pipeline stages for the K/V loads. Short sequences (N ~ 1-2K) prefer 64 x 64 tiles: twice the programs
# to spread over the 132 SMs of an H200 (measured: docs/forward-ladder.md). At D = 256 a 128 x 256 fp32
# accumulator would crowd out the registers, so BLOCK_M drops to 64. fp32 inputs take exact (non-tensor-core)
# dots: small tiles.
TUNING_SPACE = {
    "d<=64": [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 3)],
    "d=128": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4)],
    "d=256": [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
    # fp32's dots are exact ("ieee"): FMA loops that each thread unrolls, and ptxas's time grows faster than their
    # count; eight warps share a tile's FMAs between twice the threads (a cold compile of the D = 128 causal kernel
    # for sm_90: 9.7 s with four warps, 3.7 s with eight; docs/host-path.md)
    "fp32": [(64, 32, 8, 2), (64, 32, 4, 2)],
}


def tuning_class(block_d: int, dtype) -> str:
    if dtype == torch.float32:
        return "fp32"
    return "d<=64" if block_d <= 64 else ("d=128" if block_d == 128 else "d=256")


def set_tma_block_shapes(nargs):
    """Autotuner pre-hook: the TMA descriptors' box is the tile, so it changes with BLOCK_M / BLOCK_N."""
    if _TensorDescriptor is not None and isinstance(nargs["desc_q"], _TensorDescriptor):
        bm, bn, bd = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
        nargs["desc_q"].block_shape = nargs["desc_o"].block_shape = [1, 1, bm, bd]
        nargs["desc_k"].block_shape = nargs["desc_v"].block_shape = [1, 1, bn, bd]


def _config(bm, bn, warps, stages):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages, pre_hook=set_tma_block_shapes
    )


def _gpu_configs():
    return [_config(*c) for c in sorted({c for configs in TUNING_SPACE.values() for c in configs})]


# Smaller configs for GPUs with less shared memory (e.g. ~100 KiB per block on consumer cards), used only when
# none of the head dim's own configs fits.
FALLBACK_SPACE = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)]


def prune_configs(configs, named_args, **kwargs):
    """Keep this head dim's configs whose Q tile plus pipelined K/V tiles fit the chip's shared memory."""
    bd = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs["BLOCK_D"]
    q = named_args["Q"]
    limit = smem_limit(device_index(q))

    def fits(bm, bn, stages):  # the Q tile stays; K and V tiles (2 x BLOCK_N rows) are pipelined `stages` deep
        return fits_smem(bm, 2 * bn, stages, bd, q.element_size(), limit)

    wanted = set(TUNING_SPACE[tuning_class(bd, q.dtype)])
    kept = [c for c in configs if (*c.kwargs.values(), c.num_warps, c.num_stages) in wanted]
    kept = [c for c in kept if fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages)]
    if not kept:
        small = [c for c in FALLBACK_SPACE if fits(c[0], c[1], c[3])] or FALLBACK_SPACE[-1:]
        kept = [_config(*c) for c in small]
    return kept


attn_fwd_tuned = triton.autotune(
    configs=_gpu_configs(),
    key=["TUNE_KEY_N", "TUNE_KEY_ROWS", "TUNE_KEY_BAND", "HEAD_DIM", "DOT_PRECISION", "USE_TMA"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_attn_fwd)

try:  # host-side TMA descriptors (Triton >= 3.3); the interpreter path never uses them
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None
# TMA loads paid at head dims <= 64 on the H200 (+5-10 %) but not at 128 (-3..+3 %, and erratic run to run at
# N = 1K causal): docs/forward-ladder.md.
TMA_MAX_HEAD_DIM = 64
# ...and with a causal or window mask at N <= 1K it swung between 0.89x and 1.30x FA2 from run to run at
# D = 64 (same tile config each time), while pointer loads gave 1.22x every time: pointer loads there.
TMA_MIN_MASKED_KEYS = 1024


def tma_descriptors(q, k, v, o):
    """TMA descriptors for q, k, v, o on Hopper or newer, or None where TMA cannot be used (older GPU, older
    Triton, or a tensor whose address or strides are not 16-byte aligned)."""
    bd = block_d(q.shape[-1])  # the box width; the pre-hook sets the box height
    if _TensorDescriptor is None or bd > TMA_MAX_HEAD_DIM or torch.cuda.get_device_capability(q.device)[0] < 9:
        return None
    for x in (q, k, v, o):
        strides = [st for st, n in zip(x.stride()[:-1], x.shape[:-1], strict=True) if n > 1]
        if x.data_ptr() % 16 or any(st * x.element_size() % 16 for st in strides):
            return None
    return [_TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, bd]) for x in (q, k, v, o)]


def tune_key(b, hq, nq, nk, causal, window) -> tuple[int, int, int]:
    """The autotuner's cache key beyond the kernel's constexprs: the power-of-two length, the power-of-two amount of
    work (B * Hq * Nq query rows) and the kind of band (0 none, 1 causal, 2 window) -- re-tuned per class, not per
    shape."""
    band_kind = 0 if window is None and not causal else (1 if window is None else 2)
    return next_power_of_2(max(nq, nk)), next_power_of_2(b * hq * nq), band_kind


def kernel_meta(q, causal, reverse_m=None) -> dict:
    """The kernel's constexprs but the tile sizes and ``USE_TMA``, for inputs like ``q``: one set for every head
    dim of a padded width (D itself is a runtime argument, the last of ``SCALAR_PARAMETERS``)."""
    d = q.shape[-1]
    return dict(
        BLOCK_D=block_d(d),
        PADDED=block_d(d) != d,
        D_ALIGN=min(d & -d, 16),
        DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
        DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
        REVERSE_M=bool(causal) if reverse_m is None else reverse_m,
    )


def wants_tma(causal, window, nk: int) -> bool:
    """The kernel's own TMA choice: not for a masked call over few keys (erratic on the H200: docs/)."""
    return not ((causal or window is not None) and nk <= TMA_MIN_MASKED_KEYS)


def launch(q, k, v, o, lse, causal, window, band, config=None, reverse_m=None, use_tma=None):
    """Run the kernel once on prepared inputs, writing ``o (B, Hq, Nq, D)`` and ``lse (B, Hq, Nq)``.

    q ``(B, Hq, Nq, D)``, k and v ``(B, Hk, Nk, D)`` with unit stride along D (the host engine makes them so, and
    negates q for a negative scale); ``band = (offset, win_left, win_right, qk_scale)`` as
    ``flashlab.kernels.device.kernel_band`` gives it. The benchmark's switches (None: the kernel's own choice):
    ``config`` (a dict of BLOCK_M, BLOCK_N, num_warps, num_stages) fixes the tiles (None: the tuned table's,
    ``flashlab.kernels.configs.pick``, or with ``FLASHLAB_AUTOTUNE=1`` the autotuner's), ``reverse_m`` overrides the
    causal tile order, ``use_tma`` turns TMA loads on or off where they can be used. CPU tensors run the interpreter
    with ``CPU_CONFIG``.
    """
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    if use_tma is None:
        use_tma = wants_tma(causal, window, nk)
    descs = tma_descriptors(q, k, v, o) if q.is_cuda and use_tma else None
    args = (q, k, v, o, lse) + (tuple(descs) if descs else (q, k, v, o))
    args += (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    args += (v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2))
    args += (hq, hq // hk, nq, nk, offset, win_left, win_right, qk_scale)
    args += (*tune_key(b, hq, nq, nk, causal, window), q.shape[-1])
    meta = {**kernel_meta(q, causal, reverse_m), "USE_TMA": descs is not None}
    if not q.is_cuda:
        grid = (cdiv(nq, CPU_CONFIG["BLOCK_M"]), b * hq)
        with interpreted_language(softmax_step):
            interpreted(_attn_fwd)[grid](*args, **meta, **CPU_CONFIG)
        return

    def grid(meta):
        return (cdiv(nq, meta["BLOCK_M"]), b * hq)

    if config is None and not configs.autotune_enabled():  # the tuned table's (flashlab.kernels.configs)
        config = configs.pick("skip_split", **configs.launch_fields(q, hk, nk, offset, win_left, win_right))
    with torch.cuda.device(q.device):
        if config is None:
            attn_fwd_tuned[grid](*args, **meta)
        else:
            descs_by_name = dict(zip(("desc_q", "desc_k", "desc_v", "desc_o"), args[5:9], strict=True))
            set_tma_block_shapes({**descs_by_name, **meta, **config})
            _attn_fwd[grid](*args, **meta, **config)



# The kernel under a public name, for the modules that launch it (``flashlab.host.launches``); the @triton.jit
# function keeps the name ``_attn_fwd``, which is what profilers and the recorded Nsight traffic files show.
attn_fwd = _attn_fwd
# every scalar parameter after the tensors and descriptors, in order: what the host engine passes per call
_NAMES = attn_fwd.arg_names
SCALAR_PARAMETERS = tuple(_NAMES[_NAMES.index("stride_qb") : _NAMES.index("BLOCK_D")])

__all__ = [
    "FALLBACK_SPACE",
    "NAME",
    "RUNTIME_LENGTHS",
    "SCALAR_PARAMETERS",
    "TMA_MAX_HEAD_DIM",
    "TMA_MIN_MASKED_KEYS",
    "TUNING_SPACE",
    "attn_fwd",
    "attn_fwd_tuned",
    "kernel_meta",
    "launch",
    "prune_configs",
    "set_tma_block_shapes",
    "tma_descriptors",
    "tune_key",
    "tuning_class",
    "wants_tma",
]
