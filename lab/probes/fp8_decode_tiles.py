"""An 8-bit cache's decode step against the 16-bit cache's, for a few tile configs of the 8-bit kernel (the
16-bit one keeps its own): ``BLOCK_N,num_warps,num_stages`` set as ``kvcache.EIGHT_BIT_CONFIG`` (or, for blocks
under 128 tokens, ``EIGHT_BIT_SMALL_BLOCK_CONFIG``) before the first call, one process per variant. H200, 64 query /
8 K/V heads, D = 128, bf16 queries, the cache in shuffled blocks of BLOCK_SIZE tokens; GPU time by
``triton.testing.do_bench`` (median), and the 8-bit output's error against float64 of the dequantised cache.

    python lab/probes/fp8_decode_tiles.py 64,4,3 256
"""

import sys

import torch
import triton

from flashlab import dequantize_kv, flash_attention_with_kvcache, quantize_kv
from flashlab.kernels.decode import kvcache

tiles = tuple(int(x) for x in sys.argv[1].split(","))
block_size = int(sys.argv[2])
if block_size < kvcache.SMALL_BLOCK_TOKENS:
    kvcache.EIGHT_BIT_SMALL_BLOCK_CONFIG = tiles
else:
    kvcache.EIGHT_BIT_CONFIG = tiles


def step_times(b, n):
    """GPU time of one decode step, 16-bit cache then 8-bit, in microseconds, and the 8-bit output's error."""
    g = torch.Generator(device="cuda").manual_seed(b * n)
    q = torch.randn(b, 64, 1, 128, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, 8, n, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    kc, vc, table, seqlens = kvcache.paged_kv_cache(k, v, block_size, seed=b)
    k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)
    sixteen = triton.testing.do_bench(lambda: flash_attention_with_kvcache(q, kc, vc, seqlens, table), rep=200)
    o8 = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
    eight = triton.testing.do_bench(
        lambda: flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs), rep=200
    )
    kd, vd = dequantize_kv(k8, v8, ks, vs, block_table=table)  # (B, N, Hk, D) float64
    kd, vd = (x.transpose(1, 2) for x in (kd, vd))  # (B, Hk, N, D)
    qg = q.double().view(b, 8, 8, 128)  # (B, Hk, group, D): query head h reads K/V head h // 8
    ref = (torch.softmax((qg @ kd.transpose(-1, -2)) / 128**0.5, -1) @ vd).view(b, 64, 1, 128)
    err = float((o8.double() - ref).norm() / ref.norm())
    return sixteen * 1e3, eight * 1e3, err


for b, n in ((1, 32768), (8, 32768), (1, 131072), (8, 131072)):
    sixteen, eight, err = step_times(b, n)
    print(
        f"{sys.argv[1]:>8s} blocks {block_size:3d}  B {b}  N {n:6d}  16-bit {sixteen:7.1f} us  8-bit {eight:7.1f} us"
        f"  ratio {eight / sixteen:.3f}  8-bit error {err:.1e}",
        flush=True,
    )
