"""``flash_attention_with_kvcache`` on the CPU (Triton's interpreter) against the float64 reference.

Each case builds a paged cache the way a serving engine holds one: a pool of blocks, a block table per sequence
with its blocks in random order (some shared between sequences), ragged lengths including 0. The reference gathers
each sequence's keys and values into contiguous tensors and runs ``attention_float64`` on them, one sequence at a
time, with the masks aligned to that sequence's own length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernel import LAYOUTS, laid_out

from flashlab import flash_attention, flash_attention_with_kvcache
from flashlab.core.numerics import tolerance
from flashlab.reference.torch_float64 import attention_float64

LSE_TOL = 1e-4


def gather(cache, table_row, seqlen):
    """(1, Hk, seqlen, D): one sequence's keys (or values) gathered from a paged cache (num_blocks, bs, Hk, D)."""
    bs = cache.shape[1]
    blocks = table_row[: -(-seqlen // bs)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seqlen].permute(1, 0, 2)[None]  # (1, Hk, seqlen, D)


def reference(q, k_cache, v_cache, seqlens, table, causal, window, scale=None):
    """float64 (o, lse) per sequence; ``table`` None means the cache is (B, Nk_max, Hk, D)."""
    b, hq, nq, d = q.shape
    o = torch.zeros(b, hq, nq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(b):
        n = int(seqlens[i])
        if n == 0:
            continue
        if table is None:
            k, v = (c[i : i + 1, :n].permute(0, 2, 1, 3) for c in (k_cache, v_cache))
        else:
            k, v = gather(k_cache, table[i], n), gather(v_cache, table[i], n)
        o[i : i + 1], lse[i : i + 1] = attention_float64(q[i : i + 1], k, v, causal=causal, window=window, scale=scale)
    return o, lse


def paged_case(seed, b, hq, hk, nq, d, bs, dtype, max_len, shared=True, zero=True, lengths=None):
    """A random pool, block tables in shuffled order (sequence 0's first block shared by sequence 1), lengths
    (random in [nq, max_len], the last one 0 with ``zero``; or ``lengths``)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = rng.integers(nq, max_len + 1, size=b)
        if zero and b > 1:
            lengths[-1] = 0
    lengths = np.asarray(lengths)
    max_blocks = -(-max_len // bs)
    blocks_needed = [-(-int(n) // bs) for n in lengths]
    pool = sum(blocks_needed) + 3  # a few blocks nobody uses
    order = rng.permutation(pool)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)  # unused entries hold -1, as engines pad them
    used = 0
    for i, need in enumerate(blocks_needed):
        table[i, :need] = torch.as_tensor(order[used : used + need], dtype=torch.int32)
        used += need
    if shared and b > 1 and blocks_needed[0] and blocks_needed[1]:
        table[1, 0] = table[0, 0]  # a shared prompt prefix: the same physical block in two tables
    k_cache = torch.randn(pool, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, bs, hk, d, generator=g).to(dtype)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.as_tensor(lengths, dtype=torch.int32), table


def check(q, k_cache, v_cache, seqlens, table, causal=False, window=None, scale=None):
    o, lse = flash_attention_with_kvcache(
        q, k_cache, v_cache, seqlens, table, causal=causal, window=window, scale=scale, return_lse=True
    )
    ro, rlse = reference(q, k_cache, v_cache, seqlens, table, causal, window, scale)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    o, lse = o.double(), lse.double()
    assert torch.isfinite(o).all()
    err = float((o - ro).norm() / max(float(ro.norm()), 1e-300))
    assert err < tolerance(q.dtype), f"relative error {err:.2e} for {q.dtype}"
    empty = torch.isneginf(rlse)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on rows that see no key"
    assert (o[empty] == 0).all()
    if (~empty).any():
        gap = (lse[~empty] - rlse[~empty]).abs() / rlse[~empty].abs().clamp(min=1.0)
        assert float(gap.max()) < LSE_TOL
    return err


def table_laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A block table (2-D) or lengths (1-D) with the same values in another layout: a column slice of a wider
    tensor, or every other entry of a longer one."""
    if layout == "contiguous":
        return x
    if layout == "column_slice":
        big = torch.full((*x.shape[:-1], x.shape[-1] + 3), -7, dtype=x.dtype)
        big[..., 2 : 2 + x.shape[-1]] = x
        return big[..., 2 : 2 + x.shape[-1]]
    big = torch.full((*x.shape[:-1], 2 * x.shape[-1]), -7, dtype=x.dtype)  # every other entry
    big[..., ::2] = x
    return big[..., ::2]


@pytest.mark.parametrize("seed", range(10))
def test_random_layouts_negative_scales_and_strided_tables_match_float64(seed):
    # q a slice, strided or expanded view with a negative scale, and a block table or lengths that are not
    # contiguous: the launch reads each through the strides of the tensor it launches on
    rng = np.random.default_rng(2000 + seed)
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    hk, group = int(rng.integers(1, 3)), int(rng.choice([1, 2, 3]))
    nq, bs = int(rng.choice([1, 1, 3, 7])), int(rng.choice([16, 32, 48]))
    q, kc, vc, seqlens, table = paged_case(seed, b=3, hq=hk * group, hk=hk, nq=nq, d=int(rng.choice([16, 24, 40])),
                                           bs=bs, dtype=dtype, max_len=int(rng.integers(nq + 1, 100)))  # fmt: skip
    q = laid_out(q, LAYOUTS[1 + seed % (len(LAYOUTS) - 1)])
    table_layout = ("column_slice", "every_other", "every_other")[seed % 3]
    lengths_layout = ("contiguous", "every_other")[seed % 2]
    paged = seed % 5 != 4  # one case in five: a contiguous cache, (B, Nk_max, Hk, D), with strided lengths
    if not paged:
        kc, vc = (torch.randn(3, 64, hk, q.shape[-1], generator=torch.Generator().manual_seed(seed)).to(dtype)
                  for _ in range(2))  # fmt: skip
        seqlens, table, lengths_layout = seqlens.clamp(max=64), None, "every_other"
    seqlens = table_laid_out(seqlens, lengths_layout)
    if table is not None:
        table = table_laid_out(table, table_layout)
    scale = [-0.5, -1.3, None, 0.8, -0.2][seed % 5]
    causal = bool(seed % 3 == 1)
    check(q, kc, vc, seqlens, table, causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_through_shuffled_shared_blocks_every_dtype(dtype):
    q, kc, vc, seqlens, table = paged_case(1, b=3, hq=4, hk=2, nq=1, d=32, bs=16, dtype=dtype, max_len=90)
    check(q, kc, vc, seqlens, table)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (20, None)), (False, (10, 5))], ids=str)
def test_masks_follow_each_sequence_end(causal, window):
    # Nq = 5 new tokens per sequence (a small chunk of prefill, or speculative decoding's drafts); GQA group 3
    q, kc, vc, seqlens, table = paged_case(2, b=3, hq=6, hk=2, nq=5, d=16, bs=32, dtype=torch.float32, max_len=70)
    check(q, kc, vc, seqlens, table, causal=causal, window=window)


def test_chunked_prefill_longer_than_a_row_block():
    # 40 query rows x group 2 = 80 packed rows: two row blocks; one sequence shorter than Nq (causal: rows see none)
    q, kc, vc, seqlens, table = paged_case(
        3, b=2, hq=2, hk=1, nq=40, d=16, bs=16, dtype=torch.float32, max_len=60, lengths=[57, 30]
    )
    check(q, kc, vc, seqlens, table, causal=True)
    check(q, kc, vc, seqlens, table)


def test_many_rows_split_the_key_loop_at_the_band_and_still_mask_its_edges():
    # 64 query rows x group 4 = 256 packed rows (TALL_ROWS): the key loop runs in three, the tiles inside every
    # row's band unmasked. Windows put masked tiles on both sides of the unmasked ones; a length shorter than Nq
    # leaves rows that see nothing; a bad entry inside the unmasked tiles still turns the sequence to NaN without
    # a read outside the pool (its neighbours exact)
    from flashlab.host.plan import PLANS, kvcache_signature
    from flashlab.kernels.decode import kvcache

    q, kc, vc, seqlens, table = paged_case(
        7, b=3, hq=4, hk=1, nq=64, d=16, bs=16, dtype=torch.float32, max_len=190, lengths=[190, 101, 40]
    )
    assert 4 * 64 == kvcache.TALL_ROWS
    for causal, window in ((True, (70, 0)), (False, (40, 30))):  # unmasked tiles between masked ones
        check(q, kc, vc, seqlens, table, causal=causal, window=window)
    args = PLANS[kvcache_signature(q, kc, vc, seqlens, table, False, (40, 30), None)].args
    assert args.meta["SPLIT_BAND"]
    bad = table.clone()
    bad[0, 2] = 10**6  # keys 32..47 of sequence 0: inside every row's band (causal, 190 keys, 64 rows)
    o = flash_attention_with_kvcache(q, kc, vc, seqlens, bad, causal=True, check_values=False)
    assert torch.isnan(o[0]).all()
    ro, _ = reference(q[1:], kc, vc, seqlens[1:], table[1:], True, None)
    torch.testing.assert_close(o[1:].double(), ro, rtol=1e-5, atol=1e-5)


def test_block_size_that_is_not_a_power_of_two():
    q, kc, vc, seqlens, table = paged_case(4, b=2, hq=2, hk=2, nq=2, d=16, bs=48, dtype=torch.float16, max_len=100)
    check(q, kc, vc, seqlens, table, causal=True)


def test_many_chunks_merged():
    # a long cache cuts into several chunks (CPU pretends to have 4 SMs); lengths end mid-chunk and mid-block
    q, kc, vc, seqlens, table = paged_case(
        5, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.bfloat16, max_len=700, lengths=[700, 333]
    )
    check(q, kc, vc, seqlens, table)
    check(q, kc, vc, seqlens, table, causal=True, window=(150, None))


def test_contiguous_cache_without_block_table():
    g = torch.Generator().manual_seed(6)
    kc, vc = torch.randn(2, 2, 50, 2, 24, generator=g).unbind(0)  # (B, Nk_max, Hk, D)
    q = torch.randn(2, 4, 3, 24, generator=g)
    seqlens = torch.tensor([50, 17], dtype=torch.int32)
    check(q, kc, vc, seqlens, None, causal=True)


def test_paged_equals_flash_attention_on_the_same_keys():
    from flashlab import flash_attention

    q, kc, vc, seqlens, table = paged_case(7, b=1, hq=4, hk=2, nq=1, d=32, bs=16, dtype=torch.float32, max_len=80)
    n = int(seqlens[0])
    k, v = gather(kc, table[0], n), gather(vc, table[0], n)
    torch.testing.assert_close(
        flash_attention_with_kvcache(q, kc, vc, seqlens, table), flash_attention(q, k, v), rtol=1e-5, atol=1e-5
    )


def test_length_zero_gives_zeros_and_minus_inf():
    q, kc, vc, seqlens, table = paged_case(8, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    seqlens[:] = 0
    o, lse = flash_attention_with_kvcache(q, kc, vc, seqlens, table, return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_unused_blocks_are_never_read():
    q, kc, vc, seqlens, table = paged_case(9, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=64)
    ref = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    used = {int(x) for i in range(2) for x in table[i, : -(-int(seqlens[i]) // 16)]}
    for blk in set(range(kc.shape[0])) - used:
        kc[blk], vc[blk] = float("nan"), float("nan")
    for i in range(2):  # the slots past each sequence's end in its last block
        n = int(seqlens[i])
        if n % 16:
            kc[table[i, n // 16], n % 16 :] = float("nan")
    torch.testing.assert_close(flash_attention_with_kvcache(q, kc, vc, seqlens, table), ref, rtol=0, atol=0)


@pytest.mark.parametrize("strided", ["block_table", "cache_seqlens"])
def test_a_strided_block_table_or_lengths_alone_gives_the_same_answer(strided):
    q, kc, vc, seqlens, table = paged_case(4, b=3, hq=2, hk=1, nq=2, d=16, bs=16, dtype=torch.float32, max_len=70)
    if strided == "block_table":
        table = table_laid_out(table, "every_other")
    else:
        seqlens = table_laid_out(seqlens, "every_other")
    check(q, kc, vc, seqlens, table)


def test_a_scale_beyond_float32_is_refused_as_flash_attention_refuses_it():
    q, kc, vc, seqlens, table = paged_case(3, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    for scale in (1e39, -1e39, 10**400, float("nan")):
        with pytest.raises(ValueError, match="scale") as kvcache_error:
            flash_attention_with_kvcache(q, kc, vc, seqlens, table, scale=scale)
        with pytest.raises(ValueError, match="scale") as prefill_error:
            flash_attention(q, q, q, scale=scale)
        assert str(kvcache_error.value) == str(prefill_error.value)


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "cache_seqlens", "block_table"])
def test_a_sparse_tensor_is_a_clear_type_error_naming_it(name):
    q, kc, vc, seqlens, table = paged_case(3, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, block_table=table)
    args[name] = args[name].to_sparse()
    with pytest.raises(TypeError, match=f"{name} must be a dense"):
        flash_attention_with_kvcache(**args)


def test_bad_inputs_raise_clear_errors():
    q, kc, vc, seqlens, table = paged_case(10, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    f = flash_attention_with_kvcache
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        f(q, kc, vc, seqlens.long(), table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        f(q, kc, vc, seqlens, table.long())
    with pytest.raises(TypeError, match="same dtype"):
        f(q.half(), kc, vc, seqlens, table)
    with pytest.raises(ValueError, match="multiple of 16"):
        f(q, kc[:, :8], vc[:, :8], seqlens, table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 99 is outside \[0, 48\]"):
        f(q, kc, vc, torch.tensor([3, 99], dtype=torch.int32), table)
    bad = table.clone()
    bad[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = .* is not a block"):
        f(q, kc, vc, seqlens, bad)
    with pytest.raises(ValueError, match="one length per sequence"):
        f(q, kc, vc, seqlens[:1], table)
    with pytest.raises(ValueError, match=r"block_table must be \(B=2, max_blocks"):
        f(q, kc, vc, seqlens, table[:1])
    with pytest.raises(ValueError, match="multiple of the cache's key/value heads"):
        f(q, kc.expand(-1, -1, 3, -1).contiguous(), vc.expand(-1, -1, 3, -1).contiguous(), seqlens, table)
    with pytest.raises(ValueError, match=r"\(B, Nk_max, Hk, D\)"):
        f(q, kc, vc, seqlens, None)
    with pytest.raises(ValueError, match="head dim"):
        f(q, kc[..., :8], vc[..., :8], seqlens, table)
    with pytest.raises(ValueError, match="window"):
        f(q, kc, vc, seqlens, table, window=(-1, None))


def test_paged_kv_cache_holds_the_same_keys():
    from flashlab.kernels.decode.kvcache import paged_kv_cache

    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(2, 2, 3, 40, 16, generator=g).unbind(0)  # (B=2, Hk=3, N=40, D=16)
    kc, vc, table, seqlens = paged_kv_cache(k, v, 16, lengths=[40, 33])
    assert kc.shape == (6, 16, 3, 16) and table.shape == (2, 3) and seqlens.tolist() == [40, 33]
    assert sorted(table.flatten().tolist()) == list(range(6))
    for b in range(2):
        assert torch.equal(gather(kc, table[b], 40)[0], k[b]) and torch.equal(gather(vc, table[b], 40)[0], v[b])


BAD_VALUES = {  # (what is broken, how, the message it must give) in a case of lengths [40, 48, 20], 16-token blocks
    "entry_past_the_pool": (
        "table",
        (1, 2),
        lambda pages: pages,
        r"block_table\[1, 2\] = {v} is not a block of "
        r"the cache \(0 <= entry < {pages}\)",
    ),
    "negative_entry": ("table", (1, 0), lambda pages: -1, r"block_table\[1, 0\] = -1 is not a block"),
    "length_past_capacity": ("lengths", 1, lambda pages: 49, r"cache_seqlens\[1\] = 49 is outside \[0, 48\]"),
    "negative_length": ("lengths", 1, lambda pages: -3, r"cache_seqlens\[1\] = -3 is outside \[0, 48\]"),
}


def nan_fenced_case(seed, bs=16, dtype=torch.float32, **kwargs):
    """``paged_case`` with lengths [40, 48, 20] whose pool is a slice of a larger tensor holding NaN on both
    sides: a block read from just outside the pool (entry -1, or the pool's size) would bring NaN into the
    answer."""
    q, kc, vc, seqlens, table = paged_case(seed, b=3, hq=4, hk=2, nq=1, d=16, bs=bs, dtype=dtype, max_len=48,
                                           lengths=[40, 48, 20], shared=False, **kwargs)  # fmt: skip

    def fenced(cache):
        big = torch.full((cache.shape[0] + 4, *cache.shape[1:]), float("nan"), dtype=cache.dtype)
        big[2:-2] = cache
        return big[2:-2]

    return q, fenced(kc), fenced(vc), seqlens, table


def broken(name, seqlens, table, pages):
    """The case's lengths and table with ``BAD_VALUES[name]`` applied, and the message it must raise."""
    where, at, value, message = BAD_VALUES[name]
    seqlens, table = seqlens.clone(), table.clone()
    (table if where == "table" else seqlens)[at] = value(pages)
    return seqlens, table, message.format(v=value(pages), pages=pages)


@pytest.mark.parametrize("block_n", [16, 32], ids=["one_entry_a_tile", "one_entry_a_key"])
@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_value_raises_in_the_call_on_the_cpu_and_the_next_call_works(monkeypatch, name, block_n):
    # The interpreter runs the kernel to its end inside the call, so the kernel's own report raises there; the
    # host's synchronous check ("sync") raises the same words before launching. Either way the record is empty
    # again afterwards: the next good call answers, and nothing is left for check_kvcache_errors.
    import flashlab
    from flashlab.host import launches

    monkeypatch.setattr(launches, "CPU_CONFIG", {**launches.CPU_CONFIG, "BLOCK_N": block_n})
    q, kc, vc, seqlens, table = nan_fenced_case(20)
    bad_lengths, bad_table, message = broken(name, seqlens, table, kc.shape[0])
    for check_values in (True, "sync"):
        with pytest.raises(ValueError, match=message):
            flash_attention_with_kvcache(q, kc, vc, bad_lengths, bad_table, check_values=check_values)
        check(q, kc, vc, seqlens, table)
        flashlab.check_kvcache_errors()
        flashlab.check_kvcache_errors("cpu")


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_value_never_reads_outside_the_pool_and_gives_nan_rows(name):
    # check_values=False: no report. Sequence 1's rows are NaN; sequences 0 and 2, in the same launch, are finite
    # and match float64 (a read of the NaN beside the pool would have reached them through a shared tile or a
    # merge, or shown in sequence 1 as a finite wrong answer if the NaN rows were missing).
    q, kc, vc, seqlens, table = nan_fenced_case(21)
    bad_lengths, bad_table, _ = broken(name, seqlens, table, kc.shape[0])
    for check_values in (False, True):
        if check_values:
            with pytest.raises(ValueError):
                flash_attention_with_kvcache(q, kc, vc, bad_lengths, bad_table, check_values=True)
            continue
        o, lse = flash_attention_with_kvcache(q, kc, vc, bad_lengths, bad_table, return_lse=True, check_values=False)
        assert torch.isnan(o[1]).all(), "the bad sequence's rows must be NaN"
        good = [0, 2]
        ro, rlse = reference(q[good], kc, vc, seqlens[good], table[good], False, None)
        assert torch.isfinite(o[good]).all()
        torch.testing.assert_close(o[good].double(), ro, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[good].double(), rlse, rtol=1e-5, atol=1e-5)
    check(q, kc, vc, seqlens, table)  # nothing left in the record


@pytest.mark.parametrize("causal, window, nq, column", [(False, (10, 0), 1, 0), (True, None, 100, 6)], ids=str)
def test_a_bad_entry_the_band_never_reads_is_still_found(causal, window, nq, column):
    # A window of 10 keys before the last never reads sequence 1's first block. With 100 causal queries (two
    # blocks of 64 packed rows) against 112 keys, the first block of rows sees keys up to 75, never the last
    # block (keys 96..111). The programs scan the entries their band leaves out, so the sequence is still
    # reported, and all its rows are NaN.
    q, kc, vc, seqlens, table = paged_case(22, b=2, hq=2, hk=2, nq=nq, d=16, bs=16, dtype=torch.float32,
                                           max_len=112, lengths=[112, 112], shared=False)  # fmt: skip
    bad = table.clone()
    bad[1, column] = 10**6
    with pytest.raises(ValueError, match=rf"block_table\[1, {column}\] = 1000000 is not a block"):
        flash_attention_with_kvcache(q, kc, vc, seqlens, bad, causal=causal, window=window)
    o = flash_attention_with_kvcache(q, kc, vc, seqlens, bad, causal=causal, window=window, check_values=False)
    assert torch.isnan(o[1]).all()
    ro, _ = reference(q[:1], kc, vc, seqlens[:1], table[:1], causal, window)
    torch.testing.assert_close(o[:1].double(), ro, rtol=1e-5, atol=1e-5)


def test_entries_past_the_last_block_and_a_length_at_capacity_are_not_errors():
    q, kc, vc, seqlens, table = nan_fenced_case(23)
    table[0, 3:] = 10**6  # sequence 0 holds 40 keys: blocks 0..2; its last entry is never read
    table[2, 2:] = -9  # sequence 2 holds 20 keys: blocks 0..1
    check(q, kc, vc, seqlens, table)  # sequence 1 holds 48 = the capacity
    check(q, kc, vc, seqlens, table, causal=True, window=(5, None))


def test_a_contiguous_cache_reports_a_bad_length():
    g = torch.Generator().manual_seed(24)
    kc, vc = torch.randn(2, 2, 50, 2, 16, generator=g).unbind(0)  # (B, Nk_max, Hk, D)
    q = torch.randn(2, 2, 1, 16, generator=g)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 51 is outside \[0, 50\]"):
        flash_attention_with_kvcache(q, kc, vc, torch.tensor([51, 7], dtype=torch.int32), None)
    o = flash_attention_with_kvcache(q, kc, vc, torch.tensor([51, 7], dtype=torch.int32), None, check_values=False)
    assert torch.isnan(o[0]).all() and torch.isfinite(o[1]).all()
    check(q, kc, vc, torch.tensor([50, 7], dtype=torch.int32), None)


def test_an_error_left_in_the_record_raises_at_the_next_call():
    # What happens on a GPU, where the kernel runs after the call has returned: a launch (here the kernel's plain
    # launch, into the device's record) meets a bad entry; the next call raises it, naming it as an earlier call's,
    # and empties the record; check_kvcache_errors raises it the same way.
    import flashlab
    from flashlab.host.kvcache_errors import error_record
    from flashlab.kernels.decode import kvcache
    from flashlab.kernels.device import kernel_band

    q, kc, vc, seqlens, table = nan_fenced_case(25)
    bad = table.clone()
    bad[2, 1] = 77
    _, left, right, qk_scale, _ = kernel_band(1, 48, 16, False, None, None)
    record = error_record(q.device)
    for raise_it in ("next call", "check_kvcache_errors"):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32)
        kvcache.launch(q, kc, vc, bad, seqlens, o, lse, 16, 48, left, right, qk_scale, errors=record.tensor)
        assert torch.isnan(o[2]).all() and torch.isfinite(o[:2]).all()
        message = r"an earlier flash_attention_with_kvcache call on cpu met a bad value: block_table\[2, 1\] = 77 is"
        with pytest.raises(ValueError, match=message):
            if raise_it == "next call":
                flash_attention_with_kvcache(q, kc, vc, seqlens, table)
            else:
                flashlab.check_kvcache_errors()
        check(q, kc, vc, seqlens, table)


def test_check_values_takes_true_false_or_sync():
    q, kc, vc, seqlens, table = paged_case(26, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    for wrong in (0, 1, None, 1.0):
        with pytest.raises(TypeError, match=r'check_values must be True, False or "sync"'):
            flash_attention_with_kvcache(q, kc, vc, seqlens, table, check_values=wrong)
    for wrong in ("Sync", "device", ""):
        with pytest.raises(ValueError, match=r'check_values must be True, False or "sync"'):
            flash_attention_with_kvcache(q, kc, vc, seqlens, table, check_values=wrong)
    ref = flash_attention_with_kvcache(q, kc, vc, seqlens, table)
    for check_values in (False, "sync"):
        torch.testing.assert_close(flash_attention_with_kvcache(q, kc, vc, seqlens, table, check_values=check_values),
                                   ref, rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize("block_size, block_n", [(16, 32), (16, 64), (48, 32)])
def test_key_tiles_that_span_several_blocks(monkeypatch, block_size, block_n):
    # On a GPU key tiles are 64-128 keys, so a 16-token block is a quarter of a tile: each key finds its own block.
    # The CPU's 16-key tiles never span blocks; wider tiles here take that path on the interpreter.
    from flashlab.host import launches

    monkeypatch.setattr(launches, "CPU_CONFIG", {**launches.CPU_CONFIG, "BLOCK_N": block_n})
    q, kc, vc, seqlens, table = paged_case(
        13, b=3, hq=4, hk=2, nq=2, d=16, bs=block_size, dtype=torch.float16, max_len=150
    )
    check(q, kc, vc, seqlens, table, causal=True)
    bad = table.clone()
    bad[0, 1] = -5  # unchecked: that sequence's rows are NaN, nothing else changes
    o = flash_attention_with_kvcache(q, kc, vc, seqlens, bad, causal=True, check_values=False)
    assert torch.isnan(o[0]).all()
    torch.testing.assert_close(o[1:], flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True)[1:])


def test_remembered_signatures_still_check_values_and_arguments():
    q, kc, vc, seqlens, table = paged_case(14, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=40)
    flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True)  # this signature is now remembered
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 49 is outside \[0, 48\]"):
        flash_attention_with_kvcache(q, kc, vc, torch.tensor([49, 0], dtype=torch.int32), table, causal=True)
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=1)
    with pytest.raises(TypeError, match="scale must be a number"):
        flash_attention_with_kvcache(q, kc, vc, seqlens, table, scale=True)
