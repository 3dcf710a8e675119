"""Plans shared by a bucket of shapes: a new length is a new call, not a new plan, a new binary or a tuning run.

A decode loop over a growing cache and chunked prefill with a new (Nq, Nk) every call meet a new signature every
step. Each signature gets its own ``flashlab.host.plan.Call`` (its runtime scalars and grid, after every argument
check), and the plan of its bucket (``PLANS``), shared by every length that compiles to the same binary with the
same tiles. These tests check the sharing (the same plan object), that a new bucket gets a new plan, that every
output still equals the float64 reference, that the kernels' lengths never change what Triton specialises on,
and the packing of the runtime values the direct launch passes (``flashlab.host.direct_launch``). The GPU test at
the end checks the compiled binaries and the direct launch on a GPU.
"""

from __future__ import annotations

import struct

import pytest
import torch
from test_kernel import check_against_reference, make_qkv

from flashlab import flash_attention
from flashlab.host import attention as forward
from flashlab.host import direct_launch, launches
from flashlab.host.plan import CALLS, CHECKED, int_class, mask_kind
from flashlab.kernels.decode import split_kv
from flashlab.kernels.ladder import rung2_skip_split as skip_split


def call_of(q, k, v, causal=False, window=None, scale=None, num_splits=None, rung=None):
    """The call the latest ``flash_attention`` of these arguments was planned into: kept in ``CALLS``, or, for a
    signature its family has met only once, the family's latest."""
    key = forward.signature(q, k, v, causal, window, scale, num_splits, rung)
    if key in CALLS:
        return CALLS[key]
    return forward.FAMILIES[forward.plan_family_key(key, q, k, v)].last


