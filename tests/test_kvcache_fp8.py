"""An 8-bit (float8 e4m3) KV cache on the CPU (Triton's interpreter): ``flashlab.quantize_kv`` and
``flash_attention_with_kvcache`` with ``k_descale`` / ``v_descale``.

The kernel must equal the float64 reference of the keys and values the 8-bit cache stands for
(``flashlab.dequantize_kv``: ``k8 * k_descale``) to q's own tolerance, since widening e4m3 is exact; and the cache
must pass the evaluation gate (``E4M3_TOLERANCE``) against the float64 reference of the keys and values before
quantisation. Bad scales are reported like bad lengths: NaN rows, and a ValueError naming the scale.
"""

from __future__ import annotations

import pytest
import torch
from test_kvcache import paged_case, reference

import flashlab
from flashlab import dequantize_kv, flash_attention_with_kvcache, quantize_kv
from flashlab.core.numerics import relative_error, tolerance
from flashlab.host.plan import kvcache_signature
from flashlab.host.quantize import E4M3_MAX, E4M3_TOLERANCE, FP8

LSE_TOL = 1e-4


def contiguous_case(seed, b=3, hq=4, hk=2, nq=1, d=32, n=40, dtype=torch.bfloat16, lengths=(40, 17, 0)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, n, hk, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor(lengths, dtype=torch.int32), None


def check_8bit(q, k, v, seqlens, table, causal=False, descale_shape="per_sequence"):
    """The 8-bit cache's answer against float64 of its dequantised values; returns (o, reference of the
    original keys and values) for a second look."""
    k8, v8, ks, vs = quantize_kv(k, v, block_table=table, cache_seqlens=seqlens)
    if descale_shape == "per_head":  # one scale per K/V head for every sequence
        ks, vs = ks.amax(0), vs.amax(0)
    o, lse = flash_attention_with_kvcache(q, k8, v8, seqlens, table, causal=causal, return_lse=True, k_descale=ks,
                                          v_descale=vs)  # fmt: skip
    assert o.dtype == q.dtype and o.shape == q.shape
    kd, vd = dequantize_kv(k8, v8, ks, vs, block_table=table)  # (B, capacity, Hk, D) float64
    ro, rlse = reference(q.double(), kd, vd, seqlens, None, causal, None)
    err = relative_error(o, ro)
    assert err < tolerance(q.dtype), f"relative error {err:.2e} against the dequantised cache"
    seen = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), seen) and (o[~seen] == 0).all()
    assert float((lse[seen].double() - rlse[seen]).abs().max()) < LSE_TOL * max(1.0, float(rlse[seen].abs().max()))
    original = reference(q.double(), k.double(), v.double(), seqlens, table, causal, None)[0]
    return o, original


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_an_8bit_cache_equals_float64_of_what_it_stands_for(dtype, paged):
    # decode rows (nq = 1), GQA (two query heads a K/V head), ragged lengths including 0; paged: shuffled blocks,
    # one shared by two sequences
    if paged:
        case = paged_case(3, b=3, hq=4, hk=2, nq=1, d=32, bs=16, dtype=dtype, max_len=60)
    else:
        case = contiguous_case(3, dtype=dtype)
    o, original = check_8bit(*case)
    assert relative_error(o, original) < E4M3_TOLERANCE  # the evaluation gate, on ordinary inputs


def test_a_chunk_of_prefill_causal_through_an_8bit_cache_with_per_head_scales():
    q, k, v, seqlens, table = paged_case(5, b=2, hq=2, hk=1, nq=5, d=16, bs=32, dtype=torch.bfloat16, max_len=50,
                                         zero=False)  # fmt: skip
    check_8bit(q, k, v, seqlens, table, causal=True, descale_shape="per_head")


def test_the_scales_are_applied_not_just_carried():
    # the same 8-bit values with every scale doubled: keys twice as large (a sharper softmax), values twice as
    # large (an output twice as large); the kernel must follow the float64 reference of each
    q, k, v, seqlens, table = contiguous_case(8, lengths=(40, 30, 20))
    k8, v8, ks, vs = quantize_kv(k, v, cache_seqlens=seqlens)
    for kf, vf in ((1.0, 1.0), (4.0, 1.0), (1.0, 3.0)):
        o = flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks * kf, v_descale=vs * vf)
        kd, vd = dequantize_kv(k8, v8, ks * kf, vs * vf)
        assert relative_error(o, reference(q.double(), kd, vd, seqlens, None, False, None)[0]) < 1.5e-2


