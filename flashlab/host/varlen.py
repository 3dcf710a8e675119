"""``flash_attention_varlen``: attention over a batch of sequences of different lengths, packed without padding.

The layout is FlashAttention's ``flash_attn_varlen_func`` (and PyTorch's ``torch.nn.attention.varlen.varlen_attn``):
the rows of every sequence one after the other, ``(total, heads, D)``, and the boundaries in ``cu_seqlens``, the
int32 running sums of the lengths. flashlab's other entry points take ``(B, H, N, D)``.

- ``flash_attention_varlen``: the entry point (eager, autograd, or one ``torch.ops.flashlab.attention_varlen``
  node under ``torch.compile``).
- ``check_varlen_inputs``: what the call signature fixes (shapes, dtypes, devices, mask, scale);
  the boundaries themselves are checked on the device by default (``flashlab.kernels.varlen.checked_boundaries``,
  reported through the device's error record, ``flashlab.host.kvcache_errors``), or read on the host with
  ``check_values="sync"`` (``check_cu_seqlens_values``: one synchronisation on a GPU).
- ``varlen_forward`` and ``varlen_backward``: the forward kernel (``flashlab.kernels.varlen``) and the gradients,
  launched on a GPU through the host engine's plans (``flashlab.host.launches.planned_launch``): Triton's JIT for
  the first calls of a binary, then a direct launch of it, whatever the batch's lengths.

The backward is FlashAttention-2's (``flashlab.kernels.backward.rung1_two_pass``'s three kernels, in the varlen
variants of ``flashlab.kernels.varlen``): one launch each for the whole batch, every program reading its sequence
from cu_seqlens, the probabilities recomputed from the saved lse.
"""

from __future__ import annotations

import functools
import numbers

import torch
from torch.autograd.function import once_differentiable

from flashlab.core.masking import visible_band
from flashlab.host.attention import window_to_ints
from flashlab.host.autograd import check_no_lse_gradient
from flashlab.host.checks import (
    DEVICE_CHECK,
    NO_CHECK,
    SYNC_CHECK,
    check_causal,
    check_dense,
    check_head_dim,
    check_scale,
    check_values_flag,
)
from flashlab.host.kvcache_errors import boundary_message, error_record, raise_recorded, unreported_record
from flashlab.host.launches import planned_launch
from flashlab.kernels import varlen
from flashlab.kernels.backward import rung1_two_pass as two_pass
from flashlab.kernels.device import DTYPES, block_d, device_index, fits_smem, kernel_band, smem_limit, stream_capturing

