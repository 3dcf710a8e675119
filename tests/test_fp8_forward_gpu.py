"""The FP8 forward compiled on a CUDA GPU of compute capability 8.9 or later (skipped elsewhere).

Here P is rounded to e4m3 before the second product, as on any GPU run, so the answer moves further from the
float64 reference of the dequantised inputs than on the CPU: ``FP8_FORWARD_TOLERANCE`` bounds it. Odd lengths,
GQA, causal and windowed bands, D = 64, 128, 256, and a long causal case whose tiles are mostly unmasked.
"""

from __future__ import annotations

import pytest
import torch

import flashlab
from flashlab import dequantize_qkv, flash_attention, quantize_qkv
from flashlab.core.numerics import relative_error
from flashlab.host.fp8 import FP8_FORWARD_TOLERANCE, MIN_CAPABILITY
from flashlab.host.quantize import E4M3_TOLERANCE
from flashlab.reference.torch_float64 import attention_float64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
        reason="needs a CUDA GPU with 8-bit tensor cores",
    ),  # fmt: skip
]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, hq, hk, nq, nk, causal, window", [
    (1, 4, 2, 257, 257, False, None), (2, 8, 2, 300, 1031, True, None), (1, 4, 4, 2048, 2048, True, None),
    (1, 2, 1, 500, 700, False, (128, 16)), (1, 4, 1, 1, 777, False, None)])  # fmt: skip
def test_fp8_forward_on_the_gpu_equals_float64_of_the_dequantised_inputs(d, b, hq, hk, nq, nk, causal, window):
    g = torch.Generator(device="cuda").manual_seed(d + nq)
    q = torch.randn(b, hq, nq, d, device="cuda", generator=g)
    k, v = (torch.randn(b, hk, nk, d, device="cuda", generator=g) for _ in range(2))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    o, lse = flash_attention(q8, k8, v8, causal=causal, window=window, return_lse=True, q_descale=qd, k_descale=kd,
                             v_descale=vd)  # fmt: skip
    ref_o, ref_lse = attention_float64(*dequantize_qkv(q8, k8, v8, qd, kd, vd), causal=causal, window=window)
    err = relative_error(o.double(), ref_o)
    assert err <= FP8_FORWARD_TOLERANCE, f"relative error {err:.2e}"
    assert (lse.double() - ref_lse).abs().max() <= 2e-2
    gate = relative_error(o.double(), attention_float64(q.double(), k.double(), v.double(), causal=causal,
                                                        window=window)[0])  # fmt: skip
    assert gate <= E4M3_TOLERANCE, f"the evaluation gate: {gate:.2e}"


def test_two_runs_are_bit_identical():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", generator=g) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    a = flash_attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    b = flash_attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(a, b)


def test_a_bad_scale_does_not_wait_for_the_gpu_and_is_raised_later():
    """On a GPU the call with a bad scale returns without reading the scales (no synchronisation); its group's
    rows are NaN, and the error comes out of ``check_kvcache_errors`` (which waits) or the next FP8 call."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(1, 8, 512, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k[:, :2], v[:, :2])
    bad = vd.clone()
    bad[0, 1] = float("nan")
    o = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=bad)  # no error yet
    with pytest.raises(ValueError, match=r"float8 inputs .* v_descale\[0, 1\] = nan"):
        flashlab.check_kvcache_errors()
    assert o[0, 4:].isnan().all() and not o[0, :4].isnan().any()  # K/V head 1's query heads only
    flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=bad)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="an earlier flash_attention call on float8 inputs"):
        flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the two Hopper kernels: sm_90 only")  # fmt: skip
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq, nk, causal", [(333, 333, False), (300, 1031, True), (2048, 2048, True)])
def test_both_hopper_kernels_equal_float64_of_the_dequantised_inputs(d, nq, nk, causal):
    """Rung 4's Gluon kernel with 8-bit operands (``rung4_overlap.launch_fp8``, the default at D = 64 and 128 on
    Hopper) and the copy-engine kernel (D = 256, and the bands rung 4 refuses), each launched on the same inputs."""
    from flashlab.kernels import fp8_forward
    from flashlab.kernels.device import kernel_band
    from flashlab.kernels.ladder import rung4_overlap

    g = torch.Generator(device="cuda").manual_seed(d + nk)
    q = torch.randn(2, 8, nq, d, device="cuda", generator=g)
    k, v = (torch.randn(2, 2, nk, d, device="cuda", generator=g) for _ in range(2))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    assert rung4_overlap.fp8_unavailable(q8, k8, v8, causal, None) is None
    band = kernel_band(nq, nk, d, causal, None, None)[:4]
    ref_o, ref_lse = attention_float64(*dequantize_qkv(q8, k8, v8, qd, kd, vd), causal=causal)
    launches = {
        "rung 4": lambda o, lse: rung4_overlap.launch_fp8(
            q8, k8, fp8_forward.transposed_v(v8), o, lse, qd, kd, vd, band, causal, None
        ),  # fmt: skip
        "copy engine": lambda o, lse: fp8_forward.launch_tma(q8, k8, v8, o, lse, qd, kd, vd, band, causal, None),
    }
    for name, launch in launches.items():
        o = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(q.shape[:3], device="cuda")
        launch(o, lse)
        err = relative_error(o.double(), ref_o)
        assert err <= FP8_FORWARD_TOLERANCE, f"{name}: relative error {err:.2e}"
        assert (lse.double() - ref_lse).abs().max() <= 2e-2, name
