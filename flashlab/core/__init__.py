"""The core: what every implementation in flashlab shares, with no torch and no Triton.

- ``shapes`` -- the shape rules of attention (grouped-query heads included).
- ``masking`` -- which keys a query may see (causal, sliding window) and the tiles that leaves to compute.
- ``numerics`` -- the one per-dtype tolerance table and the relative-error measure every check uses.
- ``integers`` -- ceiling division and powers of two, the arithmetic of tiles and grids.
- ``checks`` -- argument checks that turn bad input into a clear error.

Everything above this layer (the NumPy reference, the Triton kernels, the calculators and the tools) imports from
here; nothing here imports from above.
"""
