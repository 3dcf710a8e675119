"""Mixed prefill/decode batches: ``flash_attention_with_kvcache`` with ragged query rows (``cu_seqlens_q``).

A serving engine's step packs some sequences' prefill chunks (many rows) with other sequences' single decode rows
into one q ``(total_q, Hq, D)``; sequence b's rows are ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``, its newest
positions. Each case is checked, sequence by sequence, against ``attention_float64`` over that sequence's keys
gathered from the cache, with the masks aligned to the sequence's own end and its own row count.
"""

from __future__ import annotations

import pytest
import torch
from test_kvcache import gather, paged_case

from flashlab import flash_attention_with_kvcache
from flashlab.calculators import schedule
from flashlab.core.numerics import tolerance
from flashlab.host.plan import PLANS
from flashlab.kernels.decode import kvcache
from flashlab.kernels.device import kernel_band
from flashlab.reference.torch_float64 import attention_float64

LSE_TOL = 1e-4
# query rows per sequence: prefill chunks of 7, 1 and 21 rows, single decode rows, and a sequence with none
ROWS = [7, 1, 1, 0, 21, 1]
LENGTHS = [40, 17, 33, 9, 52, 1]  # keys each sequence holds (its rows included)


def offsets(rows) -> torch.Tensor:
    """cu_seqlens_q ``(B + 1,)`` int32 for per-sequence row counts."""
    return torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)


def mixed_case(seed, paged, rows=ROWS, lengths=LENGTHS, hq=4, hk=2, d=16, dtype=torch.float32, capacity=64, bs=16):
    """``(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q)``: q packed ``(total_q, Hq, D)``; a pool
    of ``bs``-token blocks in shuffled order (one block shared), or with ``paged`` False one slab per sequence."""
    b = len(rows)
    _, kc, vc, seqlens, table = paged_case(seed, b, hq, hk, 1, d, bs, dtype, capacity, lengths=lengths)
    if not paged:  # the same keys, one (capacity, Hk, D) slab per sequence
        slabs = torch.zeros(2, b, capacity, hk, d, dtype=dtype)
        for i, n in enumerate(lengths):
            for c, cache in enumerate((kc, vc)):
                slabs[c, i, :n] = gather(cache, table[i], n)[0].permute(1, 0, 2)
        kc, vc, table = slabs[0], slabs[1], None
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(rows), hq, d, generator=g).to(dtype)
    return q, kc, vc, seqlens, table, offsets(rows)


def sequence_keys(cache, table, i, n):
    """(1, Hk, n, D): sequence i's first n keys (or values), from a pool or from its slab."""
    if table is None:
        return cache[i : i + 1, :n].permute(0, 2, 1, 3)
    return gather(cache, table[i], n)


def check_mixed(q, kc, vc, seqlens, table, cu, causal=False, window=None, **kwargs):
    """Run the packed call and compare every sequence's rows with its own float64 attention."""
    o, lse = flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=causal, window=window, return_lse=True,
                                          cu_seqlens_q=cu, **kwargs)  # fmt: skip
    total, hq, _ = q.shape
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (hq, total) and lse.dtype == torch.float32
    for i in range(len(seqlens)):
        lo, hi, n = int(cu[i]), int(cu[i + 1]), int(seqlens[i])
        if hi == lo:
            continue
        k, v = sequence_keys(kc, table, i, n), sequence_keys(vc, table, i, n)
        qi = q[lo:hi].permute(1, 0, 2)[None]  # (1, Hq, rows, D)
        ro, rlse = attention_float64(qi, k, v, causal=causal, window=window)
        oi = o[lo:hi].permute(1, 0, 2)[None].double()
        err = float((oi - ro).norm() / max(float(ro.norm()), 1e-300))
        assert err < tolerance(q.dtype), f"sequence {i}: relative error {err:.2e}"
        li = lse[:, lo:hi][None].double()
        empty = torch.isneginf(rlse)
        assert torch.equal(torch.isneginf(li), empty), f"sequence {i}: lse must be -inf exactly where no key is seen"
        assert (oi[empty] == 0).all()
        if (~empty).any():
            assert float(((li - rlse)[~empty].abs() / rlse[~empty].abs().clamp(min=1.0)).max()) < LSE_TOL
    return o, lse


