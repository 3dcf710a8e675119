"""An 8-bit (float8 e4m3) KV cache compiled on a CUDA GPU, at serving sizes, against float64 (skipped without CUDA).

Run on the H200 with: ``python -m pytest tests/test_kvcache_fp8_gpu.py -q``. The cases of
``tests/test_kvcache_fp8.py`` scaled up: B in {1, 8}, caches of 4K and 32K tokens (ragged), 64 query / 8 K/V
heads at D = 128, paged in shuffled blocks of 16 and 256 tokens or contiguous; each against the float64 reference
of the keys and values the 8-bit cache stands for (``flashlab.dequantize_kv``), to bf16's tolerance, and through
the evaluation gate (``E4M3_TOLERANCE``) against the unquantised keys. Then the direct launch, a CUDA graph's
replay, and a bad scale reported without a synchronisation.
"""

from __future__ import annotations

import pytest
import torch
from test_kvcache import reference
from test_kvcache_gpu import no_synchronisation

import flashlab
from flashlab import dequantize_kv, flash_attention_with_kvcache, quantize_kv
from flashlab.core.numerics import relative_error, tolerance
from flashlab.host.quantize import E4M3_TOLERANCE
from flashlab.kernels.decode.kvcache import paged_kv_cache

pytestmark = pytest.mark.gpu


def serving_case(seed, b, n, block_size, hq=64, hk=8, d=128, dtype=torch.bfloat16):
    """q ``(B, Hq, 1, D)``, the 16-bit cache, its 8-bit copy, the table (None: contiguous), lengths and scales:
    lengths n, then n - 1000 * i (ragged), all on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(b, hk, n, d, generator=g, device="cuda").to(dtype) for _ in range(2))  # (B, Hk, N, D)
    lengths = [max(1, n - 1000 * i) for i in range(b)]
    if block_size:
        kc, vc, table, seqlens = paged_kv_cache(k, v, block_size, lengths=lengths, seed=seed)
    else:
        kc, vc, table = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), None  # (B, N, Hk, D)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)
    return q, kc, vc, k8, v8, table, seqlens, ks, vs


def check_8bit(q, kc, vc, k8, v8, table, seqlens, ks, vs):
    o, lse = flash_attention_with_kvcache(q, k8, v8, seqlens, table, return_lse=True, k_descale=ks, v_descale=vs)
    kd, vd = dequantize_kv(k8, v8, ks, vs, block_table=table)
    ro, rlse = reference(q.double(), kd, vd, seqlens, None, False, None)
    err = relative_error(o, ro)
    assert err < tolerance(q.dtype), f"relative error {err:.2e} against the dequantised cache"
    assert float((lse.double() - rlse).abs().max()) < 1e-3
    del kd, vd
    gate = relative_error(o, reference(q.double(), kc, vc, seqlens, table, False, None)[0])
    assert gate < E4M3_TOLERANCE, f"8-bit cache error {gate:.3g} against the unquantised keys"
    return o


@pytest.mark.parametrize("block_size", [16, 256, 0], ids=["paged16", "paged256", "contiguous"])
@pytest.mark.parametrize("n", [4096, 32768])
@pytest.mark.parametrize("b", [1, 8])
def test_an_8bit_cache_at_serving_sizes(b, n, block_size):
    check_8bit(*serving_case(b * n + block_size, b, n, block_size))


def test_fp16_queries():
    check_8bit(*serving_case(11, 4, 8192, 16, dtype=torch.float16))


@pytest.mark.parametrize("magnitude", [1e5, 3e7, 1e-6])
def test_bf16_queries_outside_float16s_range(magnitude):
    # the dots of an 8-bit cache take float16 operands: a bf16 q past float16's range (or deep in its subnormals)
    # must neither overflow to inf nor flush to zero. Scaled keys keep the softmax from being one-hot
    q, kc, vc, k8, v8, table, seqlens, ks, vs = serving_case(13, 2, 4096, 16)
    q = (q.float() * magnitude).to(torch.bfloat16)
    shrink = 1.0 / magnitude
    kc = (kc.float() * shrink).to(torch.bfloat16)
    k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)
    o = check_8bit(q, kc, vc, k8, v8, table, seqlens, ks, vs)
    assert bool(torch.isfinite(o).all())


@pytest.mark.parametrize("block_size", [16, 256])
def test_the_direct_launch_and_a_cuda_graph_give_the_same_bits(block_size):
    from flashlab.host.plan import CHECKED, PLANS, kvcache_signature

    q, kc, vc, k8, v8, table, seqlens, ks, vs = serving_case(12, 8, 8192, block_size)
    first = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
    for _ in range(6):  # JIT launch, the direct launch built and checked
        out = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
        torch.testing.assert_close(out, first, rtol=0, atol=0)
    key = kvcache_signature(q, k8, v8, seqlens, table, False, None, None, k_descale=ks, v_descale=vs)
    assert PLANS[key].state == CHECKED, PLANS[key].state
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
    ks.mul_(2.0)  # in place: the graph's kernel reads the new scales at the replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks,
                                                                      v_descale=vs), rtol=0, atol=0)  # fmt: skip
    assert not torch.equal(captured, first)


def test_a_bad_scale_is_reported_without_a_synchronisation():
    q, kc, vc, k8, v8, table, seqlens, ks, vs = serving_case(13, 8, 4096, 16)
    for _ in range(6):
        good = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
    bad = vs.clone()
    bad[5, 3] = float("nan")
    with no_synchronisation():
        o = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=bad)
    with pytest.raises(ValueError, match=r"v_descale\[5, 3\] = nan: scales must be finite and > 0"):
        flashlab.check_kvcache_errors()
    group = torch.arange(64, device="cuda") // 8 == 3  # the query heads that read K/V head 3
    assert torch.isnan(o[5, group]).all()
    rows = torch.ones(8, 64, dtype=torch.bool, device="cuda")
    rows[5, group] = False
    torch.testing.assert_close(o[rows], good[rows], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"v_descale\[5, 3\] = nan"):
        flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=bad, check_values="sync")
