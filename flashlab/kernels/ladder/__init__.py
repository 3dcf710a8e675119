"""The kernel ladder: flashlab's forward kernel as runnable rungs, slowest first, each removing one cost of the rung
below it. Every rung computes the same function (the float64 reference decides), takes the same inputs as
``flashlab.flash_attention`` and is tested on the same cases and timed in the same benchmark run, so a learner can
run, test and time each step on its own (``flash_attention(..., rung="lesson_loop")``, ``python -m flashlab.bench
--backends flashlab_lesson_loop,flashlab_skip_split``).

``RUNGS`` is the registry, ordered slowest to fastest. A rung is its name, one line saying what it removes, the
module that holds its kernel, and ``unavailable(q, k, v, causal, window)``: why it cannot run on these inputs and
this device, or None. The module provides

    launch(q, k, v, o, lse, causal, window, band, config=None)

which writes ``o (B, Hq, Nq, D)`` and ``lse (B, Hq, Nq)`` (float32, natural log) for inputs that the host engine
(``flashlab.host``) has checked and prepared: unit stride along D, q negated for a negative scale, and ``band = (offset,
win_left, win_right, qk_scale)`` from ``kernels.device.kernel_band``. ``config`` is None (the rung's own choice) or a
dict of BLOCK_M, BLOCK_N, num_warps, num_stages (the backward asks for small query tiles this way).

The host engine (``flashlab.host``) plans each call signature once and relaunches the rung's compiled kernel
directly; ``launch`` is the plain launch a learner reads, and what the host's first call of a signature runs.
Adding a rung is one entry in ``RUNGS``, in its place by speed; the benchmark's ``flashlab_<name>`` backend and the
tests' loop over rungs pick it up from there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder (see the module docstring)."""

    name: str
    removes: str  # one line: the cost this rung removes against the rung below it
    module: str  # where its kernel and ``launch`` live
    unavailable: Callable  # (q, k, v, causal, window) -> str | None: why it cannot run here, or None
    # (q, k, v, causal, window) -> bool: whether, among the rungs that can run these inputs, this one is the one to
    # pick by default (measured faster there); None: wherever it can run
    preferred: Callable | None = None

    def load(self):
        """The rung's module (imported on first use)."""
        return importlib.import_module(self.module)

    def launch(self, q, k, v, o, lse, causal, window, band, config=None) -> None:
        self.load().launch(q, k, v, o, lse, causal, window, band, config=config)


def runs_everywhere(q, k, v, causal, window) -> str | None:
    """``unavailable`` of a rung that runs on any input flash_attention accepts: compiled on any CUDA GPU Triton
    supports, and through Triton's interpreter on CPU tensors."""
    return None


def _imported(module: str, name: str) -> Callable:
    """``module.name`` as a function that imports the module on its first call: a GPU-only rung's module (Triton's
    Hopper and Gluon pieces) is not imported until a rung is asked where it runs."""

    def call(q, k, v, causal, window):
        return getattr(importlib.import_module(module), name)(q, k, v, causal, window)

    return call


RUNGS: tuple[Rung, ...] = (
    Rung(
        "lesson_loop",
        "nothing yet: the lesson's loop, every key tile loaded and masked element by element",
        "flashlab.kernels.ladder.rung1_lesson_loop",
        runs_everywhere,
    ),
    Rung(
        "skip_split",
        "masked-tile work: key tiles the mask hides are never loaded, tiles every row sees run without a mask",
        "flashlab.kernels.ladder.rung2_skip_split",
        runs_everywhere,
    ),
    Rung(
        "hopper",
        "load latency: whole tiles copied by the tensor-memory accelerator, issued by warps of their own",
        "flashlab.kernels.ladder.rung3_hopper",
        _imported("flashlab.kernels.ladder.rung3_hopper", "unavailable"),
        _imported("flashlab.kernels.ladder.rung3_hopper", "preferred"),
    ),
    Rung(
        "overlap",
        "the softmax's stall on the tensor cores: one warpgroup's softmax runs under the other's products",
        "flashlab.kernels.ladder.rung4_overlap",
        _imported("flashlab.kernels.ladder.rung4_overlap", "unavailable"),
        _imported("flashlab.kernels.ladder.rung4_overlap", "preferred"),
    ),
)


def names() -> tuple[str, ...]:
    return tuple(r.name for r in RUNGS)


def rung_named(name) -> Rung:
    """The rung called ``name``; a ValueError listing the names for any other string (a TypeError for a non-str)."""
    if not isinstance(name, str):
        raise TypeError(f"rung must be a rung's name or None; got {type(name).__name__}")
    for r in RUNGS:
        if r.name == name:
            return r
    raise ValueError(f"unknown rung {name!r}; the ladder's rungs are {', '.join(names())} (slowest to fastest)")


def select(name, q, k, v, causal, window) -> tuple[Rung, str | None]:
    """The rung a call runs, and a note to warn with (or None).

    ``name`` None: the fastest rung that can run these inputs on their device and is preferred for them (a rung's
    ``preferred``: where the benchmark measured it faster than the rungs below), silently. A name: that rung; where
    it cannot run, the fastest rung that can, and a note naming the rung asked for and the reason, for the caller
    to raise as a ``RuntimeWarning`` -- never a silent substitute."""
    asked = None if name is None else rung_named(name)
    why = None if asked is None else asked.unavailable(q, k, v, causal, window)
    if asked is not None and why is None:
        return asked, None
    reasons = {}
    for r in reversed(RUNGS):
        reasons[r.name] = why if r is asked else r.unavailable(q, k, v, causal, window)
        if reasons[r.name] is None:
            if asked is None:
                if r.preferred is not None and not r.preferred(q, k, v, causal, window) and r is not RUNGS[0]:
                    continue  # it can run, but a rung below it is faster here
                return r, None
            return r, f"rung {asked.name!r} cannot run here ({why}); running rung {r.name!r} instead"
    listed = "; ".join(f"{n}: {w}" for n, w in reasons.items())
    raise RuntimeError(f"no rung of the kernel ladder can run here: {listed}")


__all__ = ["RUNGS", "Rung", "names", "runs_everywhere", "rung_named", "select"]
