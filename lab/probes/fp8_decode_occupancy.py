"""How many 8-bit decode programs an SM holds, and whether more of them bring the step closer to its bytes.

Nsight Compute found the 8-bit cache's step latency-bound at three programs an SM (146 registers a thread cap it
there; the 16-bit kernel needs 95). Each variant, in its own process, caps the 8-bit kernel's registers
(``maxnreg``) and cuts its keys for ``per_sm`` programs an SM, then times a decode step of the 16-bit and the 8-bit
cache on the same GPU (64 query / 8 K/V heads, D = 128, bf16 queries, 256-token blocks, shuffled), each by CUDA
graph replay (the kernels' time, no host) and by ``triton.testing.do_bench``; it prints the compiled 8-bit
kernel's registers and spills and the 8-bit output's error against float64 of the dequantised cache.

    python lab/probes/fp8_decode_occupancy.py BLOCK_N,WARPS,STAGES PER_SM MAXNREG   # MAXNREG 0: no cap
"""

import inspect
import sys

import torch
import triton

from flashlab import dequantize_kv, flash_attention_with_kvcache, quantize_kv
from flashlab.kernels.decode import kvcache, split_kv

tiles = tuple(int(x) for x in sys.argv[1].split(","))
per_sm, maxnreg = int(sys.argv[2]), int(sys.argv[3])
block_size = int(sys.argv[4]) if len(sys.argv) > 4 else 256
kvcache.EIGHT_BIT_CONFIG = tiles
kvcache.EIGHT_BIT_SMALL_BLOCK_CONFIG = tiles
original_init = kvcache.KVCacheArguments.__init__


def eight_bit_init(self, *args, **kwargs):
    """``KVCacheArguments`` with the variant's programs an SM and register cap for an 8-bit cache."""
    descales = inspect.signature(original_init).bind(self, *args, **kwargs).arguments.get("descales")
    default = split_kv.PROGRAMS_PER_SM
    if descales is not None:
        split_kv.PROGRAMS_PER_SM = per_sm
    try:
        original_init(self, *args, **kwargs)
    finally:
        split_kv.PROGRAMS_PER_SM = default
    if descales is not None and maxnreg:
        self.meta["maxnreg"] = maxnreg


kvcache.KVCacheArguments.__init__ = eight_bit_init


def graph_time(fn):
    """Median microseconds of ``fn`` replayed from a CUDA graph (20 calls a replay)."""
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def registers():
    """(registers, spills) of each compiled 8-bit kernel binary."""
    found = []
    for cache in kvcache.kvcache_partial.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            found.append((kernel.n_regs, kernel.n_spills, kernel.metadata.shared))
    return found


def step(b, n):
    """One shape's four timings (16-bit and 8-bit, graph replay then ``do_bench``) and the 8-bit error."""
    g = torch.Generator(device="cuda").manual_seed(b * n)
    q = torch.randn(b, 64, 1, 128, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, 8, n, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    kc, vc, table, seqlens = kvcache.paged_kv_cache(k, v, block_size, seed=b)
    k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)

    def sixteen():
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table)

    def eight():
        return flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)

    o8 = eight()
    sixteen()
    times = [graph_time(sixteen), graph_time(eight)]
    times += [triton.testing.do_bench(f, rep=200) * 1e3 for f in (sixteen, eight)]
    kd, vd = dequantize_kv(k8, v8, ks, vs, block_table=table)  # (B, N, Hk, D) float64
    kd, vd = (x.transpose(1, 2) for x in (kd, vd))
    qg = q.double().view(b, 8, 8, 128)
    ref = (torch.softmax((qg @ kd.transpose(-1, -2)) / 128**0.5, -1) @ vd).view(b, 64, 1, 128)
    return times, float((o8.double() - ref).norm() / ref.norm())


for b, n in ((1, 32768), (8, 32768), (1, 131072), (8, 131072)):
    times, err = step(b, n)
    print(
        f"{sys.argv[1]:>8s} per_sm {per_sm} maxnreg {maxnreg:3d} blocks {block_size}  B {b}  N {n:6d}  graph: 16-bit "
        f"{times[0]:7.1f} us 8-bit {times[1]:7.1f} us ratio {times[1] / times[0]:.3f}   do_bench: {times[2]:7.1f} "
        f"{times[3]:7.1f} ratio {times[3] / times[2]:.3f}  err {err:.1e}",
        flush=True,
    )
print(
    f"{sys.argv[1]:>8s} per_sm {per_sm} maxnreg {maxnreg:3d}: kernels (regs, spills, shared) {registers()}", flush=True
)