MAX_ROW_OFFSET = 2**31  # the kernel's offsets inside one sequence are 32-bit


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return int(value)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale):
    """Validate what a varlen call's signature fixes: a TypeError or ValueError naming the argument. Returns the
    batch size B (``len(cu_seqlens_q) - 1``)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_dense(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; flash_attention_varlen supports float16, bfloat16, float32")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"flash_attention_varlen runs on CUDA (compiled) or CPU (interpreted) tensors; got {q.device}")
    for name, x in (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {x.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims (total_rows, heads, head_dim); got shape {tuple(x.shape)}")
    total_k, hk, d = k.shape
    if v.shape[0] != total_k or v.shape[1] != hk:
        raise ValueError(f"k and v must have the same rows and heads; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"q, k and v must have the same head dim; got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    check_head_dim(q.shape[2])
    hq = q.shape[1]
    if hq < 1 or hk < 1 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the key/value heads ({hk}), both at least 1")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32; got {cu.dtype}")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (B + 1,) with B >= 1; got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        shapes = f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got shapes {shapes}")
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    for name, x, most in (("q", q, max_q), ("k", k, max_k), ("v", v, max_k)):
        if most * max(x.stride(0), 1) >= MAX_ROW_OFFSET:
            raise ValueError(f"{name}: a sequence of {most} rows is too long for 32-bit offsets in this layout")
    check_causal(causal)
    visible_band(max(max_q, 1), max(max_k, 1), causal, window)  # ValueError for a malformed window
    check_scale(scale)
    return cu_seqlens_q.shape[0] - 1


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """A ValueError for boundaries that are not running sums of lengths: first entry not 0, a decrease, last entry
    not the packed total, or a sequence longer than ``max_seqlen`` (``check_values="sync"``: read on the host, one
    synchronisation on a GPU; the device's check, ``flashlab.kernels.varlen.checked_boundaries``, tests the same
    in the same order). Returns the two lists of boundaries."""
    bounds = torch.stack([cu_seqlens_q, cu_seqlens_k]).tolist()
    for which, (cu, total, most) in enumerate(((bounds[0], total_q, max_seqlen_q), (bounds[1], total_k, max_seqlen_k))):
        if cu[0] != 0:
            raise ValueError(boundary_message(varlen.ERROR_CU_START, which, 0, cu[0], total))
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        for i, n in enumerate(lengths):
            if n < 0:
                raise ValueError(boundary_message(varlen.ERROR_CU_DECREASE, which, i + 1, cu[i + 1], cu[i]))
        if cu[-1] != total:
            raise ValueError(boundary_message(varlen.ERROR_CU_LAST, which, len(lengths), cu[-1], total))
        longest = max(lengths)
        if longest > most:
            raise ValueError(boundary_message(varlen.ERROR_CU_LONG, which, lengths.index(longest), longest, most))
    return bounds


def boundary_record(device, mode):
    """The error record a call's device check writes (``check_values``' ``mode``): the device's own, after
    raising what an earlier call left in it (``DEVICE_CHECK``); one nobody reads (``NO_CHECK``); None where the host
    has read the boundaries itself (``SYNC_CHECK``)."""
    if mode is SYNC_CHECK:
        return None
    if mode is NO_CHECK:
        return unreported_record(device)
    record = error_record(device)
    if record.holds_error() and not (device.type == "cuda" and stream_capturing()):
        raise_recorded(record, earlier=True)
    return record


def _unit_stride(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
                   check_values=True):  # fmt: skip
    """``(o (total_q, Hq, D), lse (Hq, total_q) float32)`` on inputs ``check_varlen_inputs`` passed; the
    boundaries' values checked as ``check_values`` says (``flash_attention_varlen``)."""
    mode = check_values_flag(check_values)
    if mode is SYNC_CHECK and not (q.is_cuda and stream_capturing()):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
        record = None
    else:
        record = boundary_record(q.device, DEVICE_CHECK if mode is SYNC_CHECK else mode)
    q, k, v = (_unit_stride(x) for x in (q, k, v))
    total_q, hq, d = q.shape
    # the band's sides for every sequence at once (an unbounded side wider than the longest sequence); the offset
    # Nk_b - Nq_b is each sequence's own, computed in the kernel
    _, win_left, win_right, qk_scale, negate = kernel_band(max(max_seqlen_q, 1), max(max_seqlen_k, 1), d, causal,
                                                           window, scale)  # fmt: skip
    # every packed row belongs to a sequence with queries, whose programs write it (zeros and -inf without keys)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    q_run = -q if negate else q  # the running max needs a positive scale: (-q) . k * |scale| is exact
    band = (win_left, win_right, qk_scale)
    varlen.launch(q_run, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, band,
                  errors=None if record is None else record.tensor, launcher=planned_launch)  # fmt: skip
    if mode is DEVICE_CHECK and not q.is_cuda:  # the interpreter has finished: this call's own error
        raise_recorded(record, earlier=False)
    return o, lse


def backward_config(kernel: str, q) -> dict:
    """The tiles of a GPU launch of the varlen dK/dV (``kernel`` "dkdv") or dQ ("dq") kernel: the first of the
    dense backward's configs for the head-dim class (``two_pass.TUNING_SPACE``) that fits the GPU's shared
    memory, else of its fallbacks, else the smallest fallback."""
    return dict(_backward_tiles(kernel, device_index(q), block_d(q.shape[-1]), q.dtype, q.element_size()))


@functools.cache
def _backward_tiles(kernel: str, index: int, bd: int, dtype, element_size: int) -> tuple:
    limit = smem_limit(index)
    candidates = two_pass.TUNING_SPACE[kernel][two_pass.tuning_class(bd, dtype)]
    options = (*candidates, *two_pass.FALLBACK_SPACE)
    chosen = options[-1]
    for bm, bn, warps, stages in options:
        resident, streamed = (2 * bn, 2 * bm) if kernel == "dkdv" else (2 * bm, 2 * bn)
        if fits_smem(resident, streamed, stages, bd, element_size, limit):
            chosen = (bm, bn, warps, stages)
            break
    bm, bn, warps, stages = chosen
    return ("BLOCK_M", bm), ("BLOCK_N", bn), ("num_warps", warps), ("num_stages", stages)


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                    scale):  # fmt: skip
    """Gradients ``(dq, dk, dv)`` shaped like q, k, v (``flashlab.kernels.varlen.backward``: three launches for
    the whole batch). A sequence with no queries or no keys gets zero gradients. Deterministic."""
    config = {name: backward_config(name, q) for name in ("dkdv", "dq")} if q.is_cuda else None
    # the boundaries checked on the device again (the forward reported them): what the kernels walk is in bounds
    # even for boundaries changed since, and bad ones give NaN gradients
    errors = unreported_record(q.device).tensor
    return varlen.backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           window, scale, config, errors, planned_launch)  # fmt: skip


