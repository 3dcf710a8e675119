"""Triton's interpreter on demand: a ``@triton.jit`` kernel run on CPU tensors, through NumPy.

- ``interpreted(kernel)``: the same kernel source, run by Triton's interpreter instead of being compiled, without
  the user setting ``TRITON_INTERPRET``.
- ``interpreted_language(*device_modules)``: the context a CPU launch runs in, which lets the interpreter call
  ``@triton.jit`` device functions and leaves ``triton.language`` as it was found.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import numpy as np
import triton.language as tl

from flashlab.kernels.interpreter_rounding import nearest_even_bf16

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
        patch_lang = interpreter._patch_lang
        interpreter._patch_lang = _patch_once(patch_lang, interpreter._LangPatchScope)
        try:
            yield
        finally:
            interpreter._patch_lang = patch_lang
            interpreter._patch_lang_tensor = patch_tensor
            restore_language_state(before)


def _patch_once(patch_lang, empty_scope):
    """The interpreter's ``_patch_lang``, skipped where its patches are in place already.

    A kernel launch patches ``triton.language`` for its run and undoes it at the end; every call of a device
    function inside it (``tl.max``, ``tl.sum``, flashlab's helpers: a thousand in one small decode call) patched it
    again through ``inspect.getmembers``, about a quarter of the interpreter's time, to the same effect. Here a call
    whose function sees no language module beyond those patched for the running kernel changes nothing."""
    patched = None  # the language modules patched for the kernel now running; None between launches
    seen_by = {}  # function -> the language modules its globals hold

    def seen(fn):
        if fn not in seen_by:
            values = fn.__globals__.values()
            seen_by[fn] = frozenset(id(m) for m in values if inspect.ismodule(m) and (m is tl or m is tl.core))
        return seen_by[fn]

    def _patch_lang(fn):
        nonlocal patched
        langs = seen(fn)
        if patched is not None and langs <= patched:
            return empty_scope()
        scope = patch_lang(fn)
        if patched is not None:  # a device function seeing another module: its patches stay, as the interpreter's do
            patched |= langs
            return scope
        patched = set(langs)  # a launch: its scope's restore ends it
        restore = scope.restore

        def restore_and_forget():
            nonlocal patched
            patched = None
            restore()

        scope.restore = restore_and_forget
        return scope

    return _patch_lang


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


__all__ = ["interpreted", "interpreted_language", "language_objects", "restore_language_state"]
