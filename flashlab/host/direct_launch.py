"""Launching a compiled Triton kernel with its parameter block packed once: ``launcher.c``, built at first use.

``launcher.FastLaunch`` relaunches a kernel a decode loop calls again and again. Through Triton's own launcher that
still parses every argument from Python and checks every pointer with the driver, on every launch (about 8 us of
host time on the H200's host, most of a decode step's). Here the scalars are packed into the kernel's parameter
block once, from the compiled kernel's signature; a launch writes the tensors' addresses and calls
``cuLaunchKernel``.

A kernel that takes host-side tensor descriptors (Gluon's, for the copy engine) gets each as Triton's launcher
passes it: the tensor map (a CUtensorMap by value), then the shape and strides. All of it but the tensor's address
is fixed by the signature, so the map's encoding arguments are packed once and the launcher encodes the map from
the address on every launch (``cuTensorMapEncodeTiled``, as Triton's launcher does).

A launch of a kernel compiled once for a whole bucket of lengths (``flashlab.host.plan``) passes, besides the
tensors, its grid and the values of the scalar parameters named when it was built (``pack_runtime``, then
``launch_with(stream, grid, values, *tensors)``): lengths, offsets, strides; for a tensor map named so, the dims
and byte strides its encoding takes and the shape and stride cells that follow it (``map_values`` gives them from a
tensor). Everything else stays packed once.

Used only where it is exactly right: every parameter is a pointer, a plain scalar or such a descriptor, the kernel
needs no scratch memory from Triton, no cluster, no cooperative or programmatic launch, and the driver confirms
the size of every parameter of the compiled function (``cuFuncGetParamInfo``). Otherwise ``build`` returns None
and Triton's launcher is used; its callers also check a direct launch against a launch through Triton once, bit
for bit.
"""

from __future__ import annotations

import functools
import struct
import threading
from importlib import resources

import torch

# Scalar parameter types of a Triton signature, as ``struct`` packs them (little-endian, the kernel's sizes).
_SCALAR_FORMATS = {
    "i1": "<b", "i8": "<b", "u1": "<B", "u8": "<B", "i16": "<h", "u16": "<H", "i32": "<i", "u32": "<I",
    "i64": "<q", "u64": "<Q", "fp16": "<e", "fp32": "<f", "f32": "<f", "fp64": "<d",
}  # fmt: skip


_NATIVE_LOCK = threading.Lock()  # one build, whichever thread asks first; the others wait for it
_PREPARED = []


def native():
    """The compiled ``launcher.c`` module, or None where it cannot be built here (no C compiler, no Triton)."""
    with _NATIVE_LOCK:
        return _native()


def prepare():
    """Start building ``native()``'s module in a thread, once a process: a first GPU call compiles its kernel
    meanwhile (the C compiler's half second then overlaps Triton's compile instead of following it)."""
    if not _PREPARED:
        _PREPARED.append(True)
        threading.Thread(target=native, name="flashlab-launcher-build", daemon=True).start()


@functools.cache
def _native():
    try:
        from triton.runtime.build import compile_module_from_src

        source = resources.files("flashlab.host").joinpath("launcher.c").read_text()
        return compile_module_from_src(source, "flashlab_launcher")
    except Exception:  # noqa: BLE001 -- no compiler, an unexpected Triton: Triton's launcher is used instead
        return None


MAP_BYTES = 128  # sizeof(CUtensorMap): a tensor map parameter's size


