"""What the Triton kernels accept and what they ask of the device they run on.

- ``DTYPES``, the head-dim limits, ``LOG2_E``: what the kernels accept and the constant their exp2 softmax uses.
- ``CPU_CONFIG``: the one small tile config every kernel runs with on CPU tensors (Triton's interpreter).
- ``kernel_band``: the band and scale of a call as the kernels take them (written once, for every kernel).
- ``block_d``: the tile width a head dim is padded to.
- ``smem_limit`` / ``fits_smem``: the shared memory a block may use, and whether a tile config fits in it.
- ``sm_count``, ``device_index``, ``current_device_index``, ``stream_capturing``: device queries.
- ``dot_precision`` / ``dot_upcast``: how a kernel's ``tl.dot`` treats the input dtype (exact fp32 or the tensor
  cores), and the interpreter's fp32 feed for 16-bit tiles.

The device functions shared by several kernels (the band's element mask, the online-softmax step) live in
``flashlab.kernels.softmax_step``; running a kernel on CPU tensors, in ``flashlab.kernels.interpreter``.
"""

from __future__ import annotations

import functools
import math

import torch

from flashlab.core.integers import next_power_of_2
from flashlab.core.masking import visible_band

# Head dims the kernels accept. Non-powers of two (24, 80, 96, 160...) are padded to the next power of two
# inside the tile with masked loads; the padding columns are zeros and are never stored.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one config the CPU (interpreter) path uses: small tiles so the interpreter stays quick and even small
# test shapes cross several tiles (and so exercise every stage of a kernel's loop).
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the GPU's exp unit computes exp2


def kernel_band(nq: int, nk: int, d: int, causal: bool, window, scale):
    """The band and scale of a checked call as every kernel takes them: ``(offset, win_left, win_right, qk_scale,
    negate)``. Query i sees keys ``[i + offset - win_left, i + offset + win_right]`` (``flashlab.core.masking``,
    bottom-right aligned), an unbounded side becoming a distance wider than the matrix (so never past int32);
    ``qk_scale`` is ``|scale| * log2(e)`` (``scale`` None: ``1/sqrt(D)``). A negative scale runs as ``-q`` with
    ``-scale`` (exact; ``negate``), because the running max assumes ``max(s) * scale = max(s * scale)``."""
    offset, left, right = visible_band(nq, nk, causal, window)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)  # a Python float (np.float32 too)
    big = nq + nk + 1  # "unbounded" side of the band: wider than any distance in the score matrix
    win_left = big if left == float("inf") else min(int(left), big)
    win_right = big if right == float("inf") else min(int(right), big)
    return offset, win_left, win_right, abs(scale) * LOG2_E, scale < 0


def block_d(head_dim: int) -> int:
    """The tile width a head dim is padded to: a power of two, at least 16 (the tensor cores' smallest K)."""
    return max(16, next_power_of_2(head_dim))


def dot_precision(dtype, is_cuda: bool) -> str:
    """``tl.dot``'s input precision: exact ("ieee") for fp32 inputs and on the interpreter, else "tf32" (which the
    tensor cores ignore for 16-bit inputs, whose products are exact)."""
    return "ieee" if dtype == torch.float32 or not is_cuda else "tf32"


def dot_upcast(dtype, is_cuda: bool) -> bool:
    """Interpreter only: feed 16-bit tiles to the dots as fp32 (NumPy has no bf16 matmul). Exact: a 16-bit value
    is also an fp32 value, and the tensor cores multiply them exactly too."""
    return not is_cuda and dtype != torch.float32


@functools.cache
def smem_limit(device_index: int) -> int:
    """Bytes of shared memory one block may use on this GPU (the opt-in maximum)."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) or 101376


def fits_smem(resident_rows: int, streamed_rows: int, stages: int, block_d: int, element_size: int, limit: int):
    """Whether a tile config fits: ``resident_rows`` x block_d elements held for the whole loop (the Q tile) plus
    ``stages`` pipelined copies of ``streamed_rows`` x block_d (the K and V tiles of one step)."""
    return (resident_rows * block_d + stages * streamed_rows * block_d) * element_size <= limit


@functools.cache
@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors on this GPU (132 on an H200); asked of the driver once per device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


# torch.cuda.current_device() and torch.cuda.is_current_stream_capturing() without their Python wrappers (which
# check CUDA's lazy initialisation on every call; the device comparison alone cost 0.4-0.8 us of a decode call on the
# H200). Only called for CUDA tensors, so CUDA is initialised already; a torch without these bindings gets the
# wrappers.
current_device_index = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _allocator(size: int, alignment: int, stream):
    """Global scratch for the tensor descriptors a kernel's programs build (128 bytes each), as Triton asks."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


TMA_MIN_CAPABILITY = 9  # the tensor-memory accelerator and warp specialisation: Hopper (sm_90) or newer
TMA_ALIGN_BYTES = 16  # a TMA descriptor's base address and every stride but the last must be multiples of this


def rows_stacked(x: torch.Tensor) -> bool:
    """Whether ``x`` (B, H, N, D) is one 2-D tensor of B*H*N rows the copy engine can describe: heads and batches
    one after another at the row stride, rows 16-byte aligned, unit stride along D."""
    b, h, n, _ = x.shape
    row = x.stride(2) if n > 1 else x.shape[3]
    if x.stride(3) != 1 or x.data_ptr() % TMA_ALIGN_BYTES or row * x.element_size() % TMA_ALIGN_BYTES:
        return False
    heads_stacked = h == 1 or x.stride(1) == n * row
    return heads_stacked and (b == 1 or x.stride(0) == h * n * row)


def hidden_sides(nq: int, nk: int, band) -> tuple[bool, bool]:
    """Whether the band hides real keys from some query row on its left (the window's left edge) and on its right
    (the diagonal or the window's right edge). Query i sees keys ``[i + offset - win_left, i + offset + win_right]``."""
    offset, win_left, win_right, _ = band
    return nq - 1 + offset - win_left > 0, offset + win_right < nk - 1


def ensure_allocator():
    """Device-side tensor descriptors need somewhere to live: install an allocator unless the user has set one."""
    import triton
    from triton.runtime import _allocation

    current = _allocation._allocator.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_allocator)


__all__ = [
    "TMA_ALIGN_BYTES",
    "TMA_MIN_CAPABILITY",
    "ensure_allocator",
    "hidden_sides",
    "rows_stacked",
    "CPU_CONFIG",
    "DTYPES",
    "HEAD_DIM_MULTIPLE",
    "LOG2_E",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "block_d",
    "current_device_index",
    "device_index",
    "dot_precision",
    "dot_upcast",
    "fits_smem",
    "kernel_band",
    "sm_count",
    "smem_limit",
    "stream_capturing",
]
