"""flashlab's kernels as PyTorch custom operators, so ``torch.compile(..., fullgraph=True)`` can trace a model that
calls them and CUDA-graph modes (``mode="reduce-overhead"``) can capture them.

Dynamo cannot trace a Triton launch written in Python (the autotuner, the argument specialisation, the
interpreter on CPU tensors). Wrapped in ``torch.library.custom_op``, the launch becomes one opaque node of the
graph: the compiler sees only its schema and its fake implementation (output shapes and dtypes, computed without
running anything), and at run time the node calls the same eager code as ``flashlab.flash_attention``. CPU tensors
run Triton's interpreter inside the node, so the same compiled model runs in CI.

- ``flashlab::attention_forward(q, k, v, causal, window_left, window_right, scale, num_splits, rung=None) ->
  (o, lse)``: the forward pass of ``flashlab.kernels.forward.forward``. A window side of ``-1`` means unbounded
  (None), a ``scale`` of None the default ``1/sqrt(D)``, a ``rung`` of None the kernel ladder's own choice.
  ``flash_attention`` calls it while it is being compiled (``torch.compiler.is_compiling()``); in eager mode it
  launches directly, because the dispatcher's work for a custom operator would add to every call's host time.
- ``flashlab::attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, window_left,
  window_right, scale, check_values) -> (o, lse)``: ``flashlab.kernels.kvcache``'s paged-cache attention, likewise.

The backward pass. When ``flashlab.kernels.backward`` exists (``attention_backward(do, q, k, v, o, lse, causal,
window, scale) -> (dq, dk, dv)``), ``register_attention_backward`` registers it as the forward operator's autograd
formula, at import, with ``torch.library.register_autograd``; without it, the operator has no gradient.

Why ``custom_op`` and not ``torch.library.triton_op`` + ``wrap_triton`` (which let the compiler see the Triton
kernels themselves): the launches here go through an autotuner with a config-pruning hook and a TMA pre-hook,
take TMA descriptors as arguments, and run Triton's interpreter on CPU tensors; none of that is what
``wrap_triton`` traces, and an opaque node is all that CUDA graphs need.
"""

import importlib.util  # no `from __future__ import annotations`: custom_op reads the annotations as types
from typing import Optional  # noqa: UP035 -- Optional[...] is what every torch.library version's schema parser reads

import torch

from flashlab.kernels import forward as forward_module
from flashlab.kernels import kvcache
from flashlab.kernels.runtime import fresh_scratch

NAMESPACE = "flashlab"


def window_to_ints(window) -> tuple[int, int]:
    """``window`` (None or (left, right), None = unbounded) as the two ints of the operators' schema (-1 = None)."""
    if window is None:
        return -1, -1
    left, right = window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def ints_to_window(left: int, right: int):
    """The inverse of ``window_to_ints``: None when both sides are unbounded."""
    if left < 0 and right < 0:
        return None
    return (None if left < 0 else left), (None if right < 0 else right)


# ----------------------------------------------------------------------------------------------------------------
# flashlab::attention_forward
# ----------------------------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor]:
    window = ints_to_window(window_left, window_right)
    forward_module.check_inputs(q, k, v, causal, window, scale)
    forward_module.check_num_splits(num_splits, k.shape[2])
    with fresh_scratch():  # nothing kept alive from a CUDA-graph mode's memory pool
        return forward_module.forward(q, k, v, causal, window, scale, num_splits=num_splits, rung=rung)


@attention_forward.register_fake
def _(q, k, v, causal, window_left, window_right, scale, num_splits, rung=None):
    b, hq, nq, d = q.shape
    return q.new_empty((b, hq, nq, d)), q.new_empty((b, hq, nq), dtype=torch.float32)


def traced_forward(q, k, v, causal, window, scale, num_splits=None, rung=None):
    """What ``flashlab.kernels.forward.forward`` calls while it is being compiled: the operator, one graph node."""
    return attention_forward(q, k, v, causal, *window_to_ints(window), scale, num_splits, rung)


forward_module.TRACED_FORWARD = traced_forward


# ----------------------------------------------------------------------------------------------------------------
# flashlab::attention_with_kvcache
# ----------------------------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor]:
    window = ints_to_window(window_left, window_right)
    checked = (q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale)
    capacity = kvcache.check_kvcache_inputs(*checked, check_values=check_values)
    with fresh_scratch():  # nothing kept alive from a CUDA-graph mode's memory pool
        return kvcache.kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, capacity)


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, causal, window_left, window_right, scale, check_values):
    b, hq, nq, d = q.shape
    return q.new_empty((b, hq, nq, d)), q.new_empty((b, hq, nq), dtype=torch.float32)


def traced_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, check_values=True):
    """What ``flash_attention_with_kvcache`` calls while it is being compiled. The checks run inside the node, at
    run time: the values of the lengths and the block table cannot be read while tracing."""
    left, right = window_to_ints(window)
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table)
    return attention_with_kvcache(*tensors, causal, left, right, scale, check_values)


kvcache.TRACED_KVCACHE = traced_kvcache


# ----------------------------------------------------------------------------------------------------------------
# The backward pass: registered when flashlab.kernels.backward exists
# ----------------------------------------------------------------------------------------------------------------

BACKWARD_MODULE = "flashlab.kernels.backward"


def _setup_context(ctx, inputs, output):
    q, k, v, causal, window_left, window_right, scale, *_ = inputs  # then num_splits and rung
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.window, ctx.scale = causal, ints_to_window(window_left, window_right), scale


def _attention_backward(ctx, do, dlse):
    from flashlab.kernels.backward import attention_backward

    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.window, ctx.scale)
    # no gradient for the flags, the window, scale, num_splits and rung
    return dq, dk, dv, None, None, None, None, None, None


def register_attention_backward() -> bool:
    """Register ``flashlab.kernels.backward.attention_backward`` as ``flashlab::attention_forward``'s gradient, if
    that module exists; returns whether it did. (The gradient flows from ``o`` only; ``lse``'s is not used.)"""
    if importlib.util.find_spec(BACKWARD_MODULE) is None:
        return False
    torch.library.register_autograd(
        f"{NAMESPACE}::attention_forward", _attention_backward, setup_context=_setup_context
    )
    return True


# ==== BACKWARD SEAM ================================================================================================
# Activates by itself once flashlab/kernels/backward.py exists; nothing else needs to change.
HAS_BACKWARD = register_attention_backward()
# ===================================================================================================================

__all__ = [
    "HAS_BACKWARD",
    "attention_forward",
    "attention_with_kvcache",
    "ints_to_window",
    "register_attention_backward",
    "traced_forward",
    "traced_kvcache",
    "window_to_ints",
]
