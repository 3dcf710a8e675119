"""The backward's rung 3, "atomic_dq": rung 2's dK/dV loop computes dQ as well, and the dQ kernel goes.

Rungs 1 and 2 give dQ a pass of its own because each query row's dQ sums over key tiles that different dK/dV
programs own: a pass over query tiles recomputes S and dP (two more matrix products per tile pair, 7 in all
against the 5 the gradient needs) so that every dQ element is written once, by one program. Here each dK/dV
program, having dS for its keys and a tile of query rows, also forms ``dS K`` for those rows (the fifth product)
and adds it into a float32 buffer with atomic adds (FlashAttention-2's and -3's scheme); a last elementwise step
scales it and rounds it to q's dtype. So 5 products instead of 7, at the price of one float32 atomic add per dQ
element per key tile -- and of determinism: the adds of different programs land in whatever order they arrive, so
the last bits of dQ can change from run to run (dK and dV stay bit-identical). That is why this rung is never the
default and runs only when named: ``flash_attention(..., backward_rung="atomic_dq")``.

Where it runs: where rung 2 runs (``rung2_hopper.unavailable``). The buffer holds ``B * Hq * Nq'`` rows of the
padded head dim in float32 (Nq' = Nq rounded up to ``rung2_hopper.ROW_ALIGN``).
"""

from __future__ import annotations

from flashlab.kernels.backward import rung2_hopper

NAME = "atomic_dq"


def unavailable(q, k, v, do) -> str | None:
    """Why this rung cannot run the backward of these inputs here, or None (rung 2's conditions)."""
    return rung2_hopper.unavailable(q, k, v, do)


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` as rung 2 returns them, dQ from the dK/dV loop (not bit-identical run to run).
    ``config``: ``{"dkdv": {...}}`` as rung 2 takes it."""
    return rung2_hopper.run_backward(do, q, k, v, o, lse, causal, window, scale, config, dq_atomic=True)


__all__ = ["NAME", "attention_backward", "unavailable"]
