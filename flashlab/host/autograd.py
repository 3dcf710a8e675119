"""``flash_attention`` as a differentiable function: the forward kernel, then the backward kernels on demand.

The forward saves q, k, v, the output o and the float32 log-sum-exp lse ``(B, Hq, Nq)`` -- nothing of size
Nq x Nk. The backward (a rung of ``flashlab.kernels.backward``) recomputes the probabilities tile by tile
from those.

``lse`` is returned for inspection but is not differentiable: a loss that depends on it raises an error in the
backward pass rather than silently leaving out that part of the gradient -- here and in the registered operator's
backward (``flashlab.host.custom_ops``), through ``check_no_lse_gradient``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from flashlab.host.launches import SPLIT_KV, attention_call, run_attention
from flashlab.kernels.backward import attention_backward
from flashlab.kernels.decode import split_kv
from flashlab.kernels.device import block_d, device_index, fits_smem, smem_limit

# Split-KV (decode) calls have no backward; a call of that size that needs a gradient runs the prefill kernel with
# one of these (BLOCK_M, BLOCK_N, num_warps, num_stages) instead: the first whose tiles fit the GPU's shared memory.
SMALL_QUERY_CONFIGS = [(16, 64, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1)]

LSE_NOT_DIFFERENTIABLE = (
    "the lse returned by flash_attention(..., return_lse=True) is not differentiable: compute the loss from the "
    "output o only, or detach lse (lse.detach()) before using it"
)


def check_no_lse_gradient(dlse) -> None:
    """A RuntimeError if a loss depends on lse (its incoming gradient is not all zeros)."""
    if dlse is not None and bool((dlse != 0).any()):
        raise RuntimeError(LSE_NOT_DIFFERENTIABLE)


def small_query_config(q) -> dict:
    """A fixed prefill config for a few query rows (the autotuned path would send them to split-KV)."""
    if not q.is_cuda:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}  # ignored: CPU uses CPU_CONFIG
    limit, bd = smem_limit(device_index(q)), block_d(q.shape[-1])
    for bm, bn, warps, stages in SMALL_QUERY_CONFIGS:
        if fits_smem(bm, 2 * bn, stages, bd, q.element_size(), limit) or (bm, bn) == SMALL_QUERY_CONFIGS[-1][:2]:
            return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def differentiable_call(call, q, k, v, causal, window, scale, rung):
    """The call a differentiable call of ``call``'s signature runs: the prefill kernel (the call's ``rung``, with
    small query tiles at decode sizes), which is ``call`` itself unless that is split-KV or decode-sized."""
    config = small_query_config(q) if q.shape[2] <= split_kv.MAX_SPLIT_QUERY_ROWS else None
    if config is None and call.path is not SPLIT_KV:
        return call
    return attention_call(q, k, v, causal, window, scale, None, rung, config=config)


class FlashAttentionFunction(torch.autograd.Function):
    """``(o, lse) = FlashAttentionFunction.apply(call, q, k, v, causal, window, scale, backward_rung)`` on checked
    inputs; ``call`` is the signature's prefill call (``differentiable_call``), ``backward_rung`` the backward
    ladder's rung to run (None: its choice)."""

    @staticmethod
    def forward(ctx, call, q, k, v, causal, window, scale, backward_rung=None):
        o, lse = run_attention(call, q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.band = (causal, window, scale)
        ctx.backward_rung = backward_rung
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None instead of a tensor of zeros
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        check_no_lse_gradient(dlse)
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # the loss does not depend on o
            return None, None, None, None, None, None, None, None
        causal, window, scale = ctx.band
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal, window, scale, rung=ctx.backward_rung)
        return None, dq, dk, dv, None, None, None, None


__all__ = [
    "FlashAttentionFunction",
    "LSE_NOT_DIFFERENTIABLE",
    "SMALL_QUERY_CONFIGS",
    "check_no_lse_gradient",
    "differentiable_call",
    "small_query_config",
]
