"""flashlab: FlashAttention taught from the bytes up.

The package behind the notebooks:

- ``flashlab.reference`` -- the NumPy ground truth: softmax, the online softmax, materialised attention, the tiled
  (FlashAttention) loop and the split-KV merge. Everything else is checked against it.
- ``flashlab.masking`` / ``flashlab.shapes`` -- which keys a query may see (causal, sliding window) and which
  tiles that leaves to compute; the shape rules (GQA) every implementation shares.
- ``flashlab.flash_attention`` -- the Triton kernel (``flashlab.kernel``; compiled on a GPU, Triton's interpreter on
  a CPU), checked against ``flashlab.reference.flash_attention``; at decode it takes the split-KV path
  (``flashlab.split_kv``), whose merge step is ``flashlab.reference.merge_partials``.
- ``flashlab.roofline`` / ``flashlab.catalog`` -- the lesson's arithmetic (bytes, FLOPs, seconds) and the GPU and
  model catalogues it reads from ``data/``; ``flashlab.widgets`` -- the sequence-length explorer.
- ``flashlab.paged`` -- a KV-cache allocator simulation (contiguous vs paged blocks).
- ``flashlab.bench`` -- ``python -m flashlab.bench``, the checked benchmark harness; ``flashlab.backends`` -- which
  PyTorch SDPA backend runs where.
- ``flashlab.exercises`` / ``flashlab.grade`` -- the notebooks' exercises, their pytest tests, and the grader
  (``python -m flashlab.grade``).

Heavy dependencies (torch, triton) are imported only when the kernel is first used.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import flashlab` stays fast and torch-free until the kernel is asked for.
    if name == "flash_attention":
        from flashlab.kernel import flash_attention

        return flash_attention
    raise AttributeError(f"module 'flashlab' has no attribute {name!r}")