def decode_step(n, seed, hq=4, hk=2, d=16, dtype=torch.float32, cache=None):
    """q of one row against the first n keys of a cache (B = 1), as a decode loop slices its growing cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, 1, d, generator=g).to(dtype)
    if cache is None:
        k, v = make_qkv(1, hq, hk, 1, n, d, dtype, seed)[1:]
        return q, k, v
    k, v = cache
    return q, k[:, :, :n], v[:, :, :n]


def test_two_lengths_of_one_bucket_share_a_plan_and_both_match_the_reference():
    cache = make_qkv(1, 4, 2, 1, 400, 16, torch.float32, seed=1)[1:]
    q, k, v = decode_step(301, 2, cache=cache)
    check_against_reference(q, k, v)
    q2, k2, v2 = decode_step(333, 3, cache=cache)
    check_against_reference(q2, k2, v2)
    first, second = call_of(q, k, v), call_of(q2, k2, v2)
    assert first is not second  # two signatures, two sets of runtime scalars ...
    assert first.plan is second.plan  # ... one plan: the same compiled kernel, the same direct launch
    assert first.plan.path == launches.SPLIT_KV
    assert first.values != second.values and first.args.num_splits == second.args.num_splits == 3


def test_a_length_in_another_bucket_gets_another_plan():
    q, k, v = decode_step(300, 4)
    check_against_reference(q, k, v)
    q2, k2, v2 = decode_step(100, 5)  # one chunk: the kernel writes o itself (DIRECT), another binary
    check_against_reference(q2, k2, v2)
    assert call_of(q2, k2, v2).args.direct and not call_of(q, k, v).args.direct
    assert call_of(q, k, v).plan is not call_of(q2, k2, v2).plan
    q3, k3, v3 = make_qkv(1, 4, 4, 1, 300, 16, torch.float32, seed=6)  # another GQA group: another plan
    check_against_reference(q3, k3, v3)
    assert call_of(q3, k3, v3).plan is not call_of(q, k, v).plan


def test_a_growing_decode_loop_makes_at_most_a_couple_of_plans():
    # a cache that grows one token a step, read through slices of one buffer, and through fresh contiguous tensors
    cache = make_qkv(1, 4, 2, 1, 300, 16, torch.float32, seed=7)[1:]
    sliced, fresh = set(), set()
    for step, n in enumerate(range(250, 260)):
        q, k, v = decode_step(n, 100 + step, cache=cache)
        check_against_reference(q, k, v, causal=True)
        sliced.add(id(call_of(q, k, v, causal=True).plan))
        q, k, v = decode_step(n, 200 + step)  # contiguous: the head stride n * D changes every step
        check_against_reference(q, k, v, causal=True)
        fresh.add(id(call_of(q, k, v, causal=True).plan))
    assert len(sliced) <= 2 and len(fresh) <= 2, (len(sliced), len(fresh))


def test_chunked_prefill_with_new_lengths_every_call_shares_a_plan():
    plans = set()
    for step, (nq, nk) in enumerate([(17, 40), (24, 53), (31, 66), (38, 79), (45, 92), (52, 105)]):
        q, k, v = make_qkv(1, 4, 2, nq, nk, 16, torch.float32, seed=300 + step)
        check_against_reference(q, k, v, causal=True)
        call = call_of(q, k, v, causal=True)
        assert call.plan.path == skip_split.NAME
        plans.add(id(call.plan))
    assert len(plans) <= 2, len(plans)


@pytest.mark.parametrize("seed", range(6))
def test_bucketed_plans_still_match_the_reference_on_random_shapes(seed):
    # odd lengths, GQA, negative scales, strided inputs, causal and window masks: two shapes of one kind share a
    # plan and both match the float64 reference
    g = torch.Generator().manual_seed(seed)
    hk = int(torch.randint(1, 3, (1,), generator=g))
    hq = hk * int(torch.randint(1, 4, (1,), generator=g))
    d = [16, 24, 32][seed % 3]
    causal = seed % 2 == 0
    window = [None, (7, None), (5, 3)][seed % 3]
    scale = [None, -0.4, 0.3][(seed + 1) % 3]
    prefill = seed % 2 == 1
    seen = set()
    for turn in range(2):
        nq = int(torch.randint(17, 40, (1,), generator=g)) if prefill else 1 + turn
        nk = int(torch.randint(60, 200, (1,), generator=g)) | 1  # odd
        q, k, v = make_qkv(1, hq, hk, nq, nk, d, torch.float32, seed=1000 * seed + turn)
        if seed % 3 == 1:  # strided: q's rows two apart, k and v heads transposed out of a larger buffer
            q = torch.cat([q, q], dim=2)[:, :, ::2]
            k = k.transpose(1, 2).contiguous().transpose(1, 2)
        check_against_reference(q, k, v, causal=causal, window=window, scale=scale)
        seen.add(mask_kind(causal, window))
        call = call_of(q, k, v, causal, window, scale)
        assert call.plan.path in (launches.SPLIT_KV, skip_split.NAME)
    assert len(seen) == 1


def test_the_kernels_lengths_are_runtime_values():
    # what Triton specialises a launch on (its binder's specialisation) must not change with the lengths of one
    # bucket: every length, offset and band parameter is do_not_specialize, and the strides' classes are in the key
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    for kernel, lengths in ((split_kv.split_kv_partial, split_kv.RUNTIME_LENGTHS),
                            (skip_split.attn_fwd, skip_split.RUNTIME_LENGTHS)):  # fmt: skip
        flagged = {p.name for p in kernel.params if p.do_not_specialize}
        assert set(lengths) <= flagged, set(lengths) - flagged
        unaligned = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        assert set(lengths) <= unaligned, set(lengths) - unaligned  # some Tritons key "divisible by 16" on it
        for name in ("NQ", "NK", "offset", "win_left", "win_right"):
            assert name in flagged
    binder = create_function_from_signature(split_kv.split_kv_partial.signature, split_kv.split_kv_partial.params,
                                            BaseBackend)  # fmt: skip
    cache = make_qkv(1, 4, 2, 1, 4200, 16, torch.float32, seed=8)[1:]
    specs = []
    for n in (4001, 4016, 4097):  # odd, divisible by 16, past a power of two: the same specialisation
        q, k, v = decode_step(n, n, cache=cache)
        call = launches.attention_call(q, k, v, False, None, None, None, None)
        o = torch.empty_like(q)
        tensors = (q, k, v, o, torch.empty(64), o, torch.empty(4), torch.zeros(4, dtype=torch.int32))
        _, spec, _ = binder(*tensors, *call.values, **call.args.meta, BLOCK_N=64)
        specs.append(spec)
    assert specs[0] == specs[1] == specs[2]


def test_the_runtime_values_follow_each_kernels_signature():
    # a direct launch passes each call's values in the order it was built with: the names must be the kernels'
    # scalar parameters, in order, and the calls' value tuples as long
    names = split_kv.split_kv_partial.arg_names
    assert split_kv.SCALAR_PARAMETERS == tuple(names[len(split_kv.PARTIAL_TENSORS) : names.index("HEAD_DIM")])
    q, k, v = decode_step(500, 9)
    assert len(launches.attention_call(q, k, v, False, None, None, None, None).values) == len(
        split_kv.SCALAR_PARAMETERS
    )
    q, k, v = make_qkv(1, 4, 2, 40, 90, 16, torch.float32, seed=10)
    call = launches.attention_call(q, k, v, True, None, None, None, "skip_split")
    assert len(call.values) == len(skip_split.SCALAR_PARAMETERS)
    # the head dim is the last runtime value: head dims of one padded width share the binary, not the values
    assert skip_split.SCALAR_PARAMETERS[0] == "stride_qb" and skip_split.SCALAR_PARAMETERS[-1] == "HEAD_DIM"
    assert call.values[-1] == 16
    from flashlab.kernels.ladder import rung4_overlap as overlap

    if overlap.attn_fwd_overlap is not None:  # rung 4: four tensor maps, then its scalars as launch_shape gives them
        names = overlap.attn_fwd_overlap.arg_names
        assert launches.OVERLAP_RUNTIME[:4] == overlap.DESCRIBED_TENSORS[:4]
        assert overlap.DESCRIBED_TENSORS == tuple(names[: len(overlap.DESCRIBED_TENSORS)])  # the tensors come first
        scalars = names[len(overlap.DESCRIBED_TENSORS) : names.index("HEAD_DIM")]
        assert launches.OVERLAP_RUNTIME[4:] == tuple(scalars)
        assert set(overlap.RUNTIME_LENGTHS) <= {p.name for p in overlap.attn_fwd_overlap.params if p.do_not_specialize}


def test_a_strides_class_is_what_triton_specialises_on():
    assert int_class(1) != int_class(3) != int_class(32)
    assert int_class(48) == int_class(4096) and int_class(7) == int_class(4001)
    assert int_class(2**31 + 16) != int_class(32)  # 64 bits: another binary


# ----------------------------------------------------------------------------------------------------------------
# The direct launch's runtime values, packed in Python and read back from the C launcher (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------


def test_runtime_scalars_are_packed_into_their_cells_on_every_launch():
    types = ["*fp32", "i32", "fp32", "i64", "*fp32", "i32"]
    values = [None, 7, 0.5, 2**33, None, 9]
    packed = direct_launch.pack_runtime(types, values, (0, 4), (5, 1, 2, 3))
    assert packed is not None
    cells, sizes, slots, entries = packed
    assert entries == ((direct_launch.RT_I32, 5, 0), (direct_launch.RT_I32, 1, 0), (direct_launch.RT_F32, 2, 0),
                       (direct_launch.RT_I64, 3, 0))  # fmt: skip
    assert direct_launch.pack(types, values, (0, 4)) == packed[:3]  # the same block without runtime values
    module = direct_launch.native()
    if module is None:
        pytest.skip("no C compiler here for flashlab's launcher")
    handle = module.make(0, 1, 1, 1, 128, 0, cells, sizes, slots, 0, entries)
    a, b = torch.zeros(4), torch.zeros(4)
    block = module.packed_with(handle, (11, -3, 0.25, -(2**40)), a, b)
    cell = [block[8 * i : 8 * i + 8] for i in range(len(types))]
    assert cell[0] == struct.pack("<Q", a.data_ptr()) and cell[4] == struct.pack("<Q", b.data_ptr())
    assert cell[5][:4] == struct.pack("<i", 11) and cell[1][:4] == struct.pack("<i", -3)
    assert cell[2][:4] == struct.pack("<f", 0.25) and cell[3] == struct.pack("<q", -(2**40))
    assert module.packed(handle, a, b)[8:12] == struct.pack("<i", 7)  # launch() keeps the packed values
    with pytest.raises(OverflowError, match="int32"):
        module.packed_with(handle, (2**31, 0, 0.0, 0), a, b)
    with pytest.raises(TypeError, match="4 runtime values"):
        module.packed_with(handle, (1, 2, 0.5), a, b)
    with pytest.raises(ValueError, match="runtime value 0"):  # a pointer is no runtime scalar
        module.make(0, 1, 1, 1, 128, 0, cells, sizes, slots, 0, ((direct_launch.RT_I64, 0, 0),))
    with pytest.raises(ValueError, match="runtime value 0"):  # an i32 cell written as 8 bytes
        module.make(0, 1, 1, 1, 128, 0, cells, sizes, slots, 0, ((direct_launch.RT_I64, 1, 0),))


def test_pack_runtime_refuses_what_it_cannot_write():
    assert direct_launch.pack_runtime(["*fp32", "i32"], [None, 1], (0,), (0,)) is None  # a pointer
    assert direct_launch.pack_runtime(["*fp32", "i16"], [None, 1], (0,), (1,)) is None  # an i16
    assert direct_launch.pack_runtime(["*fp32", "constexpr"], [None, 1], (0,), (1,)) is None  # a constexpr


def test_a_tensor_maps_dims_and_cells_are_runtime_values():
    from types import SimpleNamespace

    pytest.importorskip("triton.backends.nvidia.driver")
    meta = [{"elem_size": 2, "elem_type": 9, "block_size": [1, 1, 64, 128], "swizzle": 3}]  # 9: Triton's bf16
    desc = SimpleNamespace(shape=[2, 8, 1000, 128], strides=[8 * 1000 * 128, 1000 * 128, 128, 1])
    types = ["i32", "tensordesc<bf16[1, 1, 64, 128]>", "*fp32"]
    packed = direct_launch.pack_runtime(types, [5, desc, None], (1, 2), (1, 0), tensordesc_meta=meta)
    assert packed is not None
    cells, sizes, slots, entries = packed
    rank = 4
    assert len(entries) == rank + (rank - 1) + 2 * rank + 1
    assert entries[0] == (direct_launch.RT_MAP_DIM, 0, 0) and entries[rank] == (direct_launch.RT_MAP_STRIDE, 0, 0)
    assert entries[2 * rank - 1] == (direct_launch.RT_I32, 2, 0)  # the shape cells follow the map (parameter 1)
    assert entries[-1] == (direct_launch.RT_I32, 0, 0)  # then the scalar named after it
    module = direct_launch.native()
    if module is None:
        pytest.skip("no C compiler here for flashlab's launcher")
    handle = module.make(0, 1, 1, 1, 128, 0, cells, sizes, slots, 0, entries)
    shape, strides = (2, 8, 1700, 128), (8 * 1700 * 128, 1700 * 128, 128, 1)
    values = (*direct_launch.map_values(shape, strides, 2), 6)
    assert values[:rank] == (128, 1700, 8, 2) and values[rank : 2 * rank - 1] == (256, 1700 * 256, 8 * 1700 * 256)
    maps = module.map_dims_with(handle, values)
    assert maps[0] == ((128, 1700, 8, 2), (256, 1700 * 256, 8 * 1700 * 256)) and maps[1] is None
    with pytest.raises(TypeError, match="runtime values"):
        module.map_dims_with(handle, values[:-1])


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: one binary per bucket, the direct launch checked after the second call of a bucket
# ----------------------------------------------------------------------------------------------------------------


def binaries(kernel, device) -> int:
    """How many binaries Triton has compiled of ``kernel`` on that device."""
    return sum(len(cache[0]) for d, cache in kernel.device_caches.items() if d == device)


@pytest.mark.gpu
def test_growing_decode_and_changing_prefill_compile_once_per_bucket_on_gpu():
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.cuda.current_device()
    k_all, v_all = (torch.randn(1, 8, 4300, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    counts = []
    for step, n in enumerate(range(4001, 4041)):  # one bucket: many chunks, one config
        q = torch.randn(1, 32, 1, 128, device="cuda", generator=g).bfloat16()
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        o = flash_attention(q, k, v)
        ro, _ = attention_float64(q, k, v)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (n, err)
        call = call_of(q, k, v)
        if step >= 1:
            assert call.plan.state == CHECKED, (n, call.plan.state)  # direct from the bucket's second call on
        counts.append(binaries(split_kv.split_kv_partial, dev))
    assert len(set(counts)) == 1, counts  # no length compiled another binary
    counts, plan = [], None
    for step, (nq, nk) in enumerate(zip(range(300, 370, 7), range(4000, 4130, 13), strict=False)):
        q = torch.randn(1, 16, nq, 128, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(1, 16, nk, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
        o = flash_attention(q, k, v, causal=True, rung="skip_split")
        ro, _ = attention_float64(q, k, v, causal=True)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (nq, nk, err)
        call = call_of(q, k, v, causal=True, rung="skip_split")
        plan = plan or call.plan
        assert call.plan is plan
        if step >= 1:
            assert plan.state == CHECKED, (nq, nk, plan.state)
        counts.append(binaries(skip_split.attn_fwd, dev))
    assert len(set(counts)) == 1, counts


@pytest.mark.gpu
def test_chunked_prefill_on_the_overlap_rung_compiles_once_per_bucket_on_gpu():
    from flashlab.kernels.ladder import rung4_overlap as overlap
    from flashlab.reference.torch_float64 import attention_float64

    if torch.cuda.get_device_capability()[0] != overlap.CAPABILITY or overlap.GLUON_ERROR is not None:
        pytest.skip("rung 4 needs Hopper (sm_90) and Gluon")
    g = torch.Generator(device="cuda").manual_seed(1)
    dev = torch.cuda.current_device()
    counts, plan = [], None
    for step, (nq, nk) in enumerate(zip(range(300, 370, 7), range(4000, 4130, 13), strict=False)):
        q = torch.randn(1, 16, nq, 128, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(1, 16, nk, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
        o = flash_attention(q, k, v, causal=True)  # the default rung on Hopper
        ro, _ = attention_float64(q, k, v, causal=True)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (nq, nk, err)
        call = call_of(q, k, v, causal=True)
        assert call.plan.path == overlap.NAME
        plan = plan or call.plan
        assert call.plan is plan
        if step >= 1:
            assert plan.state == CHECKED, (nq, nk, plan.state)
        counts.append(binaries(overlap.attn_fwd_overlap, dev))
    assert len(set(counts)) == 1, counts


# ----------------------------------------------------------------------------------------------------------------
# Families: a new length of a known signature, made from integers alone, equals the full path's call
# ----------------------------------------------------------------------------------------------------------------


def full_call(q, k, v, causal=False, window=None, scale=None, num_splits=None):
    """The call the full path (every check, every decision) makes for these arguments, kept nowhere."""
    return forward.checked_call(q, k, v, causal, window, scale, num_splits, None)


def assert_same_call(derived, full):
    assert derived.plan is full.plan  # the same bucket, so the same compiled kernel and direct launch
    assert derived.values == full.values and derived.grid == full.grid
    assert (derived.o_shape, derived.lse_shape, derived.o_like_q) == (full.o_shape, full.lse_shape, full.o_like_q)
    a, b = derived.args, full.args
    assert (a.num_splits, a.parts, a.rows, a.counters, a.meta) == (b.num_splits, b.parts, b.rows, b.counters, b.meta)


@pytest.mark.parametrize(
    "causal, window, hq, hk, num_splits",
    [(False, None, 8, 2, None), (True, None, 4, 4, None), (False, (37, 0), 6, 2, None), (True, (5, None), 4, 1, None),
     (False, None, 4, 2, 3)],
)  # fmt: skip
def test_a_family_makes_each_new_length_as_the_full_path_would(causal, window, hq, hk, num_splits):
    """Lengths from 1 key (one chunk) past several length buckets, through the family and through the full path:
    the same plan, scalars, grid and scratch every time. The calls are only planned here, never launched."""
    forward.FAMILIES.clear()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, hq, 1, 64, generator=g)
    kb, vb = torch.randn(2, 1, hk, 5000, 64, generator=g).unbind(0)
    lengths = [4, 5, 127, 128, 129, 1000, 1023, 1024, 1025, 2047, 4999] if num_splits else [
        1, 2, 17, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 4999]  # fmt: skip
    first = True
    for n in lengths:
        k, v = kb[:, :, :n], vb[:, :, :n]
        key = forward.signature(q, k, v, causal, window, None, num_splits, None)
        derived = forward.new_call(key, q, k, v, causal, window, None, num_splits, None)
        family = forward.FAMILIES.get(forward.plan_family_key(key, q, k, v))
        assert family is not None, "a split-KV call starts a family"
        assert first or family.last is derived, "every length after the first came from the family"
        first = False
        assert_same_call(derived, full_call(q, k, v, causal, window, None, num_splits))


@pytest.mark.parametrize("causal, b, hq, hk", [(False, 1, 8, 2), (True, 2, 4, 4)])
def test_a_growing_cache_step_by_step_makes_each_call_as_the_full_path_would(causal, b, hq, hk):
    """One key more every step, across chunk-count and length-bucket boundaries: a step whose chunk count and
    length bucket the family has met shares that slot's plan and arguments, and still equals the full path's call
    (plan, runtime values, grid, scratch)."""
    forward.FAMILIES.clear()
    g = torch.Generator().manual_seed(17)
    q = torch.randn(b, hq, 1, 32, generator=g)
    kb, vb = torch.randn(2, b, hk, 1100, 32, generator=g).unbind(0)
    runs = [range(120, 140), range(250, 262), range(380, 390), range(1020, 1030)]
    key = forward.signature(q, kb[:, :, :100], vb[:, :, :100], causal, None, None, None, None)
    forward.new_call(key, q, kb[:, :, :100], vb[:, :, :100], causal, None, None, None, None)  # starts the family
    shared = 0
    for run in runs:
        previous = None
        for n in run:
            k, v = kb[:, :, :n], vb[:, :, :n]
            key = forward.signature(q, k, v, causal, None, None, None, None)
            derived = forward.new_call(key, q, k, v, causal, None, None, None, None)
            full = full_call(q, k, v, causal)
            assert_same_call(derived, full)
            same_slot = previous is not None and (previous.args.num_splits, previous.args.tune[0]) == (
                full.args.num_splits, full.args.tune[0])  # fmt: skip
            if same_slot:
                assert derived.args is previous.args, f"step {n} did not take its slot's arguments"
                shared += 1
            previous = derived
    assert shared > sum(len(r) for r in runs) // 2


def test_a_cache_grown_by_concatenation_keeps_one_family():
    """A contiguous cache of a new length has new strides: its family key holds None in their place."""
    forward.FAMILIES.clear()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 1, 32, generator=g)
    k = torch.randn(2, 2, 300, 32, generator=g)
    for _ in range(3):
        k = torch.cat([k, torch.randn(2, 2, 1, 32, generator=g)], dim=2)
        key = forward.signature(q, k, k, False, None, None, None, None)
        derived = forward.new_call(key, q, k, k, False, None, None, None, None)
        assert_same_call(derived, full_call(q, k, k))
    assert len(forward.FAMILIES) == 1


def test_a_bad_length_in_a_family_still_gets_the_full_paths_error():
    """The family covers only what it can make from integers; the rest goes through the checks, which name it."""
    forward.FAMILIES.clear()
    q, k, v = decode_step(200, 9)
    flash_attention(q, k, v, num_splits=4)
    q2, k2, v2 = decode_step(203, 9)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attention(q2, k2[:, :, :3], v2[:, :, :3], num_splits=4)  # fewer keys than chunks
    with pytest.raises(ValueError):
        flash_attention(q2, k2, v2[:, :, :100], num_splits=4)  # k and v of different lengths


def test_a_growing_cache_through_its_family_matches_the_reference():
    """The launched answers, step after step, from calls the family made."""
    forward.FAMILIES.clear()
    cache = make_qkv(1, 4, 2, 1, 330, 16, torch.float32, seed=10)[1:]
    for n in (300, 301, 302, 329):
        q, k, v = decode_step(n, 11, cache=cache)
        check_against_reference(q, k, v)
    key = forward.signature(q, k, v, False, None, None, None, None)
    assert forward.FAMILIES[forward.plan_family_key(key, q, k, v)].last is call_of(q, k, v)


def test_a_growing_loop_keeps_no_call_per_step_and_a_repeated_length_is_kept():
    """Each step of a growing cache is a signature met once: its call is made by the family and not kept (a call
    kept per step outlives Python's young generations, and the full collections that follow cost every step). A
    signature met a second time is kept, and its later calls are looked up."""
    forward.FAMILIES.clear()
    CALLS.clear()
    cache = make_qkv(1, 4, 2, 1, 340, 16, torch.float32, seed=14)[1:]
    q, k, v = decode_step(300, 15, cache=cache)
    flash_attention(q, k, v)
    kept = len(CALLS)
    for n in range(301, 311):
        q, k, v = decode_step(n, 15, cache=cache)
        flash_attention(q, k, v)
    assert len(CALLS) == kept, "no call kept for a length met once"
    key = forward.signature(q, k, v, False, None, None, None, None)
    flash_attention(q, k, v)  # n = 310 again: its second meeting
    assert CALLS[key] is forward.FAMILIES[forward.plan_family_key(key, q, k, v)].last
    check_against_reference(q, k, v)


def same_args(a, b) -> bool:
    """Two calls' ``args`` agree: equal values, tensors (a schedule table) equal element for element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_args(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_prefill_call(derived, full):
    if full.path == launches.SPLIT_KV:  # a decode-sized chunk
        assert_same_call(derived, full)
        return
    assert derived.plan is full.plan
    assert derived.values == full.values and derived.grid == full.grid and same_args(derived.args, full.args)
    assert (derived.o_shape, derived.lse_shape, derived.o_like_q) == (full.o_shape, full.lse_shape, full.o_like_q)
    assert (derived.copy, derived.negate, derived.note) == (full.copy, full.negate, full.note)


def prefill_shapes_through_family(q_buf, k_buf, v_buf, shapes, causal, window, contiguous_q=False):
    """Each (nq, nk) through ``new_call`` (the family after the first) and through the full path: the same call.
    Returns how many came from a family."""
    forward.FAMILIES.clear()
    from_family = 0
    for nq, nk in shapes:
        q = q_buf[:, :, :nq].contiguous() if contiguous_q else q_buf[:, :, :nq]
        k, v = k_buf[:, :, :nk], v_buf[:, :, :nk]
        key = forward.signature(q, k, v, causal, window, None, None, None)
        family = forward.FAMILIES.get(forward.plan_family_key(key, q, k, v))
        derived = forward.new_call(key, q, k, v, causal, window, None, None, None)
        from_family += family is not None and family.call(q, k, v) is not None
        assert_same_prefill_call(derived, forward.checked_call(q, k, v, causal, window, None, None, None))
    return from_family


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (40, 3))])
@pytest.mark.parametrize("contiguous_q", [False, True])
def test_a_prefill_family_makes_each_new_shape_as_the_full_path_would(causal, window, contiguous_q):
    """Chunked prefill on the interpreter's rung (skip-and-split): every (Nq, Nk) after the first comes from the
    family, equal to the full path's call; a decode-sized chunk (split-KV) leaves the family and is planned anew."""
    g = torch.Generator().manual_seed(12)
    q_buf = torch.randn(1, 4, 200, 32, generator=g)
    k_buf, v_buf = torch.randn(2, 1, 2, 400, 32, generator=g).unbind(0)
    shapes = [(65, 100), (70, 133), (128, 128), (129, 300), (199, 399), (100, 250)]
    assert prefill_shapes_through_family(q_buf, k_buf, v_buf, shapes, causal, window, contiguous_q) == 5
    # a chunk of decode's size takes split-KV: not the family's rung, so the full path plans it
    shapes = [(100, 250), (8, 250), (120, 260)]
    assert prefill_shapes_through_family(q_buf, k_buf, v_buf, shapes, causal, window, contiguous_q) == 0


