"""How close is close enough: the one tolerance table flashlab checks attention outputs with.

Every comparison of an attention output against the float64 reference -- the kernel tests on CPU and GPU, the
benchmark's check before it times, the SDPA probe, the notebooks -- uses ``TOLERANCE`` and ``relative_error``.
"""

from __future__ import annotations

import numpy as np

# Dtype names as torch spells them (``str(torch.bfloat16) == "torch.bfloat16"``, without the prefix).
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
# The short names the benchmark's command line and result files use.
SHORT_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Relative error ||out - ref|| / ||ref|| allowed against the float64 reference, per input dtype. A few times the
# dtype's unit roundoff (fp16 2^-11 ~ 4.9e-4, bf16 2^-8 ~ 3.9e-3): attention sums many rounded terms and rounds P
# and O to 16 bits, so its error sits a little above one rounding (measured on the H200: bf16 3.0-3.7e-3, fp16
# 3.7-4.6e-4). float32 inputs take exact fp32 products in flashlab's kernels (no TF32). A wrong answer (a missed
# mask, a lost rescale) is off by 1e-1 or more.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.5e-2, "float32": 1e-5, "float64": 1e-10}

# The same measure for the gradients dQ, dK, dV of attention, per input dtype. Gradients need more room than the
# output: dS = P * (dP - delta) subtracts two nearly equal numbers per element (delta is the P-weighted mean of dP),
# which magnifies the rounding of P, dP and O; and a 16-bit kernel rounds dS itself to 16 bits before its last two
# products. fp32 keeps exact fp32 products, but the cancellation still costs about a digit over the forward's 1e-5.
# A wrong gradient (a missed mask, a dropped head of a GQA group) is off by 1e-1 or more.
GRAD_TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-5, "float64": 1e-9}


def dtype_name(dtype) -> str:
    """``torch.bfloat16``, ``np.float32``, ``"float16"`` -> the name ``TOLERANCE`` is keyed by."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__ == "torch":  # torch.dtype (this module does not import torch)
        name = str(dtype).removeprefix("torch.")
    else:
        name = np.dtype(dtype).name
    if name not in TOLERANCE:
        raise TypeError(f"no tolerance for dtype {dtype!r}; flashlab checks {', '.join(DTYPE_NAMES)}")
    return name


def tolerance(dtype) -> float:
    """The allowed relative error for outputs computed from inputs of ``dtype``."""
    return TOLERANCE[dtype_name(dtype)]


def grad_tolerance(dtype) -> float:
    """The allowed relative error for gradients computed from inputs of ``dtype``."""
    return GRAD_TOLERANCE[dtype_name(dtype)]


def _float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (this module does not import torch)
        return x.detach().double().cpu().numpy()
    return np.asarray(x, np.float64)


def relative_error(out, ref) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius norms) in float64, for torch tensors or NumPy arrays.

    A zero reference gives the absolute error ``||out||``. NaN anywhere gives NaN, which fails every ``<=``.
    """
    out, ref = _float64(out), _float64(ref)
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {out.shape} vs {ref.shape}")
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return float(diff / denom) if denom > 0 else float(diff)
