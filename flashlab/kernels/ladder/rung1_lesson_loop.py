"""Rung 1 of the kernel ladder, "the lesson loop": the forward kernel exactly as the lesson writes it.

One program of the grid owns one tile of ``BLOCK_M`` query rows of one head. It loads its Q tile once, then walks
*every* key/value tile of ``BLOCK_N`` keys, first to last, keeping the three running quantities of the online
softmax in registers:

    m_i  (BLOCK_M,)          running max of the scores (in log2 units: the scale carries log2(e))
    l_i  (BLOCK_M,)          running sum of exp2(s - m_i)
    acc  (BLOCK_M, BLOCK_D)  running un-normalised output, sum of exp2(s - m_i) * v

and writes O and the log-sum-exp once at the end. Each tile does the same five things: S = Q K^T, the element mask
(hidden keys get -inf), the online-softmax step (new max, rescale factor alpha, running sum), and acc = alpha * acc
+ P V. This is the loop notebook 04's exercise completes (``flashlab.exercises.triton_harness`` around the
learner's step), made a full kernel: grouped-query heads, causal and sliding-window masks, any lengths, padded
head dims, fp16/bf16/fp32, and the log-sum-exp. The float64 ground truth is ``flashlab.reference.attention``; the
NumPy loop beside it is ``flashlab.reference.tiled_attention``, which skips the tiles the mask hides -- this kernel
does not.

What it costs, and what the next rung removes: a tile the mask hides from every row of the query tile is still
loaded (BLOCK_N * D * 2 elements of K and V), multiplied and masked, only to add nothing; a tile every row sees
still pays for the element mask and its -inf guards. Under a causal mask about half the tiles are hidden, so this
rung does about twice the work the mask needs. ``rung2_skip_split`` (rung 2) takes the loop bounds from
the mask band instead and runs the fully visible tiles without a mask.

Hidden keys add nothing even when their K or V rows hold inf or NaN: their scores become -inf whatever the dot
gave, and ``softmax_step.accumulate_pv`` keeps 0 * inf out of the rows that do not see them -- the same contract
as every flashlab kernel.

On CUDA tensors the kernel is compiled and autotuned over a small space (``TUNING_SPACE``: two configs per head-dim
class, both also in rung 2's space, so that the two rungs differ by their loops, not by their tiles). On CPU
tensors the same source runs through Triton's interpreter with ``device.CPU_CONFIG``.
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
from flashlab.kernels.softmax_step import LN_2

NAME = "lesson_loop"  # the rung's name in flashlab.kernels.ladder

# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


# fmt: off
@triton.jit
def _lesson_loop_fwd(
    Q, K, V, O, LSE,  # tensors: q, k, v, the output, the log-sum-exp
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HQ, GROUP, NQ, NK,  # query heads, query heads per K/V head, query and key lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    TUNE_KEY_N, TUNE_KEY_ROWS,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (the tile's width)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact fp32 dots), "tf32" otherwise (ignored for 16-bit)
    DOT_UPCAST: tl.constexpr,  # interpreter: feed 16-bit tiles to the dots as fp32 (NumPy has no bf16 matmul)
):
    # fmt: on
    # -- which tile of which head this program owns
    pid_m = tl.program_id(0)
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
    d_ok = offs_d < HEAD_DIM
    diag = offs_m + offset  # (BLOCK_M,) key column on each row's diagonal

    # -- load the Q tile once: BLOCK_M * D * bytes(dtype) from HBM, reused for every key tile
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

    # -- walk every key tile, first to last: none is skipped, every one is masked element by element
    for start_n in range(0, NK, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices of this tile
        k_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :]
        # -- load K tile: BLOCK_N * D * bytes(dtype), even when the mask hides all of it
        k = tl.load(k_ptrs, mask=d_ok[:, None] & (cols[None, :] < NK), other=0.0)  # (BLOCK_D, BLOCK_N)
        if DOT_UPCAST:
            k = k.to(tl.float32)

        # -- S = Q K^T: the score tile, in registers only; 2 * BLOCK_M * BLOCK_N * D FLOPs
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)

        # -- the element mask: hidden keys (outside the band, or past the end) -> -inf -> p = 0
        visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)  # (BLOCK_M, BLOCK_N)
        s = tl.where(visible, s * qk_scale, float("-inf"))

        # -- update m and l: new running max, rescale what was summed against the old one
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)

        # -- load V tile: BLOCK_N * D * bytes(dtype)
        v = tl.load(v_ptrs, mask=(cols[:, None] < NK) & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        if DOT_UPCAST:
            v = v.to(tl.float32)

        # -- rescale the output and accumulate this tile's P V: 2 * BLOCK_M * BLOCK_N * D FLOPs
        acc = acc * alpha[:, None]
        p = p.to(O.dtype.element_ty)  # P enters the second dot in the input dtype, as in FlashAttention
        acc = softmax_step.accumulate_pv(acc, p.to(v.dtype), v, DOT_PRECISION)  # hidden keys add nothing
        m_i = m_new

    # -- epilogue: normalise, write O (BLOCK_M * D * bytes) and lse (BLOCK_M * 4 bytes) once per query tile
    seen = l_i > 0.0  # rows with no visible key keep l = 0: they give zeros and lse = -inf
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN_2, float("-inf"))  # natural log
    row_ok = offs_m < NQ
    tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)
    tl.store(
        o_base + offs_m[:, None] * stride_om + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# ----------------------------------------------------------------------------------------------------------------
# Configs: a small autotuned space on a GPU, CPU_CONFIG on the interpreter
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class: two of rung 2's configs each
# (rung2_skip_split.TUNING_SPACE), the large tile and the 64 x 64 one that short sequences prefer.
TUNING_SPACE = {
    "d<=64": [(128, 64, 4, 3), (64, 64, 4, 3)],
    "d=128": [(128, 64, 8, 3), (64, 64, 4, 3)],
    "d=256": [(64, 64, 4, 2), (64, 32, 4, 2)],
    "fp32": [(64, 32, 4, 2), (64, 64, 4, 2)],
}
FALLBACK_SPACE = [(64, 32, 4, 2), (32, 32, 4, 1)]  # for GPUs with less shared memory, when no config above fits


def tuning_class(block_d: int, dtype) -> str:
    if dtype == torch.float32:
        return "fp32"
    return "d<=64" if block_d <= 64 else ("d=128" if block_d == 128 else "d=256")


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def prune_configs(configs, named_args, **kwargs):
    """Keep this head dim's configs whose Q tile plus pipelined K/V tiles fit the chip's shared memory."""
    bd = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs["BLOCK_D"]
    q = named_args["Q"]
    limit = smem_limit(device_index(q))

    def fits(bm, bn, stages):
        return fits_smem(bm, 2 * bn, stages, bd, q.element_size(), limit)

    wanted = set(TUNING_SPACE[tuning_class(bd, q.dtype)])
    kept = [c for c in configs if (*c.kwargs.values(), c.num_warps, c.num_stages) in wanted]
    kept = [c for c in kept if fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages)]
    if not kept:
        small = [c for c in FALLBACK_SPACE if fits(c[0], c[1], c[3])] or FALLBACK_SPACE[-1:]
        kept = [_config(*c) for c in small]
    return kept


lesson_loop_fwd_tuned = triton.autotune(
    configs=[_config(*c) for c in sorted({c for configs in TUNING_SPACE.values() for c in configs})],
    key=["TUNE_KEY_N", "TUNE_KEY_ROWS", "HEAD_DIM", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_lesson_loop_fwd)


# ----------------------------------------------------------------------------------------------------------------
# The launch
# ----------------------------------------------------------------------------------------------------------------


def launch(q, k, v, o, lse, causal, window, band, config=None):
    """Run the kernel once on prepared inputs, writing ``o (B, Hq, Nq, D)`` and ``lse (B, Hq, Nq)``.

    q ``(B, Hq, Nq, D)``, k and v ``(B, Hk, Nk, D)`` with unit stride along D (the host engine makes them so, and
    negates q for a negative scale); ``band = (offset, win_left, win_right, qk_scale)`` as
    ``flashlab.kernels.device.kernel_band`` gives it. ``causal`` and ``window`` are not needed here: the band already
    holds them, and this rung does the same work whatever the mask. ``config`` (a dict of BLOCK_M, BLOCK_N, num_warps,
    num_stages) fixes the tiles on a GPU (None: the tuned table's, ``flashlab.kernels.configs.pick``, or with
    ``FLASHLAB_AUTOTUNE=1`` the autotuner's); CPU tensors run the interpreter with ``CPU_CONFIG``.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    args = (q, k, v, o, lse)
    args += (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    args += (v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2))
    args += (hq, hq // hk, nq, nk, offset, win_left, win_right, qk_scale)
    args += (next_power_of_2(max(nq, nk)), next_power_of_2(b * hq * nq))  # re-tune per class, not per shape
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d(d),
        DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
        DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
    )
    if not q.is_cuda:
        grid = (cdiv(nq, CPU_CONFIG["BLOCK_M"]), b * hq)
        with interpreted_language(softmax_step):
            interpreted(_lesson_loop_fwd)[grid](*args, **meta, **CPU_CONFIG)
        return

    def grid(meta):
        return (cdiv(nq, meta["BLOCK_M"]), b * hq)

    if config is None and not configs.autotune_enabled():  # the tuned table's (flashlab.kernels.configs)
        config = configs.pick("lesson_loop", **configs.launch_fields(q, hk, nk, offset, win_left, win_right))
    with torch.cuda.device(q.device):
        if config is None:
            lesson_loop_fwd_tuned[grid](*args, **meta)
        else:
            _lesson_loop_fwd[grid](*args, **meta, **config)



# The kernel under a public name, for readers outside this module (notebook 04 prints its source).
lesson_loop_fwd = _lesson_loop_fwd

__all__ = [
    "FALLBACK_SPACE",
    "NAME",
    "TUNING_SPACE",
    "launch",
    "lesson_loop_fwd",
    "lesson_loop_fwd_tuned",
    "prune_configs",
    "tuning_class",
]
