"""The backward's ladder: flashlab's backward kernels as runnable rungs, each removing one cost of the rung below,
as the forward's ladder (``flashlab.kernels.ladder``) holds its forward kernels.

Every rung computes the same gradients (the float64 reference decides), takes the same inputs and is tested on the
same cases, so a learner can run, test and time each step on its own: ``flash_attention(...,
backward_rung="hopper")``, ``python -m flashlab.bench --mode backward --backends flashlab,backward_hopper``. Every
rung but ``atomic_dq`` is deterministic (each gradient element written once, by one program, in a fixed order: the
same inputs give bit-identical gradients), and the default is always one of those.

``BACKWARD_RUNGS`` is the registry, in the order the rungs build on each other; the benchmark decides which is fastest
where (on Triton 3.6 rungs 3 and 4 measured slower than rung 1, so they never run by default). A rung is its name, one
line saying what it removes, the module that holds its kernels and their entry point ``attention_backward(do, q, k, v,
o, lse, causal, window, scale)``, ``unavailable(q, k, v, do)``: why it cannot run these inputs on their device, or
None, and ``preferred(q, k, v, do)``: whether the default picks it where it can run (where the benchmark measured it
faster than the rungs below; None: wherever it can run), and ``deterministic``: False for a rung whose gradients may
differ in their last bits from run to run, which only runs when named.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BackwardRung:
    """One rung of the backward's ladder (see the module docstring)."""

    name: str
    removes: str
    module: str
    unavailable: Callable  # (q, k, v, do) -> str | None
    preferred: Callable | None = None  # (q, k, v, do) -> bool
    deterministic: bool = True  # bit-identical gradients run to run; False: never the default

    def load(self):
        return importlib.import_module(self.module)

    def attention_backward(self, do, q, k, v, o, lse, causal, window, scale, config=None):
        return self.load().attention_backward(do, q, k, v, o, lse, causal, window, scale, config=config)


def runs_everywhere(q, k, v, do) -> str | None:
    """``unavailable`` of a rung that runs every input ``flash_attention`` accepts, on any GPU and the interpreter."""
    return None


def _imported(module: str, name: str) -> Callable:
    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)

    return call


def measured_slower(q, k, v, do) -> bool:
    """``preferred`` of a rung the benchmark measured slower than the rungs below it (docs/backward.md): never the
    default, run by name."""
    return False


BACKWARD_RUNGS: tuple[BackwardRung, ...] = (
    BackwardRung(
        "two_pass",
        "nothing yet: FlashAttention-2's two tile loops (dK and dV per key tile, dQ in a pass of its own), pointer "
        "loads software-pipelined by the compiler",
        "flashlab.kernels.backward.rung1_two_pass",
        runs_everywhere,
    ),
    BackwardRung(
        "hopper",
        "load latency: whole tiles copied by the tensor-memory accelerator, issued by warps of their own",
        "flashlab.kernels.backward.rung2_hopper",
        _imported("flashlab.kernels.backward.rung2_hopper", "unavailable"),
        _imported("flashlab.kernels.backward.rung2_hopper", "preferred"),
    ),
    BackwardRung(
        "atomic_dq",
        "the dQ pass: dQ added up in the dK/dV loop with float32 atomic adds (5 matrix products, not 7); not "
        "deterministic (dQ's last bits may change run to run), so it runs only when named",
        "flashlab.kernels.backward.rung3_atomic_dq",
        _imported("flashlab.kernels.backward.rung3_atomic_dq", "unavailable"),
        measured_slower,
        deterministic=False,
    ),
    BackwardRung(
        "ordered_dq",
        "atomic_dq's nondeterminism: the key tiles add into each query tile's dQ in a fixed order, taking turns",
        "flashlab.kernels.backward.rung4_ordered_dq",
        _imported("flashlab.kernels.backward.rung4_ordered_dq", "unavailable"),
        measured_slower,
    ),
    BackwardRung(
        "one_pass_atomic",
        "the dQ pass and the compiler's limits: five products in one loop written in Gluon, two consumer "
        "warpgroups and a loader warp stated in the source, dQ added with atomic adds; not deterministic",
        "flashlab.kernels.backward.rung5_one_pass",
        _imported("flashlab.kernels.backward.rung5_one_pass", "unavailable"),
        measured_slower,
        deterministic=False,
    ),
    BackwardRung(
        "one_pass",
        "one_pass_atomic's nondeterminism: the key tiles take turns adding into each query tile's dQ, in an order "
        "that follows their walks, the first turn storing and the last writing dQ",
        "flashlab.kernels.backward.rung6_one_pass_ordered",
        _imported("flashlab.kernels.backward.rung6_one_pass_ordered", "unavailable"),
        measured_slower,
    ),
)


def names() -> tuple[str, ...]:
    return tuple(r.name for r in BACKWARD_RUNGS)


def rung_named(name) -> BackwardRung:
    """The backward rung called ``name``; a ValueError listing the names for any other string (a TypeError for a
    non-str)."""
    if not isinstance(name, str):
        raise TypeError(f"backward_rung must be a backward rung's name or None; got {type(name).__name__}")
    for r in BACKWARD_RUNGS:
        if r.name == name:
            return r
    raise ValueError(f"unknown backward_rung {name!r}; the backward's rungs are {', '.join(names())} (in "
                     "the order they build on each other)")  # fmt: skip


def select(name, q, k, v, do, rungs=None) -> tuple[BackwardRung, str | None]:
    """The rung a backward runs, and a note to warn with (or None), as ``flashlab.kernels.ladder.select`` does for
    the forward: ``name`` None, the highest rung that can run these inputs and is preferred for them, silently; a
    name, that rung, or where it cannot run the fastest that can, with a note naming the rung and the reason.
    ``rungs``: the ladder to choose from (None: ``BACKWARD_RUNGS``)."""
    rungs = BACKWARD_RUNGS if rungs is None else rungs
    asked = None if name is None else rung_named(name)
    why = None if asked is None else asked.unavailable(q, k, v, do)
    if asked is not None and why is None:
        return asked, None
    for r in reversed(rungs):
        if (why if r is asked else r.unavailable(q, k, v, do)) is not None:
            continue
        if asked is None:
            if not r.deterministic:  # the default is always deterministic
                continue
            if r.preferred is not None and not r.preferred(q, k, v, do) and r is not rungs[0]:
                continue
            return r, None
        if not r.deterministic:  # a fallback is never less deterministic than what was asked for
            continue
        return r, f"backward rung {asked.name!r} cannot run here ({why}); running backward rung {r.name!r} instead"
    raise RuntimeError("no rung of the backward's ladder can run here")  # the first rung runs everywhere


def attention_backward(do, q, k, v, o, lse, causal, window, scale, rung=None):
    """Gradients ``(dq, dk, dv)`` of ``flash_attention(q, k, v, causal, window, scale)`` given ``do``, through the
    rung ``select`` picks (a named rung that cannot run here warns with a ``RuntimeWarning`` and runs the fastest
    that can)."""
    import warnings

    chosen, note = select(rung, q, k, v, do)
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return chosen.attention_backward(do, q, k, v, o, lse, causal, window, scale)


__all__ = ["BACKWARD_RUNGS", "BackwardRung", "attention_backward", "names", "rung_named", "runs_everywhere", "select"]
