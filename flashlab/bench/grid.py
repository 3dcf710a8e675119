"""One point of the benchmark's grid: a ``Cell`` (dtype, head dim, length, mask, batch, heads), what it costs in
FLOPs and bytes, and the tolerance its checked result must meet."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashlab.calculators import roofline
from flashlab.core.numerics import SHORT_NAMES, tolerance

DTYPES = {short: getattr(torch, name) for short, name in SHORT_NAMES.items()}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# Relative error (Frobenius norm of the difference over that of the reference) a backend may have on a checked
# slice: flashlab's one per-dtype table (flashlab.core.numerics.TOLERANCE), under this harness's short dtype names.
TOLERANCE = {short: tolerance(dtype) for short, dtype in DTYPES.items()}

# Columns every result row carries from the run's stamp.
STAMP_COLUMNS = ("device_name", "torch", "triton", "cuda", "date")

CAUSAL_CHOICES = {"both": (False, True), "no": (False,), "yes": (True,)}


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: q is ``(batch, heads, q_len, head_dim)``, k and v ``(batch, kv_heads, seq_len,
    head_dim)``, all of ``dtype``.

    Prefill (the default): ``q_len = seq_len`` and ``kv_heads = heads``. Decode: ``q_len = 1``, one new token
    against a KV cache of ``seq_len`` tokens, with ``kv_heads < heads`` under grouped-query attention.
    """

    dtype: str
    head_dim: int
    seq_len: int
    causal: bool
    batch: int
    heads: int
    q_len: int | None = None  # None: seq_len (prefill)
    kv_heads: int | None = None  # None: heads (no GQA)

    @property
    def nq(self) -> int:
        return self.seq_len if self.q_len is None else self.q_len

    @property
    def hk(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def flops(self) -> float:
        if self.nq == self.seq_len:
            return attention_flops(self.batch, self.heads, self.seq_len, self.head_dim, self.causal)
        # decode: Q K^T and P V over nq x seq_len scores per query head (nq = 1 sees every key: no mask)
        return 4.0 * self.batch * self.heads * self.nq * self.seq_len * self.head_dim

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V (the KV cache) read once."""
        return 2 * self.batch * self.hk * self.seq_len * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def io_bytes(self) -> int:
        """Bytes of Q, K, V read and O written, once each: the least any implementation must move."""
        q_and_o = 2 * self.batch * self.heads * self.nq * self.head_dim * DTYPES[self.dtype].itemsize
        return q_and_o + self.kv_bytes

    def label(self) -> str:
        if self.nq != self.seq_len:
            return f"{self.dtype} D={self.head_dim} decode KV={self.seq_len} B={self.batch} H={self.heads}/{self.hk}"
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} D={self.head_dim} N={self.seq_len} {mask} B={self.batch} H={self.heads}"


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of the whole batch: ``flashlab.calculators.roofline.attention_flops`` (4*N^2*D per head, causal
    half)."""
    return float(batch * heads * roofline.attention_flops(seq_len, head_dim, causal=causal))
