"""The host engine: what the CPU does to launch flashlab's kernels, written once.

- ``attention`` -- the entry points, ``flash_attention`` and ``flash_attention_with_kvcache``; ``varlen`` --
  ``flash_attention_varlen``, packed sequences of different lengths.
- ``quantize`` -- an 8-bit (float8 e4m3) KV cache: ``quantize_kv`` makes one, with a scale per sequence and K/V
  head, and ``dequantize_kv`` gives the float64 keys and values it stands for.
- ``checks`` -- every argument check (a TypeError or ValueError naming the argument); ``kvcache_errors`` -- the
  paged cache's values checked on the device, reported without a synchronisation (``check_kvcache_errors``).
- ``plan`` -- the call signature and its ``Call`` (``CALLS``), the bounded plan cache keyed by bucket (``PLANS``)
  and the one plan type (``Plan``: a JIT launch, then a direct launch checked once per compiled binary against it,
  bit for bit).
- ``launches`` -- each path's plan and launch: prefill (every rung of ``flashlab.kernels.ladder``), split-KV
  decode, the paged KV cache.
- ``launcher`` and ``direct_launch`` (with ``launcher.c``) -- a compiled kernel relaunched without Triton's per-call
  work; ``scratch`` -- the scratch memory a launch needs while it runs, kept per stream.
- ``autograd`` and ``custom_ops`` -- the eager autograd path and the ``torch.ops.flashlab.*`` operators that
  torch.compile traces (registered when this package is imported).

The kernels themselves (``flashlab.kernels``) are device code and one plain launch each; this package imports
them, never the other way.
"""

from flashlab.host import custom_ops  # noqa: F401  (registers torch.ops.flashlab.*)
from flashlab.host.attention import flash_attention, flash_attention_with_kvcache
from flashlab.host.kvcache_errors import check_kvcache_errors
from flashlab.host.varlen import flash_attention_varlen

__all__ = ["check_kvcache_errors", "flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"]
