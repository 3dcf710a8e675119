"""``flash_attention_with_kvcache`` compiled on a CUDA GPU, at serving sizes, against float64 (skipped without CUDA).

Run on the H200 with: ``python -m pytest tests/test_kvcache_gpu.py -q``. The cases are those of
``tests/test_kvcache.py`` scaled up: long ragged caches in shuffled, shared blocks of 16 and 256 tokens, 64 query /
8 KV heads at D = 128, chunked prefill against a long cache, and the captured-in-a-CUDA-graph decode step; then the
values check on the device: a bad entry or length raises at the next call or through ``check_kvcache_errors``,
also from a CUDA graph's replay, and a 200-step decode loop with the default check never synchronises.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from test_kvcache import check, gather, paged_case

import flashlab
from flashlab import flash_attention, flash_attention_with_kvcache

pytestmark = pytest.mark.gpu


def on_gpu(*xs):
    return [x.cuda() for x in xs]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_long_ragged_paged(block_size, dtype):
    case = paged_case(1, b=4, hq=64, hk=8, nq=1, d=128, bs=block_size, dtype=dtype, max_len=8192)
    check(*on_gpu(*case))
    check(*on_gpu(*case), causal=True, window=(1000, None))


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill_against_a_long_cache(causal):
    case = paged_case(2, b=2, hq=32, hk=8, nq=300, d=128, bs=16, dtype=torch.bfloat16, max_len=6000, zero=False)
    check(*on_gpu(*case), causal=causal)


def slabs(cache, table, seqlens, capacity):
    """A paged cache's sequences copied into one zero-padded slab each: ``(B, capacity, Hk, D)``."""
    out = cache.new_zeros(len(seqlens), capacity, *cache.shape[2:])
    for i, n in enumerate(seqlens.tolist()):
        out[i, :n] = gather(cache, table[i], n)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_prefill_takes_tall_row_blocks_from_the_threshold(dtype):
    # GROUP = 4: 63 query rows make 252 packed rows (64-row blocks, the decode tiles), 64 make 256 (TALL_ROWS:
    # 128-row blocks of eight warps); both match float64, causal, windowed and not, in 16-token blocks and a
    # contiguous cache
    from flashlab.host.plan import PLANS, kvcache_signature
    from flashlab.kernels.decode import kvcache

    for nq, tall in ((kvcache.TALL_ROWS // 4 - 1, False), (kvcache.TALL_ROWS // 4, True), (700, True)):
        for bs in (16, 0):
            q, kc, vc, seqlens, table = on_gpu(*paged_case(10 + nq, b=3, hq=32, hk=8, nq=nq, d=128, bs=16,
                                                           dtype=dtype, max_len=5000, zero=False))  # fmt: skip
            if bs == 0:  # the same keys as one slab a sequence (B, capacity, Hk, D), no table
                kc, vc = (slabs(x, table, seqlens, 5008) for x in (kc, vc))
                table = None
            for causal, window in ((True, None), (False, None), (True, (700, 0))):
                check(q, kc, vc, seqlens, table, causal=causal, window=window)
            args = PLANS[kvcache_signature(q, kc, vc, seqlens, table, True, (700, 0), None)].args
            assert (args.meta["BLOCK_M"] == kvcache.TALL_BLOCK_M) == tall, (nq, args.meta)
            assert (args.meta["num_warps"] == kvcache.TALL_CONFIG[1]) if tall else args.meta["BLOCK_M"] == 64


def test_contiguous_cache_and_odd_head_dim():
    g = torch.Generator(device="cuda").manual_seed(3)
    kc, vc = torch.randn(2, 3, 5000, 2, 80, device="cuda", generator=g).to(torch.float16).unbind(0)
    q = torch.randn(3, 8, 4, 80, device="cuda", generator=g).to(torch.float16)
    seqlens = torch.tensor([5000, 1, 2345], dtype=torch.int32, device="cuda")
    check(q, kc, vc, seqlens, None, causal=True)


def test_paged_equals_contiguous_flash_attention():
    q, kc, vc, seqlens, table = on_gpu(
        *paged_case(4, b=1, hq=64, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16, max_len=32768, zero=False)
    )
    n = int(seqlens[0])
    k, v = gather(kc, table[0], n), gather(vc, table[0], n)
    o_paged = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    torch.testing.assert_close(o_paged, flash_attention(q, k, v), rtol=2e-2, atol=2e-2)


def test_decode_step_captured_in_a_cuda_graph():
    q, kc, vc, seqlens, table = on_gpu(
        *paged_case(5, b=8, hq=64, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16, max_len=4096, zero=False)
    )
    expected = flash_attention_with_kvcache(q, kc, vc, seqlens, table)  # also picks and caches the config
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    q.copy_(torch.randn_like(q))  # a new step: new queries, one more token per sequence
    seqlens.sub_(1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, flash_attention_with_kvcache(q, kc, vc, seqlens, table), rtol=0, atol=0)
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_loop_relaunches_directly_and_stays_exact(block_size):
    from flashlab.host.plan import CHECKED, PLANS, kvcache_signature

    case = on_gpu(*paged_case(6, b=4, hq=64, hk=8, nq=1, d=128, bs=block_size, dtype=torch.bfloat16,
                              max_len=20000, lengths=[20000, 15000, 9001, 3000]))  # fmt: skip
    q, kc, vc, seqlens, table = case
    for _ in range(6):  # autotune, JIT launch (FastLaunch built), checked against the JIT once, then direct
        q = torch.randn_like(q)
        seqlens.sub_(1)
        check(q, kc, vc, seqlens, table, causal=True)
    plan = PLANS[kvcache_signature(q, kc, vc, seqlens, table, True, None, None)]
    assert plan.state == CHECKED, plan.state


def test_small_blocks_with_many_chunks_merge_in_one_launch_as_a_tree():
    # 16-token blocks at B = 1: more chunks than one program folds, so the plan takes the tree (no second merge
    # kernel) with chunks for the two programs an SM its registers allow; exact, and the same bits every launch
    from flashlab.host.plan import PLANS, kvcache_signature
    from flashlab.kernels.decode import kvcache, split_kv
    from flashlab.kernels.device import sm_count

    q, kc, vc, seqlens, table = on_gpu(
        *paged_case(9, b=1, hq=64, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16, max_len=32768, zero=False)
    )
    check(q, kc, vc, seqlens, table)
    first = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    args = PLANS[kvcache_signature(q, kc, vc, seqlens, table, False, None, None)].args
    sms = sm_count(q.device.index)
    assert args.meta["MERGE_HERE"] and args.meta["MERGE_GROUP"] == split_kv.TREE_GROUP
    assert split_kv.MAX_FOLD_SPLITS < args.num_splits
    assert args.num_splits * 8 <= kvcache.SMALL_BLOCK_TREE_PROGRAMS_PER_SM * sms  # one wave at two an SM
    for _ in range(20):
        torch.testing.assert_close(flash_attention_with_kvcache(q, kc, vc, seqlens, table), first, rtol=0, atol=0)


@contextlib.contextmanager
def no_synchronisation():
    """Any synchronising CUDA call inside is a RuntimeError (torch's sync debug mode, which warns that it is a
    prototype when switched on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode(0)


def test_a_bad_entry_raises_at_the_next_call_and_a_bad_length_through_the_explicit_check():
    from flashlab.host.plan import CHECKED, PLANS, kvcache_signature

    q, kc, vc, seqlens, table = on_gpu(*paged_case(7, b=4, hq=32, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16,
                                                   max_len=4096, lengths=[4096, 3000, 2000, 1000]))  # fmt: skip
    for _ in range(6):  # autotune, JIT launch, the direct launch checked: the errors below come through it
        good = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    assert PLANS[kvcache_signature(q, kc, vc, seqlens, table, False, None, None)].state == CHECKED
    bad = table.clone()
    bad[2, 5] = kc.shape[0] + 7
    o = flash_attention_with_kvcache(q, kc, vc, seqlens, bad)  # returns without waiting for the GPU
    torch.cuda.synchronize()
    assert torch.isnan(o[2]).all() and torch.isfinite(o[[0, 1, 3]]).all()
    torch.testing.assert_close(o[[0, 1, 3]], good[[0, 1, 3]], rtol=0, atol=0)
    message = rf"earlier .* on cuda:\d met a bad value: block_table\[2, 5\] = {kc.shape[0] + 7} is not a block"
    with pytest.raises(ValueError, match=message):
        flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    torch.testing.assert_close(flash_attention_with_kvcache(q, kc, vc, seqlens, table), good, rtol=0, atol=0)
    bad_lengths = seqlens.clone()
    bad_lengths[1] = -1
    o = flash_attention_with_kvcache(q, kc, vc, bad_lengths, table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -1 is outside \[0, 4096\]"):
        flashlab.check_kvcache_errors()
    assert torch.isnan(o[1]).all() and torch.isfinite(o[[0, 2, 3]]).all()
    flashlab.check_kvcache_errors(q.device)  # empty again
    with pytest.raises(ValueError, match=r"block_table\[2, 5\]"):  # "sync": the host's check, in the call
        flash_attention_with_kvcache(q, kc, vc, seqlens, bad, check_values="sync")
    flash_attention_with_kvcache(q, kc, vc, seqlens, bad, check_values=False)  # nothing reported
    flashlab.check_kvcache_errors()


def test_a_replayed_cuda_graph_still_reports_a_bad_entry():
    q, kc, vc, seqlens, table = on_gpu(
        *paged_case(5, b=8, hq=64, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16, max_len=4096, zero=False)
    )
    expected = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    good = table.clone()
    table[3, 0] = -2  # in place: the graph's kernel reads it at the replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[3]).all() and torch.isfinite(out[torch.arange(8) != 3]).all()
    with pytest.raises(ValueError, match=r"block_table\[3, 0\] = -2 is not a block"):
        flashlab.check_kvcache_errors()
    table.copy_(good)
    graph.replay()
    flashlab.check_kvcache_errors()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [16, 256])
def test_a_decode_loop_with_the_default_check_never_synchronises(block_size):
    lengths = [8192, 7000, 6000, 5000, 4000, 3000, 2000, 1000]
    q, kc, vc, seqlens, table = on_gpu(*paged_case(8, b=8, hq=32, hk=8, nq=1, d=128, bs=block_size,
                                                   dtype=torch.bfloat16, max_len=8192, lengths=lengths))  # fmt: skip
    seqlens.sub_(200)  # the loop's 200 tokens fill the blocks the table holds
    for _ in range(6):  # autotune, JIT launch, the direct launch checked (that check compares on the host)
        flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    queries = torch.randn(200, *q.shape, device="cuda", dtype=q.dtype)
    with no_synchronisation():
        for step in range(200):
            o = flash_attention_with_kvcache(queries[step], kc, vc, seqlens, table)
            seqlens.add_(1)
    flashlab.check_kvcache_errors()
    check(queries[-1], kc, vc, seqlens - 1, table)
    torch.testing.assert_close(o, flash_attention_with_kvcache(queries[-1], kc, vc, seqlens - 1, table))
    with pytest.raises(RuntimeError, match="synchroniz"), no_synchronisation():  # the detector sees the old check
        flash_attention_with_kvcache(q, kc, vc, seqlens, table, check_values="sync")
