"""Mixed prefill/decode batches (``cu_seqlens_q``) compiled on a CUDA GPU, at serving sizes, against float64
(skipped without CUDA).

Run on the H200 with: ``python -m pytest tests/test_kvcache_mixed_gpu.py -q``. The cases of
``tests/test_kvcache_mixed.py`` scaled up: prefill chunks of hundreds of rows packed with single decode rows and a
sequence with none, 32 query / 8 KV heads at D = 128, caches of thousands of keys in shuffled 16- and 256-token
blocks; the packed layout of a uniform batch against the uniform call; a mixed step captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from test_kvcache_mixed import check_mixed, mixed_case, offsets

from flashlab import flash_attention_with_kvcache

pytestmark = pytest.mark.gpu

ROWS = [300, 1, 1, 0, 77, 1, 16, 1]
LENGTHS = [3000, 4000, 17, 900, 2500, 1, 16, 4096]


def on_gpu(*xs):
    return [None if x is None else x.cuda() for x in xs]


@pytest.mark.parametrize("bs", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_mixed_batch_matches_float64_per_sequence(bs, dtype):
    case = mixed_case(1, True, ROWS, LENGTHS, hq=32, hk=8, d=128, dtype=dtype, capacity=4096, bs=bs)
    check_mixed(*on_gpu(*case), causal=True)
    check_mixed(*on_gpu(*case), causal=True, window=(1000, 0))
    check_mixed(*on_gpu(*case))


def test_a_contiguous_cache():
    case = mixed_case(2, False, ROWS, LENGTHS, hq=32, hk=8, d=128, dtype=torch.bfloat16, capacity=4096)
    check_mixed(*on_gpu(*case), causal=True)


def test_uniform_rows_packed_give_the_uniform_call_bit_for_bit():
    b, nq = 4, 8
    q, kc, vc, seqlens, table, cu = on_gpu(
        *mixed_case(3, True, [nq] * b, [3000, 100, 8, 2048], hq=32, hk=8, d=128, dtype=torch.bfloat16, capacity=4096)
    )
    q4 = q.view(b, nq, *q.shape[1:]).transpose(1, 2)  # (B, Hq, Nq, D)
    o4, lse4 = flash_attention_with_kvcache(q4, kc, vc, seqlens, table, causal=True, return_lse=True)
    o, lse = check_mixed(q, kc, vc, seqlens, table, cu, causal=True)
    assert torch.equal(o.view(b, nq, *o.shape[1:]).transpose(1, 2), o4)
    assert torch.equal(lse.view(-1, b, nq).transpose(0, 1), lse4)


def test_a_mixed_step_captured_in_a_cuda_graph():
    """With ``max_seqlen_q`` given the call reads nothing on the host: it can be captured, and a replay with other
    offsets (the same total rows) computes the new split."""
    q, kc, vc, seqlens, table, cu = on_gpu(
        *mixed_case(4, True, ROWS, LENGTHS, hq=32, hk=8, d=128, dtype=torch.bfloat16, capacity=4096)
    )
    kwargs = dict(causal=True, cu_seqlens_q=cu, max_seqlen_q=320)
    flash_attention_with_kvcache(q, kc, vc, seqlens, table, **kwargs)  # picks and caches the config
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_with_kvcache(q, kc, vc, seqlens, table, **kwargs)
    rows = [1, 300, 1, 0, 77, 1, 1, 16]  # another split of the same 397 rows
    cu.copy_(offsets(rows).cuda())
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = check_mixed(q, kc, vc, seqlens, table, cu, causal=True, max_seqlen_q=320)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
