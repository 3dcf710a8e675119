"""flashlab: FlashAttention taught from the bytes up.

The package in layers; every import points down the list, never up (``tests/test_layers.py`` checks it):

1. ``flashlab.core`` -- shapes (GQA), masks (causal, sliding window) and the tiles they leave, the one tolerance
   table, integer helpers, argument checks. NumPy only.
2. ``flashlab.reference`` -- the NumPy ground truth: softmax, the online softmax, materialised attention, the
   tiled (FlashAttention) loop, the split-KV merge; and the same attention in float64 torch for GPU-sized checks.
   ``flashlab.calculators`` -- the lesson's arithmetic (bytes, FLOPs, seconds) and the GPU / model catalogues.
3. ``flashlab.kernels`` -- the Triton kernels, device code and one plain launch each (compiled on a GPU, Triton's
   interpreter on a CPU), each checked against the reference: the forward kernel as a ladder of runnable rungs
   (``flashlab.kernels.ladder``), the decode kernels (``flashlab.kernels.decode``), the backward kernels.
4. ``flashlab.host`` -- the host engine: ``flashlab.flash_attention``, ``flashlab.flash_attention_with_kvcache``
   (attention against a serving engine's paged KV cache, 16-bit or 8-bit: ``flashlab.quantize_kv``) and
   ``flashlab.flash_attention_varlen`` (sequences of different lengths packed without padding), their checks, one
   plan per call signature, the direct launches, autograd and the ``torch.ops.flashlab`` operators;
   ``flashlab.flash_attention`` on float8 inputs runs the FP8 forward (``flashlab.quantize_qkv`` makes them).
5. The tools: ``flashlab.bench`` (``python -m flashlab.bench``, the checked benchmark), ``flashlab.sdpa`` (which
   PyTorch SDPA backend runs, and why the others refuse), ``flashlab.exercises`` and ``flashlab.grade`` (the
   notebooks' exercises and their grader), ``flashlab.widgets`` (the sequence-length explorer),
   ``flashlab.kv_allocator`` (a simulation of a KV cache's block allocator, contiguous against paged).

Heavy dependencies (torch, triton) are imported only when the kernel is first used.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import flashlab` stays fast and torch-free until the kernel is asked for.
    if name == "flash_attention":
        from flashlab.host import flash_attention

        return flash_attention
    if name == "flash_attention_with_kvcache":
        from flashlab.host import flash_attention_with_kvcache

        return flash_attention_with_kvcache
    if name == "flash_attention_varlen":
        from flashlab.host import flash_attention_varlen

        return flash_attention_varlen
    if name == "quantize_kv":
        from flashlab.host.quantize import quantize_kv

        return quantize_kv
    if name == "dequantize_kv":
        from flashlab.host.quantize import dequantize_kv

        return dequantize_kv
    if name in ("quantize_qkv", "dequantize_qkv"):
        from flashlab.host import fp8

        return getattr(fp8, name)
    if name == "check_kvcache_errors":
        from flashlab.host import check_kvcache_errors

        return check_kvcache_errors
    raise AttributeError(f"module 'flashlab' has no attribute {name!r}")
