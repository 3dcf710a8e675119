"""Launching a compiled Triton kernel again without the JIT's per-call work.

- ``FastLaunch``: a compiled kernel relaunched through its launcher (flashlab's own, ``direct_launch``, where it
  can), with the arguments of one call signature bound once.
- ``reproduces`` / ``same_bits``: the check every plan makes once before it relies on a direct launch.
- ``current_stream``: the raw handle of the stream Triton's own launches use.
"""

from __future__ import annotations

import functools
import os

import torch

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
    few lines of C (``flashlab.host.direct_launch``), which skip the per-launch parsing of Triton's launcher.
    Both are called the same way, ``launch(stream, *tensors)``; built with ``runtime`` (the names of scalar
    parameters, for a kernel compiled once for a bucket of lengths), both are ``launch(stream, grid, values,
    *tensors)``: this launch's grid and the values of those parameters, in that order.
    """

    __slots__ = ("launcher", "function", "metadata", "grid", "values", "slots", "tail", "runtime")

    def __init__(self, launcher, function, metadata, grid, values, slots, runtime=()):
        self.launcher, self.function, self.metadata = launcher, function, metadata
        self.grid, self.values, self.slots, self.runtime = grid, values, slots, runtime
        # flashlab's kernels take their tensors first: then a launch passes them followed by the fixed values
        self.tail = tuple(values[len(slots) :]) if slots == tuple(range(len(slots))) else None

    @classmethod
    def build(cls, jit_function, kernel, grid, args, kwargs, tensor_names, global_scratch=False, native_only=False,
              runtime=None):  # fmt: skip
        """From the CompiledKernel ``kernel`` that ``jit_function[grid](*args, **kwargs)`` just returned; None
        where this Triton does not look as expected (then the caller keeps launching through the JIT).
        ``global_scratch``: the caller can pass the kernel's global scratch to flashlab's launcher
        (``direct_launch.build``); Triton's launcher allocates its own. ``native_only``: flashlab's launcher or
        None, never Triton's (a kernel taking host-side tensor descriptors: a launch passes the tensors they
        describe, which only flashlab's launcher encodes). ``runtime``: the names of the parameters each launch
        passes (see the class docstring); None: every scalar fixed at this launch's value."""
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
            positions = None if runtime is None else tuple(names.index(n) for n in runtime)
            grid = tuple(grid) + (1,) * (3 - len(grid))
            values = list(bound.values())
            launch = None
            if NATIVE_LAUNCH and list(getattr(getattr(kernel, "src", None), "signature", ())) == names:
                from flashlab.host import direct_launch

                # the slots' values are read for a descriptor's shape only; the packing keeps no reference
                launch = direct_launch.build(kernel, grid, values, slots, global_scratch, positions)
            if launch is not None or native_only:
                return launch
            for slot in slots:  # hold no reference to this call's tensors (a KV cache may be gigabytes)
                values[slot] = None
            fast = cls(kernel.run, kernel.function, kernel.packed_metadata, grid, values, slots, positions or ())
            return fast if runtime is None else fast.launch_with
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

    def launch_with(self, stream, grid, runtime_values, *tensors):
        """One launch on ``grid`` with the runtime parameters' values ``runtime_values`` (in ``runtime``'s order)."""
        g0, g1, g2 = tuple(grid) + (1,) * (3 - len(grid))
        values = self.values.copy()
        for slot, t in zip(self.slots, tensors, strict=True):
            values[slot] = t
        for position, x in zip(self.runtime, runtime_values, strict=True):
            values[position] = x
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


__all__ = ["FAST_LAUNCH", "FastLaunch", "NATIVE_LAUNCH", "current_stream", "reproduces", "same_bits"]
