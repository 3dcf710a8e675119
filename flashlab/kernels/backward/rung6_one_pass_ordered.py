"""The backward's rung 6, "one_pass": rung 5's one loop of five products, made deterministic.

Rung 5 (``rung5_one_pass``) adds every key tile's part of a query tile's dQ with float32 atomic adds, in whatever
order they arrive. Here the key tiles that see a query tile take turns, as FlashAttention-3's deterministic
backward does: a counter per (head, query tile, warpgroup) says whose turn it is; a program waits for its turn,
adds its part with a plain load and store (the first turn only stores, so no buffer of zeros is needed first; the
last writes dQ itself, scaled and rounded, so no pass after the loop either) and passes the turn on. The order of
the sum is fixed, so the same inputs give the same bits every run.

The turns must not make programs wait long. Under a causal mask or a window the highest key tile that sees a query
tile goes first, then the next lower: each reaches the query tile a step or two after the one above it (its walk
starts two 64-row tiles earlier), and the grid launches the key tiles highest first, so a program only ever waits
for one launched before it. Without a mask every key tile starts its walk at its own share of the query tiles and
goes round (``rung5_one_pass._step_tile``), so that they reach a query tile one after another rather than all at
once; the turns follow that order where all of a head's key tiles fit on the GPU at once (otherwise a key tile
could wait for one not yet launched), and fall back to the highest-first order beyond.

Where it runs: where rung 5 runs (``rung5_one_pass.unavailable``).
"""

from __future__ import annotations

from flashlab.kernels.backward import rung5_one_pass

NAME = "one_pass"


def unavailable(q, k, v, do) -> str | None:
    """Why this rung cannot run the backward of these inputs here, or None (rung 5's conditions)."""
    return rung5_one_pass.unavailable(q, k, v, do)


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` as rung 5 computes them, dQ summed in a fixed order: bit-identical run to run."""
    return rung5_one_pass.run_backward(do, q, k, v, o, lse, causal, window, scale, config, ordered=True)


__all__ = ["NAME", "attention_backward", "unavailable"]