def _tensor_map(descriptor, meta, param):
    """``launcher.make``'s entry for a tensor map parameter ``param`` encoded from ``descriptor``'s address:
    ``(param, dtype, swizzle, fill, dims, strides, box)`` with the driver's enums and its order (innermost
    dimension first, strides in bytes), as Triton's launcher encodes it from the kernel's ``tensordesc_meta``; None
    where this Triton's descriptors are not as expected."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    if meta is None or meta.get("fp4_padded") or meta.get("is_im2col") or list(descriptor.strides)[-1] != 1:
        return None  # packed sub-byte types, im2col maps: not encoded here
    if getattr(descriptor, "round_f32_to_tf32", False):
        return None
    elem = meta["elem_size"]
    dims = tuple(int(n) for n in reversed(descriptor.shape))
    strides = tuple(int(s) * elem for s in reversed(list(descriptor.strides)[:-1]))
    box = tuple(int(n) for n in reversed(meta["block_size"]))
    fill = 1 if getattr(descriptor, "padding", "zero") == "nan" else 0
    return (param, TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["swizzle"], fill, dims, strides, box)


def pack(types, values, tensor_slots, scratch_slot=False, tensordesc_meta=None):
    """The parameter block of one launch: ``(cells, sizes, tensor_params)`` for ``launcher.make``, or None when a
    parameter is of a kind not packed here.

    ``types`` and ``values`` are the kernel's arguments in signature order (Triton's types: "*bf16", "i32",
    "fp32", "constexpr", "tensordesc<...>"...); ``tensor_slots`` the argument positions whose tensors change from
    launch to launch. Constexprs are not parameters. Every pointer must be such a slot, and so must every tensor
    descriptor: its value is the descriptor of this launch, ``tensordesc_meta`` the compiled kernel's list of
    their encodings (one per descriptor argument, in order); a launch passes the tensor it describes. Two pointers
    follow the arguments, as Triton's own launcher passes them: its global and profiling scratch, null here; with
    ``scratch_slot`` the global scratch is one more tensor, after the slots'."""
    packed = pack_runtime(types, values, tensor_slots, (), scratch_slot, tensordesc_meta)
    return None if packed is None else packed[:3]


# The kinds of launcher.c's runtime values: a scalar parameter, or a tensor map slot's dim or byte stride.
RT_I32, RT_I64, RT_F32, RT_MAP_DIM, RT_MAP_STRIDE = range(5)
_RUNTIME_KINDS = {"i32": RT_I32, "i64": RT_I64, "fp32": RT_F32, "f32": RT_F32}


def pack_runtime(types, values, tensor_slots, runtime, scratch_slot=False, tensordesc_meta=None):
    """``pack``, with the argument positions ``runtime`` given per launch (``launch_with``'s values, in this
    order): ``(cells, sizes, tensor_params, runtime_entries)`` for ``launcher.make``, or None.

    A runtime position is a scalar parameter of type i32, i64 or fp32 (one value: the argument), or a tensor
    descriptor's slot (rank dims innermost first, rank - 1 byte strides innermost first, then the rank shape cells
    and rank stride cells that follow the map, in the kernel's order: ``map_values``). Any other kind, or a
    pointer, is not packed here (None)."""
    cells, sizes = [], []
    slots = set(tensor_slots)
    order = {slot: i for i, slot in enumerate(tensor_slots)}
    params_of_slot = [0] * len(tensor_slots)
    descriptors = 0  # tensor descriptor arguments so far: their index in tensordesc_meta
    wanted = {position: i for i, position in enumerate(runtime)}
    if len(wanted) != len(runtime):
        return None
    entries = [None] * len(runtime)  # per runtime position: its launcher entries
    for position, (ty, value) in enumerate(zip(types, values, strict=True)):
        if ty == "constexpr":
            if position in slots:
                return None  # a tensor specialised away (None): not a launch this packs
            continue
        if not isinstance(ty, str):
            return None  # tuples of arguments
        if ty.startswith("*"):
            if position not in slots:
                return None
            params_of_slot[order[position]] = len(cells)
            cells.append(bytes(8))
            sizes.append(8)
            continue
        if ty.startswith("tensordesc"):
            meta = tensordesc_meta[descriptors] if tensordesc_meta and descriptors < len(tensordesc_meta) else None
            descriptors += 1
            entry = _tensor_map(value, meta, len(cells)) if position in slots and value is not None else None
            if entry is None:
                return None  # a descriptor the program builds itself, or of a kind not encoded here
            params_of_slot[order[position]] = entry
            cells.append(bytes(8))  # the map, encoded by each launch
            sizes.append(MAP_BYTES)
            rank, first = len(entry[4]), len(cells)
            for n in value.shape:  # then its shape (i32) and strides (i64), as Triton's launcher passes them
                cells.append(struct.pack("<i", int(n)).ljust(8, b"\0"))
                sizes.append(4)
            for stride in value.strides:
                cells.append(struct.pack("<q", int(stride)))
                sizes.append(8)
            if position in wanted:
                slot = order[position]
                entries[wanted[position]] = (
                    [(RT_MAP_DIM, slot, j) for j in range(rank)]
                    + [(RT_MAP_STRIDE, slot, j) for j in range(rank - 1)]
                    + [(RT_I32, first + j, 0) for j in range(rank)]
                    + [(RT_I64, first + rank + j, 0) for j in range(rank)]
                )
            continue
        if ty == "bf16":
            cell = (struct.unpack("<I", struct.pack("<f", value))[0] >> 16).to_bytes(2, "little")
        elif ty in _SCALAR_FORMATS:
            cell = struct.pack(_SCALAR_FORMATS[ty], value)
        else:
            return None  # anything newer
        if position in wanted:
            if ty not in _RUNTIME_KINDS:
                return None  # a runtime value of a type the launcher does not write
            entries[wanted[position]] = [(_RUNTIME_KINDS[ty], len(cells), 0)]
        cells.append(cell.ljust(8, b"\0"))
        sizes.append(len(cell))
    if any(e is None for e in entries):
        return None  # a runtime position that is a pointer, a constexpr, or no argument
    if scratch_slot:
        params_of_slot.append(len(cells))
    for _ in ("global scratch", "profile scratch"):
        cells.append(bytes(8))
        sizes.append(8)
    runtime_entries = tuple(e for group in entries for e in group)
    return b"".join(cells), bytes(sizes), tuple(params_of_slot), runtime_entries


