"""The FP8 forward on the CPU (Triton's interpreter): ``flash_attention`` on float8 e4m3 q, k, v with their
descales, and ``flashlab.quantize_qkv``.

On the interpreter both products take fp32 operands widened exactly from e4m3 and P enters the second one
unrounded (``flashlab.kernels.fp8_forward``), so the answer must equal the float64 reference of the dequantised
inputs (``flashlab.dequantize_qkv``) to bfloat16's own tolerance: what is checked here is the scales, the band,
GQA and the online softmax. Against the inputs before quantisation it must pass the evaluation gate
(``E4M3_TOLERANCE``). The GPU tests (``tests/test_fp8_forward_gpu.py``) check P's rounding to e4m3 too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashlab
from flashlab import dequantize_qkv, flash_attention, quantize_qkv
from flashlab.core.numerics import relative_error, tolerance
from flashlab.host.quantize import E4M3_MAX, E4M3_TOLERANCE, FP8
from flashlab.reference.torch_float64 import attention_float64

LSE_TOL = 1e-4


def reference(q, k, v, causal=False, window=None, scale=None):
    """(o, lse) of the float64 definition."""
    return attention_float64(q, k, v, causal=causal, window=window, scale=scale)


def random_case(seed):
    rng = np.random.default_rng(seed)
    hk = int(rng.integers(1, 3))
    hq = hk * int(rng.choice([1, 2, 4]))
    nq, nk = (int(x) for x in rng.integers(1, 90, size=2))
    d = int(rng.choice([64, 128, 256]))
    causal = bool(rng.integers(0, 2)) and nq <= nk
    window = (int(rng.integers(0, 40)), int(rng.integers(0, 10))) if rng.random() < 0.3 else None
    g = torch.Generator().manual_seed(seed)
    b = int(rng.integers(1, 3))
    q = torch.randn(b, hq, nq, d, generator=g)
    k, v = torch.randn(b, hk, nk, d, generator=g), torch.randn(b, hk, nk, d, generator=g)
    return q, k, v, causal, window


@pytest.mark.parametrize("seed", range(10))
def test_fp8_forward_equals_float64_of_the_dequantised_inputs(seed):
    q, k, v, causal, window = random_case(seed)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    o, lse = flash_attention(q8, k8, v8, causal=causal, window=window, return_lse=True, q_descale=qd, k_descale=kd,
                             v_descale=vd)  # fmt: skip
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == q.shape[:3]
    ref_o, ref_lse = reference(*dequantize_qkv(q8, k8, v8, qd, kd, vd), causal, window)
    seen = torch.isfinite(ref_lse)
    assert relative_error(o.double()[seen], ref_o[seen]) <= tolerance(torch.bfloat16)
    assert torch.equal(torch.isfinite(lse), seen), "the rows that see no key"
    assert (lse.double()[seen] - ref_lse[seen]).abs().max() <= LSE_TOL * max(1.0, ref_lse[seen].abs().max())
    assert (o[~seen] == 0).all()


def test_fp8_forward_passes_the_evaluation_gate_against_the_inputs_before_quantisation():
    """The teaching point: e4m3 moves each element by up to 2^-4 of it, and the output lands within the gate of
    the 16-bit inputs' attention; with outlier channels (a few key dimensions tens of times larger) the same
    relative rounding moves the scores by whole units and the gate refuses."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 64, 64, generator=g) for _ in range(3))
    out = flash_attention(*quantize_qkv(q, k, v)[:3], q_descale=quantize_qkv(q, k, v)[3],
                          k_descale=quantize_qkv(q, k, v)[4], v_descale=quantize_qkv(q, k, v)[5])  # fmt: skip
    ordinary = relative_error(out.double(), reference(q.double(), k.double(), v.double())[0])
    assert ordinary <= E4M3_TOLERANCE
    k_outliers = k.clone()
    k_outliers[..., :4] *= 40.0  # four outlier channels
    q_outliers = q.clone()
    q_outliers[..., :4] *= 4.0
    q8, k8, v8, qd, kd, vd = quantize_qkv(q_outliers, k_outliers, v)
    out = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    skewed = relative_error(out.double(), reference(q_outliers.double(), k_outliers.double(), v.double())[0])
    assert skewed > E4M3_TOLERANCE > ordinary


def test_quantize_qkv_rounds_each_element_to_within_half_an_e4m3_step():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 6, 33, 64, generator=g), torch.randn(2, 3, 40, 64, generator=g), torch.randn(2, 3, 40, 64)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    assert (q8.dtype, k8.dtype, v8.dtype) == (FP8,) * 3 and qd.shape == kd.shape == vd.shape == (2, 3)
    for x, back in zip((q, k, v), dequantize_qkv(q8, k8, v8, qd, kd, vd), strict=True):
        step = 2.0**-4 * x.double().abs() + 2.0**-9 * back.abs().max() / E4M3_MAX  # half a step, subnormals too
        assert ((back - x.double()).abs() <= step + 1e-12).all()
    # q's scale covers its group's query heads: heads 0-1 belong to K/V head 0
    assert torch.allclose(qd[:, 0], q[:, :2].abs().amax(dim=(1, 2, 3)) / E4M3_MAX)


def test_a_negative_scale_runs_as_minus_q():
    q, k, v, _, _ = random_case(11)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    o = flash_attention(q8, k8, v8, scale=-0.05, q_descale=qd, k_descale=kd, v_descale=vd)
    ref = reference(*dequantize_qkv(q8, k8, v8, qd, kd, vd), scale=-0.05)[0]
    assert relative_error(o.double(), ref) <= tolerance(torch.bfloat16)


