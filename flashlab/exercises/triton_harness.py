"""The Triton kernel around exercise 04: everything but the inner loop's body, which the learner writes.

One program handles BLOCK_M query rows: it loads its Q tile, walks the key/value tiles BLOCK_N at a time calling
``STEP(q, k, v, valid, m, l, acc, scale)`` (the learner's function) for each, then writes O = acc / l. The head dim is
padded to a power of two with zeros (masked loads), which changes no score and no output.

It runs in the learner's process, not the grader's: the grader copies this file beside the learner's cell (it imports
nothing from flashlab), starts that process with TRITON_INTERPRET=1 so the kernel runs on the CPU through Triton's
interpreter, and sends it q, k, v; ``run(step, q, k, v, ...)`` returns O, which the grader checks.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def attention_harness(
    Q,  # (Nq, D) fp32, row-major
    K,  # (Nk, D)
    V,  # (Nk, D)
    O,  # (Nq, D) output
    nq,
    nk,
    d,
    scale,
    STEP: tl.constexpr,  # the learner's inner-loop body
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = rows < nq
    dim_ok = dims < d
    q = tl.load(Q + rows[:, None] * d + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max
    l = tl.zeros((BLOCK_M,), tl.float32)  # running sum
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # running un-normalised output
    for start in range(0, nk, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        valid = cols < nk  # keys past the end of the last tile
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(K + cols[:, None] * d + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(V + cols[:, None] * d + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        m, l, acc = STEP(q, k, v, valid, m, l, acc, scale)
    o = acc / l[:, None]
    tl.store(O + rows[:, None] * d + dims[None, :], o, mask=row_ok[:, None] & dim_ok[None, :])


def run(step, q, k, v, block_m: int = 16, block_n: int = 16) -> np.ndarray:
    """Attention of q (Nq, D) over k, v (Nk, D) through the harness kernel with ``step`` as its inner loop."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, d = q.shape
    nk = k.shape[0]
    qt, kt, vt = (torch.tensor(x, dtype=torch.float32).contiguous() for x in (q, k, v))
    out = torch.full((nq, d), float("nan"), dtype=torch.float32)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(nq, block_m),)
    attention_harness[grid](
        qt, kt, vt, out, nq, nk, d, float(d) ** -0.5, STEP=step, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d
    )
    return out.numpy().astype(np.float64)