class VarlenAttentionFunction(torch.autograd.Function):
    """``(o, lse) = VarlenAttentionFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, scale,
    check_values)`` on checked inputs; lse is not differentiable (``check_no_lse_gradient``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
                check_values=True):  # fmt: skip
        o, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
                                check_values)  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.band = (max_seqlen_q, max_seqlen_k, causal, window, scale)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        check_no_lse_gradient(dlse)
        if do is None:
            return (None,) * 11
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *ctx.band)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window=None, scale=None, return_lse=False, *, check_values=True):  # fmt: skip
    """FlashAttention over a packed batch of sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func`` layout): ``softmax(q k^T * scale + mask) v`` per sequence, never padded.

    q ``(total_q, Hq, D)`` holds the queries of every sequence one after the other, k and v ``(total_k, Hk, D)``
    their keys and values; ``cu_seqlens_q`` and ``cu_seqlens_k`` (int32, ``(B + 1,)``, on the inputs' device) are
    the running sums of the lengths: sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q against rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v. ``max_seqlen_q`` / ``max_seqlen_k`` are at least the
    longest sequence's lengths (they size the grid). flashlab's other entry points take ``(B, H, N, D)`` instead.

    Hq a multiple of Hk (grouped-query attention, K/V never copied); D a multiple of 8 in [16, 256]; float16,
    bfloat16 or float32. A sequence's query and key lengths may differ and may be 0. ``causal`` and
    ``window=(left, right)`` follow ``flashlab.core.masking``, aligned to each sequence's own end (bottom-right);
    ``scale`` defaults to ``1/sqrt(D)``. Returns ``o (total_q, Hq, D)``, or ``(o, lse)`` with ``return_lse=True``:
    lse ``(Hq, total_q)`` float32, the natural log-sum-exp of each row (FlashAttention's layout); a row that sees
    no key (e.g. a query sequence with no keys) gives zeros and lse = -inf.

    The boundaries must start at 0, never decrease, end at the packed rows' count, and give no sequence more rows
    than its ``max_seqlen``. ``check_values`` says how a bad one is reported, as a ValueError naming it:

    - ``True`` (the default): one small kernel checks them on the device before the attention kernel and records
      what is wrong where the host reads it without waiting for the GPU; the call's output (and its gradients)
      come out NaN and nothing outside the tensors is read or written. On a GPU the error is raised by the first
      later checked call on the same device that begins after the faulty launch has finished (or at once by
      ``flashlab.check_kvcache_errors()``, which waits for the GPU; the device's error record is shared with
      ``flash_attention_with_kvcache``); on the CPU by the call itself. No synchronisation, so a training loop
      never stalls on it, and a call can be captured in a CUDA graph.
    - ``"sync"``: read on the host before the launch, so the same call raises: one synchronisation per call on
      a GPU.
    - ``False``: nothing is reported (the NaN output stays the only sign).

    Differentiable in q, k and v (not lse). The backward recomputes the probabilities from the saved lse with the
    FlashAttention-2 kernels in varlen form (``flashlab.kernels.varlen.backward``: preprocess, dK/dV, dQ, one
    launch each for the batch; deterministic, no atomics). Must equal ``flashlab.reference.attention`` on
    each sequence's slice to within the input dtype's rounding. CUDA tensors run the compiled kernel
    (``flashlab.kernels.varlen``), CPU tensors the same kernel through Triton's interpreter.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)
    check_values_flag(check_values)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    if torch.compiler.is_compiling():  # one opaque operator in the graph; its boundary checks run inside it
        left, right = window_to_ints(window)
        o, lse = torch.ops.flashlab.attention_varlen(*args, causal, left, right, scale)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = VarlenAttentionFunction.apply(*args, causal, window, scale, check_values)
    else:
        o, lse = varlen_forward(*args, causal, window, scale, check_values)
    return (o, lse) if return_lse else o


__all__ = [
    "VarlenAttentionFunction",
    "backward_config",
    "check_cu_seqlens_values",
    "check_varlen_inputs",
    "flash_attention_varlen",
    "varlen_backward",
    "varlen_forward",
]