def test_a_prefill_family_sends_bad_lengths_to_the_full_checks():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 100, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 120, 16, generator=g).unbind(0)
    forward.FAMILIES.clear()
    flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError):
        flash_attention(q[:, :, :90], k, v[:, :, :110], causal=True)  # k and v of different lengths
    o = flash_attention(q[:, :, :90], k[:, :, :95], v[:, :, :95], causal=True)  # then a good one, still right
    check_against_reference(q[:, :, :90], k[:, :, :95], v[:, :, :95], causal=True)
    assert o.shape == (1, 2, 90, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (256, 0))])
def test_an_overlap_family_makes_each_new_shape_as_the_full_path_would_on_gpu(causal, window):
    """Rung 4 on Hopper: chunked prefill's new (Nq, Nk) pairs from the family equal the full path's calls (plan,
    scalars, tensor maps, schedule table, repair pass), and their answers equal the float64 reference."""
    from flashlab.kernels.ladder import rung4_overlap as overlap
    from flashlab.reference.torch_float64 import attention_float64

    if torch.cuda.get_device_capability()[0] != overlap.CAPABILITY or overlap.GLUON_ERROR is not None:
        pytest.skip("rung 4 needs Hopper (sm_90) and Gluon")
    g = torch.Generator(device="cuda").manual_seed(14)
    q_buf = torch.randn(1, 16, 1100, 128, device="cuda", generator=g).bfloat16()
    k_buf, v_buf = (torch.randn(1, 16, 5400, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    shapes = [(300 + 7 * i, 4000 + 13 * ((i * 37) % 100)) for i in range(0, 100, 9)] + [(1099, 1100), (65, 4000)]
    assert prefill_shapes_through_family(q_buf, k_buf, v_buf, shapes, causal, window) == len(shapes) - 1
    for nq, nk in shapes[-3:]:
        q, k, v = q_buf[:, :, :nq], k_buf[:, :, :nk], v_buf[:, :, :nk]
        o = flash_attention(q, k, v, causal=causal, window=window)
        assert call_of(q, k, v, causal, window).plan.path == overlap.NAME
        ro, _ = attention_float64(q, k, v, causal=causal, window=window, rows=range(0, nq, 7))
        err = float((o[:, :, ::7].double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (nq, nk, err)


@pytest.mark.parametrize("dims", [(40, 48, 56), (72, 80, 96, 112), (160, 192, 224)])
def test_head_dims_of_one_padded_width_share_the_prefill_constexprs(dims):
    # Skip-and-split takes D as a runtime value: head dims that round up to the same tile width compile one binary
    # (what their constexprs decide), apart from how far the masked loads may vectorise (D_ALIGN, at most 16)
    metas = {}
    for d in dims:
        q = torch.empty(1, 1, 1, d, dtype=torch.bfloat16)
        meta = skip_split.kernel_meta(q, True)
        assert meta["PADDED"] and meta["BLOCK_D"] > d and d % meta["D_ALIGN"] == 0 and meta["D_ALIGN"] <= 16
        metas.setdefault(meta["D_ALIGN"], []).append(meta)
    for same in metas.values():
        assert all(m == same[0] for m in same), same
    assert not skip_split.kernel_meta(torch.empty(1, 1, 1, 64), False)["PADDED"]


@pytest.mark.parametrize("d", [40, 48, 72])
def test_a_padded_head_dim_taken_at_runtime_matches_the_reference(d):
    # the columns past D are read as zeros and never written, whatever D_ALIGN says of D (8 at 40 and 72, 16 at 48)
    q, k, v = make_qkv(1, 2, 1, 37, 53, d, torch.float32, seed=d)
    check_against_reference(q, k, v, causal=True)
    call = launches.attention_call(q, k, v, True, None, None, None, "skip_split")
    assert call.values[-1] == d


@pytest.mark.gpu
def test_head_dims_of_one_padded_width_compile_one_prefill_binary_on_gpu():
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(3)
    dev = torch.cuda.current_device()
    counts = []
    for d in (160, 192, 224):
        q, k, v = (torch.randn(1, 4, 700, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        o = flash_attention(q, k, v, causal=True, rung="skip_split")
        ro, _ = attention_float64(q, k, v, causal=True)
        assert float((o.double() - ro).norm() / ro.norm()) < 1.5e-2, d
        counts.append(binaries(skip_split.attn_fwd, dev))
    assert counts[0] == counts[1] == counts[2], counts


# ----------------------------------------------------------------------------------------------------------------
# The backward: lengths at runtime, tiles looked up (never tuned inside a call)
# ----------------------------------------------------------------------------------------------------------------


def backward_specialisations(nq, nk, causal, window, d=64, hq=4, hk=2):
    """What Triton would specialise each backward kernel's launch on, for one call of those sizes (the
    arguments as ``backward.rung1_two_pass.backward_arguments`` builds them, the tiles a GPU launch takes)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    from flashlab.kernels.backward import rung1_two_pass as fb

    q = torch.randn(1, hq, nq, d)
    k, v = torch.randn(1, hk, nk, d), torch.randn(1, hk, nk, d)
    o, do, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(1, hq, nq)
    args = fb.backward_arguments(do, q, k, v, o, lse, causal, window, None)
    tiles = dict(BLOCK_M=64, BLOCK_N=64)
    specs = []
    for kernel, values, meta in ((fb._bwd_preprocess, args.pre_args, dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=64)),
                                 (fb._bwd_dkdv, (*args.dkdv_args, *args.tune), {**args.common, **tiles}),
                                 (fb._bwd_dq, (*args.dq_args, *args.tune), {**args.common, **tiles})):  # fmt: skip
        binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
        specs.append(binder(*values, **meta)[1])
    return specs


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (100, 0))])
def test_the_backward_kernels_lengths_are_runtime_values(causal, window):
    # odd, divisible by 16, past a power of two, Nq != Nk: each kernel keys one specialisation, so a new length
    # in a bucket compiles nothing (the backward used to specialise on every length's divisibility by 16)
    from flashlab.kernels.backward import rung1_two_pass as fb

    for kernel, names in ((fb._bwd_preprocess, fb.PREPROCESS_RUNTIME), (fb._bwd_dkdv, fb.DKDV_RUNTIME),
                          (fb._bwd_dq, fb.DQ_RUNTIME)):  # fmt: skip
        params = {p.name: p for p in kernel.params}
        assert all(params[n].do_not_specialize and params[n].do_not_specialize_on_alignment for n in names)
    first = backward_specialisations(4001, 4001, causal, window)
    for nq, nk in ((4016, 4016), (4097, 4097), (3000, 4113), (1, 4001)):
        assert backward_specialisations(nq, nk, causal, window) == first, (nq, nk)


def test_backward_tiles_come_from_the_bucket_not_the_length():
    from flashlab.kernels import configs
    from flashlab.kernels.backward import rung1_two_pass as fb
    from flashlab.kernels.device import kernel_band

    h200_smem = 232448

    def picks(nq, nk, causal, d=128, dtype=torch.bfloat16, hq=8):
        # what picked_configs looks up on a GPU without a tuned table: each kernel's bucket, then its default
        q = torch.empty(2, hq, nq, d, dtype=dtype)
        fields = configs.launch_fields(q, 2, nk, *kernel_band(nq, nk, d, causal, None, None)[:3])
        del fields["device"]
        keys = {name: configs.bucket(kernel, **fields) for name, kernel in fb.CONFIG_KERNELS.items()}
        return keys, {name: configs.default_config(key[0], key, h200_smem) for name, key in keys.items()}

    keys, tiles = picks(4001, 4001, True)
    assert picks(3000, 4096, True)[0] == keys and picks(2049, 2049, True, hq=16)[0] == keys  # one bucket
    assert picks(4001, 4001, False)[0] != keys and picks(8193, 8193, True)[0] != keys  # another mask, length
    assert tiles["dkdv"]["BLOCK_N"] == 128 and tiles["dq"]["BLOCK_M"] == 128  # D = 128: the measured picks
    assert picks(4001, 4001, False, d=64)[1]["dkdv"] == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_ctas": 1,
                                                          "num_stages": 3}  # fmt: skip
    q = torch.empty(1, 4, 100, 64)
    assert fb.picked_configs(q, 2, 100, (0, 10**9, 0))["dq"] == configs.cpu_config("backward_dq")  # the interpreter's


@pytest.mark.gpu
def test_a_backward_over_changing_lengths_compiles_once_and_never_autotunes_on_gpu():
    from flashlab.kernels import configs
    from flashlab.kernels.backward import rung1_two_pass as fb
    from flashlab.reference.torch_float64 import attention_float64_grads

    if configs.autotune_enabled():
        pytest.skip("FLASHLAB_AUTOTUNE=1: the autotuners run inside calls on purpose")
    g = torch.Generator(device="cuda").manual_seed(4)
    dev = torch.cuda.current_device()
    tuned_before = (len(fb._bwd_dkdv_tuned.cache), len(fb._bwd_dq_tuned.cache))
    counts = []
    for nq, nk in ((1001, 1001), (1016, 1016), (777, 1030), (1024, 1024)):
        q = torch.randn(1, 8, nq, 128, device="cuda", generator=g).bfloat16().requires_grad_()
        k, v = (torch.randn(1, 2, nk, 128, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
        do = torch.randn(1, 8, nq, 128, device="cuda", generator=g).bfloat16()
        grads = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
        ref = attention_float64_grads(q.detach(), k.detach(), v.detach(), do, True)
        for got, want in zip(grads, ref, strict=True):
            err = float((got.double() - want).norm() / want.norm())
            assert err < 3e-2, (nq, nk, err)
        counts.append(tuple(binaries(kern, dev) for kern in (fb._bwd_preprocess, fb._bwd_dkdv, fb._bwd_dq)))
    assert len(set(counts)) == 1, counts  # every length ran the first call's binaries
    assert (len(fb._bwd_dkdv_tuned.cache), len(fb._bwd_dq_tuned.cache)) == tuned_before  # no autotuning
