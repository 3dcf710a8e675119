"""flashlab: FlashAttention taught from the bytes up.

The package behind the notebooks:

- ``flashlab.reference`` -- the NumPy ground truth: softmax, the online softmax, materialised attention, the tiled
  (FlashAttention) loop and the split-KV merge. Everything else is checked against it.
- ``flashlab.masking`` / ``flashlab.shapes`` -- which keys a query may see (causal, sliding window) and which
  tiles that leaves to compute; the shape rules (GQA) every implementation shares.
- ``flashlab.flash_attention`` -- the Triton kernel (compiled on a GPU, Triton's interpreter on a CPU).

Heavy dependencies (torch, triton) are imported only when the kernel is first used.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import flashlab` stays fast and torch-free until the kernel is asked for.
    if name == "flash_attention":
        from flashlab.kernel import flash_attention

        return flash_attention
    raise AttributeError(f"module 'flashlab' has no attribute {name!r}")
