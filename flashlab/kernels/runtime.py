"""What every Triton kernel in flashlab shares: accepted inputs, configs that fit, and the CPU interpreter.

- ``DTYPES``, the head-dim limits, ``LOG2_E``: what the kernels accept and the constant their exp2 softmax uses.
- ``CPU_CONFIG``: the one small tile config every kernel runs with on CPU tensors.
- ``smem_limit`` / ``fits_smem``: the shared memory a block may use, and whether a tile config fits in it.
- ``dot_precision``: how a kernel's ``tl.dot`` treats the input dtype (exact fp32 or the tensor cores).
- ``interpreted`` / ``interpreted_language``: run a ``@triton.jit`` kernel on CPU tensors through Triton's
  interpreter, without the user setting ``TRITON_INTERPRET``, and leave ``triton.language`` as it was found.

The device functions shared by several kernels (the band's element mask, the online-softmax step) live in
``flashlab.kernels.softmax_step``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading

import numpy as np
import torch
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.kernels.interpreter_rounding import nearest_even_bf16

# Head dims the kernels accept. Non-powers of two (24, 80, 96, 160...) are padded to the next power of two
# inside the tile with masked loads; the padding columns are zeros and are never stored.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one config the CPU (interpreter) path uses: small tiles so the interpreter stays quick and even small
# test shapes cross several tiles (and so exercise every stage of a kernel's loop).
CPU_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the GPU's exp unit computes exp2


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
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors on this GPU (132 on an H200)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


# torch.cuda.current_device() and torch.cuda.is_current_stream_capturing() without their Python wrappers (which
# check CUDA's lazy initialisation on every call; the device comparison alone cost 0.4-0.8 us of a decode call on the
# H200). Only called for CUDA tensors, so CUDA is initialised already; a torch without these bindings gets the
# wrappers.
current_device_index = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


# ----------------------------------------------------------------------------------------------------------------
# Launching a compiled kernel again, without the JIT's per-call work
# ----------------------------------------------------------------------------------------------------------------

# FLASHLAB_FAST_LAUNCH=0 turns the direct launches off (every launch then goes through Triton's JIT as usual);
# FLASHLAB_FAST_LAUNCH=triton keeps them on Triton's own launcher instead of flashlab's (direct_launch), to compare.
FAST_LAUNCH = os.environ.get("FLASHLAB_FAST_LAUNCH", "1") != "0"
NATIVE_LAUNCH = os.environ.get("FLASHLAB_FAST_LAUNCH", "1") != "triton"


class FastLaunch:
    """A compiled Triton kernel relaunched directly through its launcher.

    Every ``kernel[grid](*args)`` call binds ~30 arguments to the kernel's signature, computes their
    specialisation (dtype, 16-byte alignment, value 1) and a cache key from it, looks the compiled kernel up, and
    only then calls the driver -- tens of microseconds of Python for a decode step whose GPU work is a few. When
    the same call signature comes back (a decode loop), everything but the tensors is the same, so this keeps
    the compiled kernel's launcher, its bound argument values (from Triton's own binder, in the order Triton's
    own launch passes them), and the slots where tensors go; a launch fills the slots and calls the launcher, as
    ``JITFunction.run`` does at its end. Built only when no launch hooks are set (profilers use them). Callers
    check a new FastLaunch against an ordinary launch once before relying on it.

    ``build`` goes one step further where it can: the parameter block packed once, launched by flashlab's own
    few lines of C (``flashlab.kernels.direct_launch``), which skip the per-launch parsing of Triton's launcher.
    Both are called the same way, ``launch(stream, *tensors)``.
    """

    __slots__ = ("launcher", "function", "metadata", "grid", "values", "slots", "tail")

    def __init__(self, launcher, function, metadata, grid, values, slots):
        self.launcher, self.function, self.metadata = launcher, function, metadata
        self.grid, self.values, self.slots = grid, values, slots
        # flashlab's kernels take their tensors first: then a launch passes them followed by the fixed values
        self.tail = tuple(values[len(slots) :]) if slots == tuple(range(len(slots))) else None

    @classmethod
    def build(cls, jit_function, kernel, grid, args, kwargs, tensor_names, global_scratch=False, native_only=False):
        """From the CompiledKernel ``kernel`` that ``jit_function[grid](*args, **kwargs)`` just returned; None
        where this Triton does not look as expected (then the caller keeps launching through the JIT).
        ``global_scratch``: the caller can pass the kernel's global scratch to flashlab's launcher
        (``direct_launch.build``); Triton's launcher allocates its own. ``native_only``: flashlab's launcher or
        None, never Triton's (a kernel taking host-side tensor descriptors: a launch passes the tensors they
        describe, which only flashlab's launcher encodes)."""
        if not FAST_LAUNCH or kernel is None:
            return None
        try:
            from triton import knobs

            for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
                if hook is not None and getattr(hook, "calls", None) != []:  # None, or a HookChain with no calls
                    return None
            binder = jit_function.device_caches[torch.cuda.current_device()][-1]
            bound, _, _ = binder(*args, **kwargs)
            names = list(bound)
            slots = tuple(names.index(n) for n in tensor_names)
            grid = tuple(grid) + (1,) * (3 - len(grid))
            values = list(bound.values())
            launch = None
            if NATIVE_LAUNCH and list(getattr(getattr(kernel, "src", None), "signature", ())) == names:
                from flashlab.kernels import direct_launch

                # the slots' values are read for a descriptor's shape only; the packing keeps no reference
                launch = direct_launch.build(kernel, grid, values, slots, global_scratch)
            if launch is not None or native_only:
                return launch
            for slot in slots:  # hold no reference to this call's tensors (a KV cache may be gigabytes)
                values[slot] = None
            return cls(kernel.run, kernel.function, kernel.packed_metadata, grid, values, slots)
        except Exception:  # noqa: BLE001 -- any surprise: launch through the JIT instead
            return None

    def __call__(self, stream, *tensors):
        g0, g1, g2 = self.grid
        if self.tail is not None and len(tensors) == len(self.slots):
            self.launcher(g0, g1, g2, stream, self.function, self.metadata, None, None, None, *tensors, *self.tail)
            return
        values = self.values.copy()
        for slot, t in zip(self.slots, tensors, strict=True):
            values[slot] = t
        self.launcher(g0, g1, g2, stream, self.function, self.metadata, None, None, None, *values)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (a NaN equals the same NaN; 0.0 and -0.0 differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def reproduces(launch_into, o: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether ``launch_into(o2, lse2)``, a direct launch writing fresh tensors like ``o`` and ``lse``, gives the
    bits a launch through Triton just wrote to ``o`` and ``lse``; False on any error (a launcher that does not
    take these arguments). How every plan checks its direct launch once before using it."""
    o2, lse2 = torch.empty_like(o), torch.empty_like(lse)
    try:
        launch_into(o2, lse2)
        return same_bits(o2, o) and same_bits(lse2, lse)
    except Exception:  # noqa: BLE001 -- any failure: the caller keeps launching through Triton
        return False


@functools.cache
def _stream_getter():
    from triton.runtime import driver

    return driver.active.get_current_stream


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream on that device: the one Triton's own launches use."""
    return _stream_getter()(device_index)


# ----------------------------------------------------------------------------------------------------------------
# Scratch memory a launch needs only while it runs
# ----------------------------------------------------------------------------------------------------------------

_SCRATCH: dict = {}  # (device index, stream handle) -> (float32 workspace, int32 counters)
_FRESH = [0]  # > 0 inside fresh_scratch()
# Raised whenever a stream's kept scratch is replaced: views cut from the kept scratch (split_kv.workspace keeps
# them on a plan) are still the stream's while the epoch they were cut in is the current one.
SCRATCH_EPOCH = [0]


def reusing_scratch() -> bool:
    """Whether launches now take the stream's kept scratch (not inside ``fresh_scratch()``, not capturing)."""
    return not _FRESH[0] and not stream_capturing()


def scratch(device: torch.device, stream: int, floats: int, counters: int):
    """``(work, counters, kept)``: a float32 workspace of at least ``floats`` elements and ``counters`` int32 counters
    that are zero between launches, for the kernels of one call on ``stream`` (``current_stream``'s handle), and
    whether they are the stream's kept scratch (False: fresh, to be dropped after the call).

    Kept per stream and grown when a call needs more: launches on one stream run one after another, so each call
    may reuse what the previous one left, and a decode step allocates nothing for it. The split-KV kernels use it
    for their chunks' partial results and for the counters that let the last chunk merge them (each program that
    raises a counter to its end puts it back to zero), and for a log-sum-exp nobody asked for. While a CUDA graph
    is being captured, inside ``fresh_scratch()``, and on the CPU, the memory is fresh instead (a graph keeps its
    own).
    """
    if _FRESH[0] or device.type != "cuda" or stream_capturing():
        work = torch.empty(floats, dtype=torch.float32, device=device)
        return work, torch.zeros(counters, dtype=torch.int32, device=device), False
    key = (device.index, stream)
    have = _SCRATCH.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < counters:
        if have is not None:
            floats, counters = max(floats, have[0].numel()), max(counters, have[1].numel())
        SCRATCH_EPOCH[0] += 1
        have = _SCRATCH[key] = (
            torch.empty(floats, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device),
            True,
        )
    return have


@contextlib.contextmanager
def fresh_scratch():
    """Launches inside take fresh scratch memory instead of the stream's: for the registered operators, whose
    calls torch.compile's CUDA-graph mode runs once to warm up with its own memory pool, and which must then
    leave nothing of that pool alive."""
    _FRESH[0] += 1
    try:
        yield
    finally:
        _FRESH[0] -= 1


# ----------------------------------------------------------------------------------------------------------------
# Triton's interpreter, on demand
# ----------------------------------------------------------------------------------------------------------------

_INTERPRETED: dict = {}
# The interpreter patches module-level state of triton.language while it runs; two threads interleaving their
# patches and restores would corrupt it, so CPU launches run one at a time.
_INTERPRETER_LOCK = threading.RLock()


def interpreted(kernel):
    """The same ``@triton.jit`` source, run by Triton's interpreter (NumPy) instead of being compiled."""
    return _interpreted_copy(kernel)


def _interpreted_copy(jit_function):
    # keyed by the Python function: hashing a JITFunction computes its cache key, which walks its dependencies
    if jit_function.fn not in _INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETED[jit_function.fn] = InterpretedFunction(jit_function.fn)
    return _INTERPRETED[jit_function.fn]


@contextlib.contextmanager
def interpreted_language(*device_modules):
    """Let the interpreter call ``@triton.jit`` device functions: Triton's own (``tl.max``, ``tl.sum``...) and
    those of ``device_modules`` (flashlab's shared helpers).

    With ``TRITON_INTERPRET=1`` set before import, Triton builds those as interpreted functions; here the
    environment variable is not set, so for the duration of a CPU launch each of them is swapped for an
    interpreted copy of its source, and put back afterwards. Launches from several threads run one at a time.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    try:  # imported lazily by the interpreter's first launch; it must see the library un-swapped
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # pragma: no cover - older Triton
        pass
    with _INTERPRETER_LOCK, nearest_even_bf16(interpreter):  # fp32 -> bf16 rounded as on the GPU
        # The interpreter patches triton.language so its builtins compute with NumPy. Its own scope undoes the
        # patches of the kernel, but each nested device-function call (tl.max, tl.sum...) patches again and never
        # undoes it, which left tl.core's builtins on the interpreter: a later GPU compile in the same process then
        # failed. Everything the interpreter may patch is snapshotted here and put back afterwards; that snapshot
        # also puts back the device functions swapped just below.
        before = _language_state(device_modules)
        for module in (tl, tl.standard, *device_modules):
            for name, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, name, _interpreted_copy(value))
        # Triton 3.6 turns a scalar into a Python int with int(array of shape (1,)), which NumPy >= 2.5 refuses;
        # loop bounds `range(lo, hi, BLOCK_N)` need it. Re-patch tensor.__index__ after the interpreter patches it.
        patch_tensor = interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interpreter._patch_lang_tensor = _patch_lang_tensor
        try:
            yield
        finally:
            interpreter._patch_lang_tensor = patch_tensor
            restore_language_state(before)


def language_objects(device_modules=()):
    """The modules and classes of triton.language that Triton's interpreter patches while it runs a kernel."""
    classes = [c for _, c in inspect.getmembers(tl.core, inspect.isclass) if c.__module__.startswith("triton.language")]
    return [tl, tl.core, tl.math, tl.standard, *classes, *device_modules]


def _language_state(device_modules=()):
    return [(obj, dict(vars(obj))) for obj in language_objects(device_modules)]


def restore_language_state(state):
    """Put every attribute back as it was in ``state`` (from ``_language_state``), and drop the ones added to a
    class since. Names added to a module stay: the interpreter's rewritten functions look up globals it adds."""
    missing = object()
    for obj, saved in state:
        now = dict(vars(obj))
        for name, value in now.items():
            if name not in saved:
                if not inspect.ismodule(obj):
                    delattr(obj, name)
            elif saved[name] is not value:
                setattr(obj, name, saved[name])
        for name, value in saved.items():
            if now.get(name, missing) is missing:
                setattr(obj, name, value)


__all__ = [
    "CPU_CONFIG",
    "DTYPES",
    "FAST_LAUNCH",
    "FastLaunch",
    "NATIVE_LAUNCH",
    "fresh_scratch",
    "HEAD_DIM_MULTIPLE",
    "LOG2_E",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "block_d",
    "cdiv",
    "current_device_index",
    "current_stream",
    "device_index",
    "dot_precision",
    "dot_upcast",
    "fits_smem",
    "interpreted",
    "interpreted_language",
    "language_objects",
    "next_power_of_2",
    "reproduces",
    "restore_language_state",
    "reusing_scratch",
    "same_bits",
    "SCRATCH_EPOCH",
    "scratch",
    "sm_count",
    "smem_limit",
    "stream_capturing",
]
