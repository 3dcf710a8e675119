"""fp32 -> bf16 on Triton's CPU interpreter, rounded to nearest even as on the GPU.

A compiled kernel converts fp32 to bf16 with the hardware's round-to-nearest-even (``cvt.rn.bf16.f32``), as
``torch.Tensor.to(torch.bfloat16)`` does. Triton's interpreter (``triton.runtime.interpreter._convert_float``)
drops the low 16 bits instead: every value whose dropped bits are more than half an ulp comes out one bf16 ulp too
small in magnitude, so bf16 results on the CPU carry a bias the GPU does not have (bf16 gradients about 2.5x
torch's own bf16 error). Its "round to nearest even" mode rounds ties up, not to even, and a NaN whose payload
sits in the low bits truncates to an infinity.

``round_to_nearest_even`` is the conversion done on the bits: add 0x7FFF plus the lowest kept bit, then keep the
top 16 bits. A carry out of the kept mantissa moves into the exponent, so the largest finite values round up to
infinity and the largest subnormals to the smallest normal, as IEEE 754 says. NaNs stay NaNs (quiet, sign kept).

``nearest_even_bf16(interpreter)`` puts that conversion in the interpreter's place for fp32 -> bf16 while a CPU
launch runs (``flashlab.kernels.interpreter.interpreted_language``) and puts Triton's own back afterwards. Other
conversions, and an explicit ``fp_downcast_rounding="rtz"``, are left to Triton (rtz keeps NaNs NaN here too).
"""

from __future__ import annotations

import contextlib

import numpy as np

SIGN_BIT = np.uint32(0x8000_0000)
EXPONENT_BITS = np.uint32(0x7F80_0000)  # fp32: all ones here and a non-zero mantissa is a NaN
QUIET_BIT = np.uint16(0x0040)  # bf16: the mantissa's top bit marks a quiet NaN


def round_to_nearest_even(x: np.ndarray) -> np.ndarray:
    """fp32 values -> the bits of the nearest bf16 (ties to even), as a uint16 array of the same shape."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lowest_kept = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lowest_kept) >> np.uint32(16)).astype(np.uint16)
    nan = (bits & ~SIGN_BIT) > EXPONENT_BITS
    return np.where(nan, (bits >> np.uint32(16)).astype(np.uint16) | QUIET_BIT, rounded).reshape(np.shape(x))


def toward_zero(x: np.ndarray) -> np.ndarray:
    """fp32 values -> the bits of the bf16 next to them toward zero (a NaN stays a quiet NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    kept = (bits >> np.uint32(16)).astype(np.uint16)
    nan = (bits & ~SIGN_BIT) > EXPONENT_BITS
    return np.where(nan, kept | QUIET_BIT, kept).reshape(np.shape(x))


def _fp32_to_bf16(convert_float, tl, rtz):
    """Triton's ``_convert_float`` with fp32 -> bf16 done by this module; every other pair by ``convert_float``."""

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return toward_zero(input) if rounding_mode == rtz else round_to_nearest_even(input)
        return convert_float(input, input_dtype, output_dtype, rounding_mode)

    convert.triton_convert_float = convert_float
    return convert


@contextlib.contextmanager
def nearest_even_bf16(interpreter):
    """While the block runs, Triton's interpreter (the module ``triton.runtime.interpreter``) converts fp32 to
    bf16 as ``round_to_nearest_even`` does; its own conversion is put back afterwards."""
    import triton.language as tl

    own = interpreter._convert_float
    if hasattr(own, "triton_convert_float"):  # already in place (a nested launch)
        yield
        return
    interpreter._convert_float = _fp32_to_bf16(own, tl, interpreter._ir.ROUNDING_MODE.RTZ)
    try:
        yield
    finally:
        interpreter._convert_float = own
