"""flashlab's entry points as PyTorch custom operators, so ``torch.compile(..., fullgraph=True)`` can trace a model
that calls them and CUDA-graph modes (``mode="reduce-overhead"``) can capture them.

Dynamo cannot trace a Triton launch written in Python (the autotuner, the argument specialisation, the
interpreter on CPU tensors). Wrapped in ``torch.library.custom_op``, the launch becomes one opaque node of the
graph: the compiler sees only its schema and its fake implementation (output shapes and dtypes, computed without
running anything), and at run time the node runs the same plans as the eager call. CPU tensors run Triton's
interpreter inside the node, so the same compiled model runs in CI.

- ``torch.ops.flashlab.attention_forward(q, k, v, causal, window_left, window_right, scale, num_splits, rung=None,
  backward_rung=None) -> (o, lse)``: ``flash_attention``'s forward pass. A window side of ``-1`` means unbounded
  (None), a ``scale`` of None the default ``1/sqrt(D)``, a ``rung`` of None the kernel ladder's own choice, a
  ``backward_rung`` of None the backward ladder's (``flashlab.kernels.backward``). ``flash_attention`` calls it
  while it is being compiled (``torch.compiler.is_compiling()``); in eager mode it launches directly, because the
  dispatcher's work for a custom operator would add to every call's host time. Its gradient is
  the backward ladder's, registered with ``torch.library.register_autograd``; like the eager
  autograd path (``flashlab.host.autograd``) it raises an error for a loss that depends on lse.
- ``torch.ops.flashlab.attention_backward(do, dlse, q, k, v, o, lse, causal, window_left, window_right, scale,
  rung=None) -> (dq, dk, dv)``: that gradient as an operator of its own, so a compiled backward graph holds it as
  one node; ``rung`` is the backward rung (None: the ladder's choice).
- ``torch.ops.flashlab.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal,
  window_left, window_right, scale, check_values, sync_check=False, cu_seqlens_q=None, max_seqlen_q=None,
  k_descale=None, v_descale=None) -> (o, lse)``: ``flash_attention_with_kvcache``, likewise; ``check_values`` False
  is its ``check_values=False``, True with ``sync_check`` its ``"sync"``, True alone its default (the check on the
  device); ``cu_seqlens_q`` its packed q's offsets (o ``(total_q, Hq, D)``, lse ``(Hq, total_q)``); the descales
  an 8-bit cache's scales.

- ``torch.ops.flashlab.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
  window_left, window_right, scale) -> (o, lse)``: ``flash_attention_varlen`` (packed sequences,
  ``flashlab.host.varlen``), with its boundary checks inside the node (they read the values); its gradient is
  ``attention_varlen_backward(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  causal, window_left, window_right, scale) -> (dq, dk, dv)``.

Why ``custom_op`` and not ``torch.library.triton_op`` + ``wrap_triton`` (which let the compiler see the Triton
kernels themselves): the launches here go through an autotuner with a config-pruning hook and a TMA pre-hook,
take TMA descriptors as arguments, and run Triton's interpreter on CPU tensors; none of that is what
``wrap_triton`` traces, and an opaque node is all that CUDA graphs need.
"""

from typing import Optional  # noqa: UP035 -- Optional[...] is what every torch.library version's schema parser reads

import torch  # no `from __future__ import annotations`: custom_op reads the annotations as types

from flashlab.host import attention
from flashlab.host.attention import ints_to_window, window_to_ints
from flashlab.host.autograd import check_no_lse_gradient
from flashlab.host.scratch import fresh_scratch
from flashlab.host.varlen import varlen_backward, varlen_forward
from flashlab.kernels.backward import attention_backward

NAMESPACE = "flashlab"


@torch.library.custom_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],  # noqa: UP045
    num_splits: Optional[int],  # noqa: UP045
    rung: Optional[str] = None,  # noqa: UP045
    backward_rung: Optional[str] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    window = ints_to_window(window_left, window_right)
    with fresh_scratch():  # nothing kept alive from a CUDA-graph mode's memory pool
        return attention.forward(q, k, v, causal, window, scale, num_splits=num_splits, rung=rung)


