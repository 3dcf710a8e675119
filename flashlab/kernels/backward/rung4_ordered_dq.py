"""The backward's rung 4, "ordered_dq": rung 3's five products, deterministic again.

Rung 3 (``rung3_atomic_dq``) adds each key tile's part of dQ into a float32 buffer with atomic adds, so the
parts of one dQ element are summed in whatever order the programs reach it, and its last bits change from run to
run. Here the adds into a query tile take turns, as FlashAttention-3's deterministic mode does: the key tiles that
see a query tile are consecutive (the band is convex), so the j-th of them waits until a per-tile counter says
the j - 1 before it have added theirs, adds with a plain load and store, and passes the turn on. The sum's order
is then the key tiles' order, every run: bit-identical gradients, 5 products a tile pair, and waits where a
program reaches a query tile before the key tile ahead of it has. A program only ever waits on programs of lower
key tiles, which are launched first, so the waits end.

Where it runs: where rung 2 runs (``rung2_hopper.unavailable``), on eight plain warps as rung 3 (a loop with a
wait in it is no loop Triton 3.6 warp-specialises).
"""

from __future__ import annotations

from flashlab.kernels.backward import rung2_hopper

NAME = "ordered_dq"


def unavailable(q, k, v, do) -> str | None:
    """Why this rung cannot run the backward of these inputs here, or None (rung 2's conditions)."""
    return rung2_hopper.unavailable(q, k, v, do)


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` as rung 2 returns them, dQ from the dK/dV loop, summed in a fixed order.
    ``config``: ``{"dkdv": {...}}`` as rung 2 takes it."""
    return rung2_hopper.run_backward(do, q, k, v, o, lse, causal, window, scale, config, dq_atomic=True,
                                     dq_ordered=True)  # fmt: skip


__all__ = ["NAME", "attention_backward", "unavailable"]