def good():
    q, k, v = (torch.randn(1, 2, 8, 64) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    return dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)


BAD = [
    (dict(v_descale=None), TypeError, "v_descale is missing"),
    (dict(k=lambda a: a["k"].to(torch.bfloat16)), TypeError, "k has dtype torch.bfloat16"),
    (dict(q_descale=lambda a: a["q_descale"].double()), TypeError, "q_descale must be float32"),
    (dict(k_descale=lambda a: a["k_descale"][:, :1]), ValueError, r"k_descale must have shape \(B, Hk\)"),
    (dict(k_descale=lambda a: a["k_descale"] * 0), ValueError, r"k_descale\[0, 0\] = 0.0: scales must be finite"),
    (dict(v_descale=lambda a: -a["v_descale"]), ValueError, "v_descale.*scales must be finite and > 0"),
    (dict(q_descale=lambda a: a["q_descale"] * float("nan")), ValueError, "q_descale.*nan"),
    (dict(q=lambda a: a["q"][..., :32], k=lambda a: a["k"][..., :32], v=lambda a: a["v"][..., :32]), ValueError,
     r"head dim 32: the FP8 forward takes D in \(64, 128, 256\)"),
    (dict(q=lambda a: a["q"][0]), ValueError, "q must have 4 dims"),
    (dict(num_splits=2), ValueError, "the FP8 forward takes none of them"),
]  # fmt: skip


@pytest.mark.parametrize("changes, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_fp8_input_is_a_clear_error(changes, error, message):
    args = good()
    for name, change in changes.items():
        args[name] = change(args) if callable(change) else change
    with pytest.raises(error, match=message):
        flash_attention(**args)


def test_the_fp8_forward_has_no_backward():
    args = good()
    args["q"] = args["q"].float().requires_grad_()  # what a model would pass: a tensor that needs a gradient
    with pytest.raises(RuntimeError, match="the FP8 forward has no backward"):
        flash_attention(**args)
    with torch.no_grad():  # then the dtype itself is checked
        with pytest.raises(TypeError, match="q has dtype torch.float32"):
            flash_attention(**args)
    assert flashlab.quantize_qkv is quantize_qkv


def test_v_is_transposed_with_zero_padding_and_per_head_scales_stand_for_every_sequence():
    """The kernel reads V as (B, Hk, D, Nk') with the keys contiguous: the padding columns are zero bytes (a whole
    tile is copied, and a NaN byte there would reach every row); descales of shape (Hk,) serve every sequence."""
    from flashlab.kernels import fp8_forward

    g = torch.Generator().manual_seed(12)
    v = torch.randn(2, 3, 21, 64, generator=g).to(FP8)
    vt = fp8_forward.transposed_v(v)
    assert vt.shape == (2, 3, 64, 32) and vt.stride(-1) == 1
    assert torch.equal(vt[..., :21].view(torch.uint8), v.transpose(2, 3).contiguous().view(torch.uint8))
    assert not vt[..., 21:].view(torch.uint8).any()
    q, k, vv = (torch.randn(2, 2, 24, 64, generator=g) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, vv)
    shared = (qd.amax(0), kd.amax(0), vd.amax(0))  # (Hk,): the same scale for both sequences
    o = flash_attention(q8, k8, v8, causal=True, q_descale=shared[0], k_descale=shared[1], v_descale=shared[2])
    ref = reference(*dequantize_qkv(q8, k8, v8, *(s.expand(2, -1) for s in shared)), causal=True)[0]
    assert relative_error(o.double(), ref) <= tolerance(torch.bfloat16)


def test_a_bad_scale_is_checked_on_the_device_its_group_nan_the_others_right():
    """The host checks the descales' shapes and dtypes only (reading their values would wait for the GPU every
    call); the kernel writes NaN in the output rows and lse of the (sequence, K/V head) whose scale is bad, leaves
    every other group's answer as it was, and the check kernel says which scale it was in the error record."""
    from flashlab.host.fp8 import check_fp8_inputs
    from flashlab.host.kvcache_errors import ErrorRecord, raise_recorded
    from flashlab.kernels import fp8_forward
    from flashlab.kernels.device import kernel_band

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 4, 20, 64, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # two K/V heads, two query heads each
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    bad_kd = kd.clone()
    bad_kd[1, 0] = 0.0
    descales = check_fp8_inputs(q8, k8, v8, False, None, None, qd, bad_kd, vd)  # no value read: no error here
    o = torch.empty(2, 4, 20, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 20)
    fp8_forward.launch(q8, k8, v8, o, lse, *descales, kernel_band(20, 20, 64, False, None, None)[:4])
    assert o[1, :2].isnan().all() and lse[1, :2].isnan().all()  # sequence 1, K/V head 0: its two query heads
    good = torch.ones_like(lse, dtype=torch.bool)
    good[1, :2] = False
    ro, rlse = attention_float64(*dequantize_qkv(q8, k8, v8, qd, kd, vd))
    assert relative_error(o[good], ro[good]) < tolerance(torch.bfloat16)
    torch.testing.assert_close(lse[good].double(), rlse[good], atol=LSE_TOL, rtol=0)
    record = ErrorRecord(torch.device("cpu"))
    fp8_forward.check_descales(*descales, record.tensor)
    with pytest.raises(
        ValueError, match=r"an earlier flash_attention call on float8 inputs .* k_descale\[1, 0\] = 0.0"
    ):
        raise_recorded(record, earlier=True)
    assert not record.holds_error()  # raised once, then cleared
    fp8_forward.check_descales(qd, kd, vd, record.tensor)  # good scales: nothing recorded
    assert not record.holds_error()