@attention_forward.register_fake
def _(q, k, v, causal, window_left, window_right, scale, num_splits, rung=None, backward_rung=None):
    b, hq, nq, d = q.shape
    return q.new_empty((b, hq, nq, d)), q.new_empty((b, hq, nq), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, window_left, window_right, scale, *rest = inputs  # then num_splits, rung, backward_rung
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.window, ctx.scale = causal, ints_to_window(window_left, window_right), scale
    ctx.backward_rung = rest[2] if len(rest) > 2 else None


@torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(
    do: torch.Tensor,
    dlse: Optional[torch.Tensor],  # noqa: UP045
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],  # noqa: UP045
    rung: Optional[str] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dq, dk, dv)`` of ``attention_forward``, one opaque node of a compiled backward graph too;
    a RuntimeError when ``dlse`` is not all zeros (checked when it runs: its values are not known while tracing)."""
    check_no_lse_gradient(dlse)
    window = ints_to_window(window_left, window_right)
    return attention_backward(do.contiguous(), q, k, v, o, lse, causal, window, scale, rung=rung)


@attention_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, causal, window_left, window_right, scale, rung=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    left, right = window_to_ints(ctx.window)
    dq, dk, dv = torch.ops.flashlab.attention_backward(do, dlse, q, k, v, o, lse, ctx.causal, left, right, ctx.scale,
                                                       ctx.backward_rung)  # fmt: skip
    # no gradient for the flags, the window, scale, num_splits and the rungs
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd(f"{NAMESPACE}::attention_forward", _attention_backward, setup_context=_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::attention_with_kvcache", mutates_args=())
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: Optional[torch.Tensor],  # noqa: UP045
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],  # noqa: UP045
    check_values: bool,
    sync_check: bool = False,
    cu_seqlens_q: Optional[torch.Tensor] = None,  # noqa: UP045
    max_seqlen_q: Optional[int] = None,  # noqa: UP045
    k_descale: Optional[torch.Tensor] = None,  # noqa: UP045
    v_descale: Optional[torch.Tensor] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    window = ints_to_window(window_left, window_right)
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table)
    check = "sync" if check_values and sync_check else check_values
    with fresh_scratch():  # nothing kept alive from a CUDA-graph mode's memory pool
        return attention.kvcache_attention(*tensors, causal, window, scale, check, True, cu_seqlens_q, max_seqlen_q,
                                           k_descale, v_descale)  # fmt: skip


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, causal, window_left, window_right, scale, check_values,
      sync_check=False, cu_seqlens_q=None, max_seqlen_q=None, k_descale=None, v_descale=None):  # fmt: skip
    if cu_seqlens_q is not None:  # packed: o (total_q, Hq, D), lse (Hq, total_q)
        total, hq, d = q.shape
        return q.new_empty((total, hq, d)), q.new_empty((hq, total), dtype=torch.float32)
    b, hq, nq, d = q.shape
    return q.new_empty((b, hq, nq, d)), q.new_empty((b, hq, nq), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::attention_varlen", mutates_args=())
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    window = ints_to_window(window_left, window_right)
    return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale)


@attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale):
    total_q, hq, d = q.shape
    return q.new_empty((total_q, hq, d)), q.new_empty((hq, total_q), dtype=torch.float32)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, window_left, window_right, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.flags = (max_q, max_k, causal, window_left, window_right, scale)


@torch.library.custom_op(f"{NAMESPACE}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    do: torch.Tensor,
    dlse: Optional[torch.Tensor],  # noqa: UP045
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dq, dk, dv)`` of ``attention_varlen``; a RuntimeError when ``dlse`` is not all zeros."""
    check_no_lse_gradient(dlse)
    window = ints_to_window(window_left, window_right)
    return varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           window, scale)  # fmt: skip


@attention_varlen_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
      window_right, scale):  # fmt: skip
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _attention_varlen_backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashlab.attention_varlen_backward(do, dlse, q, k, v, o, lse, cu_q, cu_k, *ctx.flags)
    return dq, dk, dv, None, None, None, None, None, None, None, None  # no gradient for the boundaries and flags


torch.library.register_autograd(
    f"{NAMESPACE}::attention_varlen", _attention_varlen_backward, setup_context=_setup_varlen_context
)


__all__ = [
    "NAMESPACE",
    "attention_backward_op",
    "attention_forward",
    "attention_varlen",
    "attention_varlen_backward_op",
    "attention_with_kvcache",
    "ints_to_window",
    "window_to_ints",
]
