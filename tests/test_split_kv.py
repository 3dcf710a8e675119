"""The split-KV (Flash-Decoding) path of ``flash_attention`` on the CPU (Triton's interpreter) against float64.

Decode shapes (one to a few query rows, long caches, grouped-query heads) take this path on their own; forcing
``num_splits`` sends any shape through it, so masks that leave whole chunks empty for some rows are covered too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernel import check_against_reference, check_outputs, make_qkv

from flashlab.host.attention import flash_attention
from flashlab.kernels.decode import split_kv
from flashlab.kernels.decode.split_kv import MAX_SPLIT_QUERY_ROWS, MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_splits
from flashlab.kernels.device import kernel_band
from flashlab.reference import attention
from flashlab.reference.torch_float64 import attention_float64


def random_decode_case(seed):
    rng = np.random.default_rng(seed)
    hk = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 4, 8]))
    nq = int(rng.integers(1, MAX_SPLIT_QUERY_ROWS + 1))
    nk = int(rng.integers(1, 1500))
    d = int(rng.choice([16, 40, 64, 96, 128]))
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    causal = bool(rng.integers(0, 2))
    window = (int(rng.integers(0, 600)), None) if rng.random() < 0.4 else None
    return dict(b=int(rng.integers(1, 3)), hq=hk * group, hk=hk, nq=nq, nk=nk, d=d, dtype=dtype), causal, window


@pytest.mark.parametrize("seed", range(18))
def test_random_decode_shapes_match_reference(seed):
    shape, causal, window = random_decode_case(seed)
    q, k, v = make_qkv(**shape, seed=100 + seed)
    check_against_reference(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize(
    "causal, window",
    [(False, None), (True, None), (True, (100, None)), (False, (60, 30))],
)
def test_forced_splits_at_any_length(causal, window):
    # 40 queries x 3 heads per K/V head = 120 packed rows: two row blocks of 64, the first shared by two heads.
    # Chunks of 128 keys: the masks leave some rows with no visible key in some chunks (lse -inf, weight 0).
    # The unsplit (prefill) result is checked against float64 once; each forced split against float64 and it.
    q, k, v = make_qkv(1, 6, 2, 40, 300, 32, torch.float32, seed=1)
    o, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    check_outputs(q, k, v, o, lse, causal=causal, window=window)
    for num_splits in (1, 3):
        kw = dict(causal=causal, window=window, num_splits=num_splits)
        o_split, lse_split = flash_attention(q, k, v, return_lse=True, **kw)
        check_outputs(q, k, v, o_split, lse_split, causal=causal, window=window)
        torch.testing.assert_close(o_split, o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_splits, causal, window", [(8, False, None), (9, True, (700, None)), (17, False, (400, 300)), (23, True, None)]
)
def test_merge_tree_over_several_groups_matches_reference(num_splits, causal, window):
    # More chunks than one merge group (split_kv.TREE_GROUP): the groups merge, then the last group merges
    # the groups; a group whose chunks the window hides entirely carries lse -inf and weighs nothing.
    assert num_splits >= split_kv.TREE_GROUP
    nk = num_splits * split_kv.KEY_ALIGN - 50  # the last chunk is short
    q, k, v = make_qkv(1, 4, 2, 2, nk, 16, torch.float32, seed=num_splits)
    args = split_kv.SplitArguments(q, k, v, q, *kernel_band(2, nk, 16, causal, window, None)[:4], num_splits)
    assert args.num_splits == num_splits and args.meta["MERGE_HERE"]
    o, lse = flash_attention(q, k, v, causal=causal, window=window, num_splits=num_splits, return_lse=True)
    ro, rl = attention_float64(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype_over_many_chunks(dtype):
    # the CPU path's three chunks of 384 keys; the window hides the first chunk whole and part of the second
    q, k, v = make_qkv(2, 8, 2, 1, 1000, 64, dtype, seed=3)
    check_against_reference(q, k, v)
    check_against_reference(q, k, v, window=(350, None), causal=True)


def test_rows_that_see_no_key_give_zeros_and_minus_inf():
    # causal with Nq > Nk: the first 7 of 12 queries see no key at all
    q, k, v = make_qkv(1, 4, 2, 12, 5, 16, torch.float32, seed=4)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.isneginf(lse[..., :7]).all() and (o[..., :7, :] == 0).all()
    check_against_reference(q, k, v, causal=True)


def test_hidden_chunks_do_not_change_the_output():
    # one decode query with a 100-key window over a 3000-key cache: NaN in the keys it cannot see changes nothing
    q, k, v = make_qkv(1, 4, 1, 1, 3000, 32, torch.float32, seed=5)
    ref = flash_attention(q, k, v, causal=True, window=(100, None))
    k[:, :, :2880], v[:, :, :2880] = float("nan"), float("nan")
    o = flash_attention(q, k, v, causal=True, window=(100, None), num_splits=4)
    torch.testing.assert_close(o, ref, rtol=1e-6, atol=1e-6)


def test_non_contiguous_decode_inputs():
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(1, 900, 2, 2, 48, generator=g)  # (B, N, 2, Hk, D): a KV cache stored token-major
    k, v = (kv[:, :, i].transpose(1, 2) for i in range(2))
    q = torch.randn(1, 1, 8, 48, generator=g).transpose(1, 2)  # (B, Hq=8, 1, D) view
    assert not k.is_contiguous()
    check_against_reference(q, k, v, causal=True)


def test_gqa_decode_equals_repeated_heads():
    q, k, v = make_qkv(1, 8, 2, 1, 700, 64, torch.float32, seed=7)
    o = flash_attention(q, k, v)
    o_rep = flash_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1))
    torch.testing.assert_close(o, o_rep, rtol=1e-6, atol=1e-6)


def test_choose_splits():
    # H200: 132 SMs, three programs each = 396 slots, filled once (rounded down), chunks of >= 128 keys
    assert choose_splits(units=8, band_keys=131072, sm_count=132) == 49  # 396 // 8
    assert choose_splits(units=64, band_keys=4096, sm_count=132) == 6  # 396 // 64: 384 programs, not 448
    assert choose_splits(units=200, band_keys=4096, sm_count=132) == 1  # 396 // 200: a second chunk would spill
    assert choose_splits(units=1, band_keys=1000, sm_count=132) == 8  # ceil(1000 / 128): chunks >= 128 keys
    assert choose_splits(units=1, band_keys=10**7, sm_count=1000) == MAX_SPLITS
    assert choose_splits(units=512, band_keys=10**6, sm_count=132) == 1  # more programs than slots already
    assert choose_splits(units=1, band_keys=MIN_KEYS_PER_SPLIT, sm_count=132) == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        choose_splits(units=0, band_keys=10, sm_count=132)
    # a kernel whose registers allow two programs an SM (the paged tree with 16-token blocks): 264 slots
    assert choose_splits(units=8, band_keys=131072, sm_count=132, programs_per_sm=2) == 33  # 264 // 8
    assert choose_splits(units=8, band_keys=4096, sm_count=132, programs_per_sm=2) == 32  # 4096 / 128 keys
    with pytest.raises(ValueError, match="programs_per_sm must be >= 1"):
        choose_splits(units=8, band_keys=10, sm_count=132, programs_per_sm=0)


@pytest.mark.parametrize("b, hq, hk, nq, causal", [(1, 4, 2, 1, False), (1, 8, 8, 1, True), (3, 6, 2, 3, True),
                                                   (64, 16, 8, 1, False)])  # fmt: skip
def test_a_growing_caches_chunks_are_the_ones_split_arguments_chooses(b, hq, hk, nq, causal):
    """``unwindowed_chunks``, the chunking a growing cache's step works out from two integers, against the general
    rule (every band, every window) for lengths around every chunk and alignment boundary; the last case has more
    programs than the chip wants split, so its chunk count is capped at one."""
    q = torch.zeros(b, hq, nq, 16)
    o = torch.empty_like(q)
    lengths = sorted({n for m in (1, 2, 64, 127, 128, 129, 256, 1000, 4096, 40000) for n in (m - 1, m, m + 1)} - {0})
    for nk in lengths:
        if causal and nk < nq:
            continue
        k = torch.empty(b, hk, nk, 16)  # shapes and strides only: up to 1.3 GB, never written or read
        band = kernel_band(nq, nk, 16, causal, None, None)[:4]
        general = split_kv.SplitArguments(q, k, k, o, *band, None)
        chunks = split_kv.unwindowed_chunks(nk, general.fixed[1])
        assert chunks == (general.num_splits, general.scalars[-3]), nk  # (chunks, keys per chunk)


def test_bad_num_splits_raise_clear_errors():
    q, k, v = make_qkv(1, 2, 1, 1, 50, 16, torch.float32, seed=8)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attention(q, k, v, num_splits=2.0)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attention(q, k, v, num_splits=True)
    with pytest.raises(ValueError, match="between 1 and min"):
        flash_attention(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="between 1 and min"):
        flash_attention(q, k, v, num_splits=51)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "nq, causal, window, num_splits", [(4, True, None, 2), (3, False, (20, 0), 3), (1, False, (30, 0), None)]
)
def test_inf_and_nan_in_hidden_v_rows_do_not_reach_rows_that_cannot_see_them(dtype, nq, causal, window, num_splits):
    # every tile of the split-KV kernel has an element mask: a hidden key gets p = 0, and 0 * inf inside a plain
    # P @ V would be NaN for every row of the tile. Rows that cannot see the bad keys equal the clean result.
    nk = 150
    q, k, v = make_qkv(1, 4, 2, nq, nk, 32, dtype, seed=31)
    kw = dict(causal=causal, window=window, num_splits=num_splits)
    o_clean = flash_attention(q, k, v, **kw).double().numpy()
    v_bad = v.clone()
    if window is not None:  # key 115: left of every row's window, but in the 16-key tile [112, 128) that is loaded
        v_bad[0, :, 115, 1] = float("-inf")
        np.testing.assert_array_equal(flash_attention(q, k, v_bad, **kw).double().numpy(), o_clean)
    v_bad[0, :, nk - 1] = float("nan")  # past the diagonal / right edge of the first rows
    v_bad[0, :, nk - 2, 3] = float("inf")
    o = flash_attention(q, k, v_bad, **kw).double().numpy()
    ref, _ = attention(q.double().numpy(), k.double().numpy(), v_bad.double().numpy(), causal=causal, window=window)
    clean_rows = np.isfinite(ref).all(axis=-1)  # (B, Hq, Nq) rows that see no bad value
    np.testing.assert_array_equal(np.isfinite(o).all(axis=-1), clean_rows)  # the others are not finite
    assert clean_rows.any() or nq == 1
    np.testing.assert_array_equal(o[clean_rows], o_clean[clean_rows])