def test_quantize_kv_scales_by_the_largest_held_value_of_each_head():
    k = torch.zeros(2, 8, 2, 16)
    v = torch.ones(2, 8, 2, 16)
    k[0, 2, 1, 5] = -3.5  # the largest |k| of (sequence 0, head 1)
    k[0, 7, 1, 0] = 100.0  # past sequence 0's length (5): not held, not counted
    k[1, 0, 0, 3] = 2.0
    k8, v8, ks, vs = quantize_kv(k, v, cache_seqlens=torch.tensor([5, 8], dtype=torch.int32))
    assert k8.dtype == v8.dtype == FP8 and ks.dtype == vs.dtype == torch.float32
    expected = torch.tensor([[1.0, 3.5 / 448], [2.0 / 448, 1.0]], dtype=torch.float32)  # zeros: scale 1, never 0
    assert torch.equal(ks, expected)
    assert torch.allclose(vs, torch.full((2, 2), 1 / 448))
    assert float(k8[0, 2, 1, 5].float()) == -E4M3_MAX  # the largest value lands on e4m3's largest
    assert float(k8[0, 7, 1, 0].float()) == E4M3_MAX  # past the length: clamped, not NaN


def test_quantize_kv_rounds_each_element_to_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 24, 2, 16, generator=g) for _ in range(2))
    k8, v8, ks, vs = quantize_kv(k, v)
    kd, _ = dequantize_kv(k8, v8, ks, vs)
    normal = k.abs() >= (2.0**-6) * ks[:, None, :, None]  # e4m3's normal range: relative steps of 2^-3
    rel = ((kd - k.double()).abs() / k.double().abs())[normal]
    assert float(rel.max()) <= 2.0**-4 + 1e-12
    assert float(rel.max()) > 2.0**-6  # and it is a real rounding, not a 16-bit copy


def test_blocks_shared_between_sequences_share_one_scale():
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(5, 16, 1, 16, generator=g) for _ in range(2))
    k[3] *= 10  # block 3: the large keys, in sequence 0 only, and block 1 shared by sequences 0 and 1
    table = torch.tensor([[3, 1], [1, 4], [0, 2]], dtype=torch.int32)
    k8, v8, ks, vs = quantize_kv(k, v, block_table=table)
    assert ks[0] == ks[1] and ks[0] == k[[3, 1, 4]].abs().amax() / 448 and ks[2] == k[[0, 2]].abs().amax() / 448
    kd, vd = dequantize_kv(k8, v8, ks, vs, block_table=table)  # (3, 32, 1, 16): each sequence's blocks in order
    assert torch.allclose(kd[1, :16], k[1].double(), rtol=2.0**-4, atol=float(ks[1]) * 2.0**-9)
    assert (k8[[0, 1, 2, 3, 4]].float().abs().amax(dim=(1, 2, 3)) > 0).all()


def test_quantize_kv_refuses_what_it_cannot_hold():
    k = torch.randn(1, 16, 1, 16)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_kv(k, k * float("inf"))
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 is not a block"):
        quantize_kv(k, k, block_table=torch.tensor([[0, 9]], dtype=torch.int32))
    with pytest.raises(TypeError, match="quantize_kv takes"):
        quantize_kv(k.to(torch.int8), k)


# (which descale, the bad value): every way a scale can fail to be finite and > 0
BAD_SCALES = {
    "zero_k": ("k", 0.0),
    "negative_v": ("v", -1.0),
    "nan_k": ("k", float("nan")),
    "inf_k": ("k", float("inf")),
    "inf_v": ("v", float("inf")),
}


@pytest.mark.parametrize("name", list(BAD_SCALES))
def test_a_bad_scale_raises_on_the_device_check_and_the_host_check(name):
    which, value = BAD_SCALES[name]
    q, k, v, seqlens, table = paged_case(2, b=3, hq=4, hk=2, nq=1, d=16, bs=16, dtype=torch.bfloat16, max_len=40,
                                         zero=False)  # fmt: skip
    k8, v8, ks, vs = quantize_kv(k, v, block_table=table, cache_seqlens=seqlens)
    bad_ks, bad_vs = ks.clone(), vs.clone()
    (bad_ks if which == "k" else bad_vs)[1, 1] = value
    message = rf"{which}_descale\[1, 1\] = {value!r}: scales must be finite and > 0"
    for check_values in (True, "sync"):
        with pytest.raises(ValueError, match=message):
            flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=bad_ks, v_descale=bad_vs,
                                         check_values=check_values)  # fmt: skip
        flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)  # the record is clear
        flashlab.check_kvcache_errors("cpu")
    # unchecked: NaN in the rows that read the bad scale (sequence 1, query heads 2 and 3), the others exact
    o = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=bad_ks, v_descale=bad_vs,
                                     check_values=False)  # fmt: skip
    good = flash_attention_with_kvcache(q, k8, v8, seqlens, table, k_descale=ks, v_descale=vs)
    assert torch.isnan(o[1, 2:]).all()
    rows = torch.ones(3, 4, dtype=torch.bool)
    rows[1, 2:] = False
    assert torch.equal(o[rows], good[rows])