@pytest.mark.parametrize(
    "paged, causal, window",
    [(True, False, None), (True, True, None), (True, True, (5, 0)), (True, False, (6, 3)), (False, True, None),
     (False, False, (6, 3))],
    ids=str,
)  # fmt: skip
def test_a_mixed_batch_matches_float64_per_sequence(paged, causal, window):
    check_mixed(*mixed_case(0, paged), causal=causal, window=window)


def test_sixteen_bit_inputs_with_gqa():
    check_mixed(*mixed_case(1, True, hq=6, hk=2, d=24, dtype=torch.bfloat16), causal=True)


def test_a_long_cache_is_cut_into_chunks_and_merged():
    rows, lengths = [12, 1], [300, 270]
    q, kc, vc, seqlens, table, cu = mixed_case(2, True, rows=rows, lengths=lengths, hq=2, hk=1, capacity=320)
    _, left, right, qk_scale, _ = kernel_band(max(rows), 320, 16, True, None, None)
    args = kvcache.KVCacheArguments(q, kc, vc, table, 16, 320, left, right, qk_scale, ragged=(2, max(rows)))
    assert args.num_splits > 1 and not args.direct, "the case must take the chunks' merge"
    check_mixed(q, kc, vc, seqlens, table, cu, causal=True)


def test_uniform_rows_give_the_uniform_path_results_bit_for_bit():
    """The packed layout of a uniform batch runs the same tiles and chunks: the same bits as ``(B, Hq, Nq, D)``."""
    b, nq = 3, 4
    q, kc, vc, seqlens, table, cu = mixed_case(3, True, rows=[nq] * b, lengths=[20, 35, 4])
    q4 = q.view(b, nq, *q.shape[1:]).transpose(1, 2)  # (B, Hq, Nq, D)
    o4, lse4 = flash_attention_with_kvcache(q4, kc, vc, seqlens, table, causal=True, return_lse=True)
    o, lse = check_mixed(q, kc, vc, seqlens, table, cu, causal=True)
    assert torch.equal(o.view(b, nq, *o.shape[1:]).transpose(1, 2), o4)
    assert torch.equal(lse.view(-1, b, nq).transpose(0, 1), lse4)


def test_one_plan_serves_every_split_of_the_same_rows():
    """The offsets are read on the device: a plan keyed by (total_q, max_seqlen_q) runs any split of the rows."""
    rows_a, rows_b = [5, 1, 2], [2, 5, 1]
    q, kc, vc, seqlens, table, cu = mixed_case(4, True, rows=rows_a, lengths=[10, 20, 30])
    check_mixed(q, kc, vc, seqlens, table, cu, causal=True)
    planned = len(PLANS)
    check_mixed(q, kc, vc, seqlens, table, offsets(rows_b), causal=True)
    assert len(PLANS) == planned, "the same shapes and max_seqlen_q must reuse the plan"
    check_mixed(q, kc, vc, seqlens, table, offsets(rows_b), causal=True, max_seqlen_q=8)  # a larger bound
    assert len(PLANS) == planned + 1, "another max_seqlen_q cuts another grid: another plan"


def test_a_bad_length_in_a_mixed_batch_is_reported():
    q, kc, vc, seqlens, table, cu = mixed_case(5, True)
    seqlens[1] = 10**6
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]"):
        flash_attention_with_kvcache(q, kc, vc, seqlens, table, cu_seqlens_q=cu)


def test_a_mixed_step_compiles_into_one_operator_node():
    """torch.compile traces the packed call into the registered operator (its fake gives the packed shapes, as
    meta tensors show), which runs the eager call's plan: the same bits."""
    q, kc, vc, seqlens, table, cu = mixed_case(6, True, rows=[2, 0, 1], lengths=[5, 3, 20])
    args = (q, kc, vc, seqlens, table, True, -1, -1, None, True, False, cu, 2)
    o, lse = torch.ops.flashlab.attention_with_kvcache(*(x.to("meta") if torch.is_tensor(x) else x for x in args))
    assert o.device.type == "meta" and o.shape == q.shape
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32

    def step(q, kc, vc, seqlens, table, cu):
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True, return_lse=True, cu_seqlens_q=cu)

    torch._dynamo.reset()
    o, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(q, kc, vc, seqlens, table, cu)
    eager = step(q, kc, vc, seqlens, table, cu)
    assert torch.equal(o, eager[0]) and torch.equal(lse, eager[1])


