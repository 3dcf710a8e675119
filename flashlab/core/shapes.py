"""Shape rules shared by every attention implementation in flashlab.

q is ``(..., Hq, Nq, D)``, k and v are ``(..., Hk, Nk, D)`` (v may have its own last dimension Dv). The leading
``...`` dims must agree. When Hk < Hq the keys are shared by groups of query heads (grouped-query attention, GQA):
query head h reads key/value head ``h // (Hq // Hk)``. Inputs with only two dims ``(N, D)`` are one head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    batch: tuple[int, ...]  # leading dims before the head dim (may be empty)
    hq: int  # query heads
    hk: int  # key/value heads
    nq: int  # query length
    nk: int  # key length
    d: int  # head dim of q and k
    dv: int  # head dim of v

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for ordinary multi-head attention)."""
        return self.hq // self.hk


def attention_shape(q_shape, k_shape, v_shape) -> AttentionShape:
    """Check q/k/v shapes against each other and return the sizes; raise ValueError naming the problem."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, s in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(s) < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, D); got shape {s}")
    for name, s in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(s) > 2 and 0 in s[:-2]:
            raise ValueError(f"{name} must not be empty: every batch and head dim must be at least 1; got shape {s}")
    if not len(q_shape) == len(k_shape) == len(v_shape):
        raise ValueError(f"q, k and v must have the same number of dims; got {q_shape}, {k_shape}, {v_shape}")
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(f"k and v must agree on every dim but the last; got k {k_shape}, v {v_shape}")
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q and k must have the same head dim D; got q {q_shape}, k {k_shape}")
    if len(q_shape) == 2:
        batch, hq, hk = (), 1, 1
    else:
        batch, hq, hk = q_shape[:-3], q_shape[-3], k_shape[-3]
        if batch != k_shape[:-3]:
            raise ValueError(f"q and k must agree on the batch dims; got q {q_shape}, k {k_shape}")
        if hk < 1 or hq % hk != 0:
            raise ValueError(
                f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for grouped-query attention"
            )
    nq, nk, d, dv = q_shape[-2], k_shape[-2], q_shape[-1], v_shape[-1]
    for name, size in (("Nq", nq), ("Nk", nk), ("D", d), ("Dv", dv)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1; got shapes q {q_shape}, k {k_shape}, v {v_shape}")
    return AttentionShape(batch=batch, hq=hq, hk=hk, nq=nq, nk=nk, d=d, dv=dv)
