"""What the Gluon kernels for Hopper share: the forward's rung 4 (``ladder.rung4_overlap``) and the backward's
rungs 5 and 6 (``backward.rung5_one_pass``). Whether this Triton has Gluon's Hopper primitives at all
(``GLUON_ERROR``), the bulk copies' names across Triton versions, a wgmma accumulator's layout, and the copy
engine's host-side tensor descriptors: which tensors it can describe (``not_describable``) and the descriptor of a
tensor copied in tiles (``descriptor``)."""

from __future__ import annotations

import torch
import triton

from flashlab.kernels.device import TMA_ALIGN_BYTES

try:  # Gluon's Hopper primitives (Triton >= 3.5)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # float32: the backward's dQ sums, added to by the copy engine
    GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
                 torch.float32: gl.float32}  # fmt: skip
    GLUON_ERROR = None
except ImportError as error:  # an older Triton: the kernels say so in their ``unavailable``
    GLUON_ERROR = f"Triton {triton.__version__} has no Gluon Hopper primitives ({error})"

CAPABILITY = 9  # wgmma is sm_90's instruction: Hopper only (Blackwell has its own, tcgen05)

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin

    # the bulk copies' names: async_load / async_store in newer Tritons (3.9), async_copy_* in older ones (3.6)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @_gluon_builtin
    def _reduce_add_36(tensor_desc, coord, src, _semantic=None):
        """The copy engine's bulk add of a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor``),
        which Triton 3.6's Gluon builds but does not name."""
        from triton._C.libtriton import ir

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)  # fmt: skip

    # the bulk add's name: async_atomic_add in newer Tritons (3.9)
    tma_reduce_add = getattr(tma, "async_atomic_add", None) or _reduce_add_36

    @triton.constexpr_function
    def mma_layout(n, bits=16):
        """The accumulator layout of a 64-row wgmma over four warps with an N of ``n``, on operands of ``bits``
        bits (one instruction's K: 32 bytes of them)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 256 // bits])

    @gluon.jit
    def key_range(row_lo, NQ, NK, offset, win_left, win_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr):  # fmt: skip
        """The key tiles ``[j0, j1)`` the query tile starting at row ``row_lo`` reads: all of them; causal, up to
        its last row's diagonal; with a window, those the band ``[i + offset - win_left, i + offset + win_right]``
        of any of its rows reaches."""
        j0 = 0
        j1 = (NK + BLOCK_N - 1) // BLOCK_N
        if WINDOW:
            row_hi = gl.minimum(row_lo + BLOCK_M, NQ) - 1
            j0 = gl.maximum(row_lo + offset - win_left, 0) // BLOCK_N
            j1 = (gl.minimum(row_hi + offset + win_right + 1, NK) + BLOCK_N - 1) // BLOCK_N
        elif CAUSAL:
            j1 = gl.minimum((row_lo + BLOCK_M + offset + BLOCK_N - 1) // BLOCK_N, j1)
        return j0, j1


def strides(x, given=None) -> list[int]:
    """``x``'s strides (``given``: its ``stride()``, where the caller has them) as its descriptor takes them: a
    dimension of size 1 is only ever read at 0, so its stride is free; it gets a contiguous tensor's (an expanded or
    sliced tensor may carry any stride there)."""
    shape = x.shape
    given = x.stride() if given is None else given
    if 1 not in shape:
        return list(given)
    contiguous = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1]
    return [s if n > 1 else c for s, n, c in zip(given, shape, contiguous, strict=True)]


def not_here(x) -> str | None:
    """Why a Gluon Hopper kernel cannot run on ``x``'s device here, or None: this Triton has no Gluon, ``x`` is
    on the CPU (Gluon has no interpreter), or the GPU is no Hopper."""
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if not x.is_cuda:
        return "it is written in Gluon, which compiles for a GPU only (no interpreter)"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != CAPABILITY:
        return f"its matrix products are Hopper's wgmma: it needs compute capability 9.x, not {major}.{minor}"
    return None


def first_not_describable(**tensors) -> str | None:
    """Why the copy engine cannot read the first of ``tensors`` (by name) that it cannot describe, or None."""
    for name, x in tensors.items():
        why = not_describable(x)
        if why is not None:
            return f"its copy engine cannot describe {name}: {why}"
    return None


def not_describable(x) -> str | None:
    """Why the copy engine (a 4-D tensor descriptor over B, H, N, D) cannot read ``x``, or None: it needs unit
    stride along D, the other strides and the start at multiples of 16 bytes."""
    x_strides = strides(x)
    if x_strides[3] != 1:
        return f"its head dim is strided ({x.stride(3)}), not contiguous"
    if x.data_ptr() % TMA_ALIGN_BYTES:
        return f"it starts {x.data_ptr() % TMA_ALIGN_BYTES} bytes past a 16-byte boundary"
    if any(s * x.element_size() % TMA_ALIGN_BYTES for s in x_strides[:3]):
        return f"its strides {tuple(x.stride())} are not all multiples of 16 bytes"
    return None


_LAYOUTS = {}  # (tile shape, dtype) -> the shared-memory layout of a copied tile (a wgmma operand's swizzle)


def shared_layout(block: list[int], dtype):
    """The shared-memory layout the copy engine writes (or reads) a tile of shape ``block`` of ``dtype`` in."""
    key = (tuple(block), dtype)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])
    return _LAYOUTS[key]


def tile_descriptor(x, block):
    """A host-side tensor descriptor of a contiguous ``x`` copied (or added to) in tiles of shape ``block``."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block), shared_layout(block, x.dtype))


def descriptor(x, block_rows, block_cols=None):
    """A host-side tensor descriptor of ``x`` (B, H, N, D) with its own strides, copied ``block_rows`` rows (of
    ``block_cols`` columns, by default all D) of one head at a time: rows past the head's end come in as zeros and
    are not written back. Passed by value with the launch: the programs build none themselves."""
    block = [1, 1, block_rows, x.shape[3] if block_cols is None else block_cols]
    return TensorDescriptor(x, list(x.shape), strides(x), block, shared_layout(block, x.dtype))


__all__ = [
    "CAPABILITY",
    "GLUON_ERROR",
    "descriptor",
    "first_not_describable",
    "not_describable",
    "not_here",
    "shared_layout",
    "strides",
    "tile_descriptor",
]