def map_values(shape, strides, element_size) -> tuple:
    """A tensor map runtime position's values for ``launch_with`` (``pack_runtime``'s order) for a tensor of this
    shape and these strides (elements; the last is 1): dims and byte strides innermost first, then the shape and
    the strides as the kernel's cells take them."""
    return (*shape[::-1], *[s * element_size for s in strides[-2::-1]], *shape, *strides)


def build(kernel, grid, values, tensor_slots, global_scratch=False, runtime=None):
    """A callable ``launch(stream, *tensors)`` for the CompiledKernel ``kernel`` with its arguments ``values``
    (signature order, as Triton's binder gives them: at a descriptor's slot, the descriptor) and the tensors at
    ``tensor_slots`` (at a descriptor's slot, the tensor it describes); None where this launch is not one
    ``launcher.c`` does exactly (see the module's docstring).

    A kernel that needs global scratch (device-side tensor descriptors live there) is launched only with
    ``global_scratch``: the launch then takes one more tensor, the scratch, at least ``global_scratch_bytes``.

    With ``runtime`` (argument positions, ``pack_runtime``) the callable is ``launch(stream, grid, values,
    *tensors)``: this launch's grid and runtime values, the rest as packed."""
    module = native()
    if module is None:
        return None
    try:
        meta = kernel.metadata
        needs_scratch = bool(meta.global_scratch_size)
        if (meta.num_ctas != 1 or (needs_scratch and not global_scratch) or getattr(meta, "profile_scratch_size", 0)
                or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False)):  # fmt: skip
            return None
        types = list(kernel.src.signature.values())
        tensordesc_meta = getattr(meta, "tensordesc_meta", None)
        packed = pack_runtime(types, values, tensor_slots, tuple(runtime or ()), needs_scratch, tensordesc_meta)
        if packed is None:
            return None
        g0, g1, g2 = tuple(grid) + (1,) * (3 - len(grid))
        device = torch.cuda.current_device()  # the device the JIT launch that compiled it just ran on
        handle = module.make(kernel.function, g0, g1, g2, 32 * meta.num_warps, meta.shared, *packed[:3], device,
                             packed[3])  # fmt: skip
    except Exception:  # noqa: BLE001 -- anything unexpected: Triton's launcher instead
        return None
    return functools.partial(module.launch if runtime is None else module.launch_with, handle)


def is_direct(launch) -> bool:
    """Whether ``launch`` (a ``launcher.FastLaunch.build`` result) is one of ``build``'s."""
    module = native()
    return (module is not None and isinstance(launch, functools.partial)
            and launch.func in (module.launch, module.launch_with))  # fmt: skip


def global_scratch_bytes(kernel, grid) -> int:
    """The global scratch one launch of ``kernel`` on ``grid`` needs: its programs' share each, as Triton sizes it."""
    programs = 1
    for g in grid:
        programs *= g
    return programs * kernel.metadata.num_ctas * kernel.metadata.global_scratch_size


__all__ = ["MAP_BYTES", "RT_F32", "RT_I32", "RT_I64", "RT_MAP_DIM", "RT_MAP_STRIDE", "build", "global_scratch_bytes",
           "is_direct", "map_values", "native", "pack", "pack_runtime"]  # fmt: skip
