"""One decode step on a 16-bit and on an 8-bit paged cache (B = 8, 32K keys, 64 query / 8 K/V heads, D = 128, bf16
queries, 256-token blocks), made between cudaProfilerStart and Stop for Nsight Compute to read:

    ncu --clock-control none --profile-from-start off --section LaunchStats --section Occupancy \\
        --section SchedulerStats --section WarpStateStats python lab/probes/fp8_decode_ncu.py
"""

import torch

from flashlab import flash_attention_with_kvcache, quantize_kv
from flashlab.kernels.decode import kvcache

b, n = 8, 32768
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, 64, 1, 128, generator=g, device="cuda").to(torch.bfloat16)
k, v = (torch.randn(b, 8, n, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
kc, vc, table, seqlens = kvcache.paged_kv_cache(k, v, 256, seed=b)
k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)


def sixteen():
    return flash_attention_with_kvcache(q, kc, vc, seqlens, table)


def eight():
    return flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)


for _ in range(3):  # compiled, planned and checked before the profiled calls
    sixteen(), eight()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
sixteen()
eight()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
