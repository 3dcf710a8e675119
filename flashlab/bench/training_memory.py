"""What a training step keeps in memory for attention's backward pass, measured rather than estimated.

- ``saved_for_backward_bytes(fn, *args, **kwargs)`` -- bytes of the distinct storages autograd saves for the
  backward while ``fn(*args, **kwargs)`` runs its forward (``torch.autograd.graph.saved_tensors_hooks``). A view
  (``K`` transposed) counts as the storage it views, once. Works on any device.
- ``training_step_memory(attention, q, k, v, do, causal)`` -- that count for one attention call, and on a CUDA
  GPU the peak memory allocated by its forward + backward (temporaries and gradients included).

The counts to compare them with are ``flashlab.calculators.roofline.naive_saved_for_backward_bytes`` and
``flash_saved_for_backward_bytes``. Notebook 09 and ``scripts/backward_memory.py`` use these.
"""

from __future__ import annotations

import torch


def saved_for_backward_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """``(bytes, result)``: the bytes autograd keeps from running ``fn(*args, **kwargs)``, and what it returned."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return sum(storages.values()), result


def training_step_memory(attention, q, k, v, do, causal: bool = True) -> tuple[int, int | None]:
    """``(saved_bytes, peak_bytes)`` of ``o = attention(q, k, v, causal=causal)`` then ``o.backward(do)``.

    q, k, v must require grad; their ``.grad`` is cleared afterwards. ``peak_bytes`` is the peak CUDA memory
    allocated during forward + backward beyond what was allocated before (None off CUDA). On CUDA one step runs
    first, unmeasured: compiling and autotuning a kernel allocates buffers of its own (Triton's benchmark flushes
    the L2 with a 256 MB buffer) that a training step in steady state never holds.
    """
    cuda = q.is_cuda
    if cuda:
        attention(q, k, v, causal=causal).backward(do)  # warm-up: compile, autotune, build launch plans
        for x in (q, k, v):
            x.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    saved, o = saved_for_backward_bytes(attention, q, k, v, causal=causal)
    o.backward(do)
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    for x in (q, k, v):
        x.grad = None
    return saved, peak


__all__ = ["saved_for_backward_bytes", "training_step_memory"]