def bad_calls():
    """(description, call's changes, error type, message pattern)."""
    cu = offsets(ROWS)
    return [
        ("int64 offsets", dict(cu_seqlens_q=cu.long()), TypeError, "cu_seqlens_q must be int32"),
        ("2-D offsets", dict(cu_seqlens_q=cu[None]), ValueError, r"cu_seqlens_q must be \(B \+ 1,\)"),
        ("one entry", dict(cu_seqlens_q=cu[:1]), ValueError, r"cu_seqlens_q must be \(B \+ 1,\)"),
        ("wrong batch", dict(cu_seqlens_q=cu[:-1]), ValueError, "cache_seqlens must have one length per sequence"),
        ("not at 0", dict(cu_seqlens_q=cu + 1), ValueError, "must start at 0"),
        (
            "decreasing",
            dict(cu_seqlens_q=torch.tensor([0, 7, 6, 9, 9, 30, 31], dtype=torch.int32)),
            ValueError,
            r"must not decrease; got cu_seqlens_q\[1\] = 7 > cu_seqlens_q\[2\] = 6",
        ),
        (
            "short end",
            dict(cu_seqlens_q=torch.tensor([0, 7, 8, 9, 9, 29, 30], dtype=torch.int32)),
            ValueError,
            r"last entry \(30\) must equal q's rows, total_q = 31",
        ),
        (
            "rows past the cache",
            dict(cache_seqlens=torch.tensor([40, 17, 33, 9, 20, 1], dtype=torch.int32)),
            ValueError,
            r"sequence 4 has 21 query rows but cache_seqlens\[4\] = 20",
        ),
        ("small max", dict(max_seqlen_q=20), ValueError, r"max_seqlen_q \(20\) is less than .* \(21\)"),
        ("bad max", dict(max_seqlen_q=0), ValueError, "max_seqlen_q must be None or an int >= 1"),
        ("float max", dict(max_seqlen_q=21.0), ValueError, "max_seqlen_q must be None or an int >= 1"),
        ("4-D q", dict(q="4d"), ValueError, r"q is packed as \(total_q, Hq, D\) and must have 3 dims"),
        ("no rows", dict(q="empty", cu_seqlens_q=torch.zeros(7, dtype=torch.int32)), ValueError, "no query rows"),
        ("max without offsets", dict(cu_seqlens_q=None, max_seqlen_q=4), ValueError, "pass it with cu_seqlens_q"),
        ("offsets as a list", dict(cu_seqlens_q=cu.tolist()), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("name, changes, error, match", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_ragged_inputs_raise_clear_errors(name, changes, error, match):
    q, kc, vc, seqlens, table, cu = mixed_case(7, True)
    call = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, block_table=table, cu_seqlens_q=cu)
    call.update(changes)
    if isinstance(call["q"], str):
        call["q"] = q[None] if call["q"] == "4d" else q[:0]
    with pytest.raises(error, match=match):
        flash_attention_with_kvcache(**call)


def test_offsets_on_another_device_are_refused():
    q, kc, vc, seqlens, table, cu = mixed_case(8, True)
    meta = torch.zeros(len(cu), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be on q's device \(cpu\)"):
        flash_attention_with_kvcache(q, kc, vc, seqlens, table, cu_seqlens_q=meta)


# a ragged launch cut for long chunks (at least kvcache.TALL_ROWS packed rows a sequence): prefill chunks of 70 and
# 40 rows, decode rows, an empty sequence, caches long and short
ORDER_ROWS = [70, 1, 0, 40, 1, 3]
ORDER_LENGTHS = [300, 250, 9, 60, 1, 200]


def ordered_arguments(q, kc, table, rows, capacity, causal, window):
    _, left, right, qk_scale, _ = kernel_band(max(rows), capacity, q.shape[-1], causal, window, None)
    args = kvcache.KVCacheArguments(q, kc, kc, table, 16, capacity, left, right, qk_scale,
                                    ragged=(len(rows), max(rows)))  # fmt: skip
    return args, left, right


def block_work(rows, lengths, group, block_m, left, right):
    """Each (sequence, row block) pair's products, counted row by row: the block's height times the keys from the
    first any of its rows sees to the last; -1 for a block past its sequence's rows."""
    work = []
    for nq, nk in zip(rows, lengths, strict=True):
        packed = group * nq
        height = kvcache.SHORT_BLOCK_M if packed <= kvcache.SHORT_BLOCK_M else block_m
        for m in range(-(-max(rows) * group // block_m)):
            block = range(m * height, min((m + 1) * height, packed))
            if not block:
                work.append(-1)
                continue
            seen = [(max(r % nq + nk - nq - left, 0), min(r % nq + nk - nq + right + 1, nk)) for r in block]
            work.append(height * max(max(hi for _, hi in seen) - min(lo for lo, _ in seen), 0))
    return work


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (30, 0))], ids=str)
def test_ragged_row_blocks_are_walked_heaviest_first(causal, window):
    """The order a long ragged launch walks its (sequence, row block) pairs in: by their products, the most first,
    ties in their own order, so that the long-running blocks of a long cache start before the short ones."""
    q, kc, _, seqlens, table, cu = mixed_case(6, True, rows=ORDER_ROWS, lengths=ORDER_LENGTHS, hq=4, hk=1,
                                              capacity=320)  # fmt: skip
    args, left, right = ordered_arguments(q, kc, table, ORDER_ROWS, 320, causal, window)
    assert args.meta["ORDERED"] and args.order == len(ORDER_ROWS) * args.grid[2] // len(ORDER_ROWS)
    order = torch.full((args.order,), -1, dtype=torch.int32)
    kvcache.order_row_blocks(args, cu, seqlens, order)
    work = block_work(ORDER_ROWS, ORDER_LENGTHS, 4, args.meta["BLOCK_M"], left, right)
    if causal and window is None:  # the calculator's model of the same launch counts the same work
        assert work == schedule.row_block_work(ORDER_ROWS, ORDER_LENGTHS, 4, args.meta["BLOCK_M"],
                                               kvcache.SHORT_BLOCK_M)  # fmt: skip
    assert order.tolist() == sorted(range(len(work)), key=lambda i: (-work[i], i))
    assert work[order[0]] == max(work) and work[order[-1]] == -1


def test_the_order_is_a_permutation_whatever_the_offsets_hold():
    """Offsets that decrease, or lengths past the capacity, still give every pair one place: no program runs a
    pair twice or leaves one out (the kernel then reports the bad length)."""
    q, kc, _, seqlens, table, cu = mixed_case(7, True, rows=ORDER_ROWS, lengths=ORDER_LENGTHS, hq=4, hk=1,
                                              capacity=320)  # fmt: skip
    args, _, _ = ordered_arguments(q, kc, table, ORDER_ROWS, 320, True, None)
    cu, seqlens = cu.flip(0).contiguous(), seqlens.clone()
    seqlens[0] = 10**6
    order = torch.full((args.order,), -1, dtype=torch.int32)
    kvcache.order_row_blocks(args, cu, seqlens, order)
    assert sorted(order.tolist()) == list(range(args.order))


@pytest.mark.parametrize("causal, window", [(True, None), (False, (6, 3))], ids=str)
def test_an_ordered_launch_matches_float64_with_its_chunks_merged(monkeypatch, causal, window):
    """The ordered launch on every row block height (64-row blocks, 16-row ones for the decode rows), its keys cut
    into chunks (more SMs pretended) and merged."""
    from flashlab.host import plan

    monkeypatch.setattr(kvcache.split_kv, "CPU_SM_COUNT", 64)
    q, kc, vc, seqlens, table, cu = mixed_case(8, True, rows=ORDER_ROWS, lengths=ORDER_LENGTHS, hq=4, hk=1,
                                               capacity=320)  # fmt: skip
    args, _, _ = ordered_arguments(q, kc, table, ORDER_ROWS, 320, causal, window)
    assert args.meta["ORDERED"] and args.meta["SHORT_M"] and args.num_splits > 1
    plan.forget()  # plans made with the CPU's usual SM count cut other chunks
    try:
        check_mixed(q, kc, vc, seqlens, table, cu, causal=causal, window=window)
    finally:
        plan.forget()