def test_a_bad_per_head_scale_is_found_in_a_contiguous_cache():
    q, k, v, seqlens, _ = contiguous_case(4, lengths=(40, 12, 3))
    k8, v8, ks, vs = quantize_kv(k, v)
    ks = ks.amax(0).clone()  # (Hk,)
    ks[0] = -2.0
    with pytest.raises(ValueError, match=r"k_descale\[0\] = -2.0: scales must be finite and > 0"):
        flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks, v_descale=vs, check_values="sync")
    with pytest.raises(ValueError, match=r"k_descale\[\d, 0\] = -2.0: scales must be finite and > 0"):
        flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks, v_descale=vs)


def test_bad_descale_arguments_raise_clear_errors():
    q, k, v, seqlens, _ = contiguous_case(6, b=2, lengths=(40, 12))
    k8, v8, ks, vs = quantize_kv(k, v)
    call = lambda **kw: flash_attention_with_kvcache(**{"q": q, "k_cache": k8, "v_cache": v8,  # noqa: E731
                                                        "cache_seqlens": seqlens, "k_descale": ks, "v_descale": vs,
                                                        **kw})  # fmt: skip
    cases = [
        (ValueError, "v_descale is missing", dict(v_descale=None)),
        (
            ValueError,
            r"k_descale and v_descale scale an 8-bit .* this cache is torch.bfloat16",
            dict(k_cache=k, v_cache=v),
        ),
        (
            ValueError,
            r"k_descale must be \(B, Hk\) = \(2, 2\) or \(Hk,\) = \(2,\); got shape \(2, 3\)",
            dict(k_descale=torch.ones(2, 3)),
        ),
        (TypeError, "v_descale must be float32; got torch.float64", dict(v_descale=vs.double())),
        (ValueError, r"k_descale must be on q's device \(cpu\); got meta", dict(k_descale=ks.to("meta"))),
        (TypeError, "an 8-bit cache holds both k_cache and v_cache", dict(v_cache=v)),
        (TypeError, "an 8-bit cache holds both .* with q float16 or bfloat16", dict(q=q.float())),
        (TypeError, "k_cache has dtype torch.int8", dict(k_cache=k8.view(torch.int8))),
        (TypeError, "k_descale must be a dense", dict(k_descale=ks.to_sparse())),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            call(**kwargs)


def test_the_plan_of_an_8bit_cache_is_its_own():
    # same shapes, a 16-bit cache and an 8-bit one, and descales of other strides: each its own signature
    q, k, v, seqlens, _ = contiguous_case(7)
    k8, v8, ks, vs = quantize_kv(k, v)
    plain = kvcache_signature(q, k, v, seqlens, None, False, None, None)
    eight = kvcache_signature(q, k8, v8, seqlens, None, False, None, None, k_descale=ks, v_descale=vs)
    strided = kvcache_signature(q, k8, v8, seqlens, None, False, None, None, k_descale=ks.t().contiguous().t(),
                                v_descale=vs)  # fmt: skip
    per_head = kvcache_signature(q, k8, v8, seqlens, None, False, None, None, k_descale=ks[0], v_descale=vs[0])
    assert len({plain, eight, strided, per_head}) == 4 and None not in (plain, eight, strided, per_head)
    # and a transposed descale is read through its strides
    o1 = flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks, v_descale=vs)
    o2 = flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks.t().contiguous().t(), v_descale=vs)
    assert torch.equal(o1, o2)


