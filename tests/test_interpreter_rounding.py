"""fp32 -> bf16 on Triton's CPU interpreter rounds to nearest even, bit for bit as torch's own conversion.

The values: every kind of fp32 -- random bit patterns over the whole range, exact ties (the dropped half is 0x8000)
next to an even and an odd kept bit, values just above and below a tie, subnormals, the largest subnormal and the
largest finite values (which round up to the smallest normal and to infinity), zeros of both signs, infinities and
NaNs. A NaN's bits are the one thing torch does not fix (its vectorised CPU path writes 0xFFFF, its scalar path
0x7FC0, the GPU 0x7FFF), so for NaNs the check is that a NaN comes out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashlab.core.numerics import relative_error
from flashlab.host import flash_attention
from flashlab.kernels import interpreter_rounding
from flashlab.kernels.interpreter import interpreted, interpreted_language
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads


def _fp32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _special_bits() -> np.ndarray:
    kept = np.array([0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F], np.uint32)
    low = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)  # ties are 0x8000
    grid = ((kept[:, None] << 16) | low[None, :]).ravel()
    named = np.array([
        0x0000_0000, 0x8000_0000,  # +0.0, -0.0
        0x0000_0001, 0x8000_0001, 0x007F_FFFF, 0x807F_FFFF,  # the smallest and largest subnormals
        0x7F7F_FFFF, 0xFF7F_FFFF, 0x7F7F_7FFF, 0x7F7F_8000,  # the largest finite, and either side of its tie
        0x7F80_0000, 0xFF80_0000,  # +inf, -inf
    ], np.uint32)  # fmt: skip
    return np.concatenate([grid, grid | 0x8000_0000, named])


def _nan_bits() -> np.ndarray:
    return np.array([0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7F80_8000, 0x7FBF_FFFF, 0xFFFF_FFFF],
                    np.uint32)  # fmt: skip


def _values(random: int = 200_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([_special_bits(), rng.integers(0, 2**32, random, dtype=np.uint64).astype(np.uint32)])


def _torch_bits(bits: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(_fp32(bits).copy())
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _is_bf16_nan(out: np.ndarray) -> np.ndarray:
    return ((out & 0x7F80) == 0x7F80) & ((out & 0x007F) != 0)


def _check_against_torch(out: np.ndarray, bits: np.ndarray) -> None:
    want = _torch_bits(bits)
    nan = np.isnan(_fp32(bits))
    wrong = np.flatnonzero((out != want) & ~nan)
    assert wrong.size == 0, [f"{bits[i]:#010x} -> {out[i]:#06x}, torch {want[i]:#06x}" for i in wrong[:8]]
    assert _is_bf16_nan(out[nan]).all()


def test_round_to_nearest_even_equals_torch_bit_for_bit():
    bits = np.concatenate([_values(), _nan_bits()])
    _check_against_torch(interpreter_rounding.round_to_nearest_even(_fp32(bits)), bits)


def test_ties_go_to_even_and_the_carry_reaches_the_exponent():
    r = interpreter_rounding.round_to_nearest_even
    assert r(_fp32([0x3F80_8000, 0x3F81_8000])).tolist() == [0x3F80, 0x3F82]  # 1 + half an ulp stays, 1 + 1.5 up
    assert r(_fp32([0x7F7F_FFFF, 0x007F_FFFF])).tolist() == [0x7F80, 0x0080]  # to inf; to the smallest normal


@triton.jit
def _to_bf16(x_ptr, out_ptr, rtz_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x.to(tl.bfloat16), mask=offs < n)
    tl.store(rtz_ptr + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=offs < n)


def _interpret(bits: np.ndarray):
    x = torch.from_numpy(_fp32(bits).copy())
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    rtz = torch.empty_like(out)
    block = 1024
    with interpreted_language():
        interpreted(_to_bf16)[(triton.cdiv(x.numel(), block),)](x, out, rtz, x.numel(), BLOCK=block)
    as_bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (out, rtz)]
    return as_bits[0], as_bits[1]


def test_a_kernel_on_the_interpreter_rounds_as_torch():
    bits = np.concatenate([_values(random=20_000), _nan_bits()])
    out, rtz = _interpret(bits)
    _check_against_torch(out, bits)
    finite = ~np.isnan(_fp32(bits))
    assert (rtz[finite] == (bits[finite] >> 16)).all()  # rtz asked for: the low bits dropped
    assert _is_bf16_nan(rtz[~finite]).all()


def test_triton_conversion_is_back_after_the_launch():
    from triton.runtime import interpreter

    own = interpreter._convert_float
    with interpreted_language():
        assert interpreter._convert_float is not own
        with interpreted_language():  # nested: still the rounding one, and the outer one still restores
            assert interpreter._convert_float is not own
    assert interpreter._convert_float is own


@pytest.mark.parametrize("dtype", [tl.float16, tl.float8e5])
def test_other_conversions_are_triton_own(dtype):
    from triton.runtime import interpreter

    x = np.array([1.0, 1.00048828125, -3.5], np.float32)
    want = interpreter._convert_float(x, tl.float32, dtype, None)
    with interpreted_language():
        assert (interpreter._convert_float(x, tl.float32, dtype, None) == want).all()


def _torch_bf16_attention(q, k, v, do, causal):
    """torch's own bf16 attention (SDPA) and its gradients: the error bf16 itself costs."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=causal
    )
    o.backward(do)
    return o.detach(), (q.grad, k.grad, v.grad)


# FlashAttention's own test criterion: the kernel's error against a float64 reference at most twice the error of
# the same attention computed by PyTorch in the same dtype. Truncating to bf16 put the gradients at about 2.5x.
@pytest.mark.parametrize(
    "b, hq, hk, nq, nk, d, causal, seed",
    [(2, 2, 2, 40, 40, 16, False, 21), (1, 4, 2, 33, 47, 32, False, 22), (1, 2, 1, 29, 29, 24, True, 23)],
)
def test_bf16_on_the_interpreter_meets_the_flash_attention_criterion(b, hq, hk, nq, nk, d, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, hq, nq, d, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(b, hk, nk, d, generator=g).bfloat16() for _ in range(2))
    ref_o = attention_float64(q, k, v, causal)[0]
    ref_grads = attention_float64_grads(q, k, v, do, causal)
    torch_o, torch_grads = _torch_bf16_attention(q, k, v, do, causal)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o = flash_attention(qg, kg, vg, causal=causal)
    o.backward(do)
    flash, bf16 = (o, qg.grad, kg.grad, vg.grad), (torch_o, *torch_grads)
    for name, ours, theirs, ref in zip(("o", "dq", "dk", "dv"), flash, bf16, (ref_o, *ref_grads), strict=True):
        ours_err, torch_err = relative_error(ours, ref), relative_error(theirs, ref)
        assert ours_err <= 2 * torch_err, f"{name}: {ours_err:.2e} against torch's bf16 {torch_err:.2e}"
