"""The calculators: the lesson's arithmetic in bytes, FLOPs and seconds, and the catalogues it reads from.

- ``roofline`` -- score-matrix size, naive against flash HBM traffic, the paper's tiled count, FLOPs, roofline
  time bounds, KV-cache reads at decode, Amdahl, tile SRAM footprints.
- ``catalog`` -- the GPU and model catalogues (``data/*.json`` beside it), every figure with its source.
- ``flash_versions`` -- FlashAttention 1 to 4 and Flash-Decoding, dated and sourced (``data/flash_versions.json``).
- ``schedule`` -- when a launch of unequal programs ends, in the order they start (longest first, or not), and
  the work of a ragged attention launch's row blocks.
- ``exact`` -- numbers of any size: counts exact, floats rounded once, a ValueError past the largest float.

They need no torch and no GPU: only ``flashlab.core``.
"""