def test_the_benchmark_runs_the_8bit_cache_beside_the_16bit_one():
    # --kv-dtype fp8 adds each paged backend's 8-bit twin; each is checked against float64 of what its cache
    # stands for (the 16-bit rows against the cell's own keys), and its bandwidth counts one byte an element
    from flashlab import bench
    from flashlab.bench.config import BenchConfig
    from flashlab.bench.implementations import BACKENDS
    from flashlab.bench.sweep import run_sweep

    cfg = BenchConfig(mode="decode", device="cpu", seq_lens=(70,), head_dims=(16,), batches=(2,), q_heads=4,
                      kv_heads=2, backends=("flashlab", "paged16"), kv_dtype="fp8", warmup=0.0, rep=1.0)  # fmt: skip
    assert cfg.resolve().backends == ("flashlab", "paged16", "paged16_fp8") and cfg.resolve().dtypes == ("bf16",)
    assert "--kv-dtype fp8" in " ".join(cfg.to_argv())
    results = run_sweep(cfg, progress=False)
    rows = {r["backend"]: r for r in results.rows}
    assert all(r["status"] == "ok" and r["rel_err"] < tolerance(torch.bfloat16) for r in rows.values()), rows
    kv16 = 2 * 2 * 2 * 70 * 16 * 2  # K and V, B=2, Hk=2, N=70, D=16, 2 bytes
    assert rows["paged16"]["io_bytes"] - rows["paged16_fp8"]["io_bytes"] == kv16 // 2
    assert "paged16_fp8 vs paged16 (16-bit cache): geo-mean" in bench.summary_table(results)
    assert BACKENDS["paged16_fp8"].unavailable("cpu", torch.bfloat16) is None
    assert "float16 or bfloat16 queries" in BACKENDS["paged16_fp8"].unavailable("cpu", torch.float32)
    with pytest.raises(ValueError, match="kv_dtype is for the decode grid"):
        BenchConfig(mode="prefill", device="cpu", kv_dtype="fp8").resolve()


def test_the_command_line_takes_kv_dtype_for_decode_only(capsys):
    from flashlab.bench.cli import main

    with pytest.raises(SystemExit):
        main(["--kv-dtype", "fp8", "--device", "cpu"])
    assert "--kv-dtype is for --mode decode only" in capsys.readouterr().err


def test_a_bad_scale_left_in_the_record_raises_at_the_next_call():
    # as on a GPU, where the kernel runs after the call returns: the plain launch writes the device's record, and
    # the next checked call (or check_kvcache_errors) raises it as an earlier call's, naming the head's rows
    from flashlab.host.kvcache_errors import error_record
    from flashlab.kernels.decode import kvcache
    from flashlab.kernels.device import kernel_band

    q, k, v, seqlens, _ = contiguous_case(9, lengths=(40, 30, 20))
    k8, v8, ks, vs = quantize_kv(k, v)
    bad = ks.clone()
    bad[2, 0] = float("inf")
    _, left, right, qk_scale, _ = kernel_band(1, 40, 32, False, None, None)
    record = error_record(q.device)
    message = (
        r"an earlier flash_attention_with_kvcache call on cpu met a bad value: k_descale\[2, 0\] = inf: "
        r"scales must be finite and > 0; that call's output sequence 2's rows of K/V head 0 are NaN"
    )
    for raise_it in ("next call", "check_kvcache_errors"):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
        kvcache.launch(q, k8, v8, seqlens, seqlens, o, lse, 0, 40, left, right, qk_scale, errors=record.tensor,
                       k_descale=bad, v_descale=vs)  # fmt: skip
        assert torch.isnan(o[2, :2]).all() and torch.isfinite(o[2, 2:]).all() and torch.isfinite(o[:2]).all()
        with pytest.raises(ValueError, match=message):
            if raise_it == "next call":
                flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks, v_descale=vs)
            else:
                flashlab.check_kvcache_errors()


def test_an_8bit_cache_compiles_into_one_operator_node():
    from test_compile import CPU_BACKEND

    q, k, v, seqlens, _ = contiguous_case(10, lengths=(40, 30, 20))
    k8, v8, ks, vs = quantize_kv(k, v)

    def step(q, k8, v8, seqlens, ks, vs):
        return flash_attention_with_kvcache(q, k8, v8, seqlens, k_descale=ks, v_descale=vs)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=CPU_BACKEND, fullgraph=True)
    torch.testing.assert_close(compiled(q, k8, v8, seqlens, ks, vs), step(q, k8, v8, seqlens, ks, vs), rtol=0, atol=0)
    bad = vs.clone()
    bad[0, 1] = 0.0
    with pytest.raises(ValueError, match=r"v_descale\[0, 1\] = 0.0"):  # checked inside the operator, at run time
        compiled(q, k8, v8, seqlens, ks, bad)
    args = (q, k8, v8, seqlens, None, False, -1, -1, None, True, False, None, None, ks, vs)
    # the fake tensor's shapes (opcheck's schema test multiplies the inputs, which torch has no fp8 kernel for)
    torch.library.opcheck(torch.ops.flashlab.attention_with_kvcache, args, test_utils=("test_faketensor",))
