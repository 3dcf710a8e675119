"""Softmax, and the online softmax that lets FlashAttention see a row of scores one block at a time.

The ordinary softmax needs the whole row: its maximum m (subtracted so exp never overflows) and the sum
l = sum_j exp(s_j - m). The online version keeps just those two numbers, m and l, for the blocks seen so far.
When a block brings a bigger maximum m', the old sum is still relative to the old m, so it is multiplied by the
*rescale factor* exp(m - m') before the new block's terms are added. The same factor rescales a running weighted
sum of values, which is how the attention output streams too (``online_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashlab.core.checks import as_count


def _check_scores(x: np.ndarray, what: str = "scores") -> None:
    if np.isnan(x).any():
        raise ValueError(f"{what} contain NaN")
    if np.isposinf(x).any():
        raise ValueError(f"{what} contain +inf; softmax is undefined there")


def _float_array(x) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise TypeError(f"expected real numbers; got dtype {x.dtype}")
    return x.astype(np.result_type(x.dtype, np.float32), copy=False)


def softmax(x, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along ``axis``: exp(x - max) / sum(exp(x - max)).

    Entries of -inf get probability 0; a slice that is all -inf gives all zeros (nothing to attend to).
    """
    x = _float_array(x)
    _check_scores(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)  # all -inf slice: exp(-inf - 0) = 0, no NaN
    e = np.exp(x - m)
    total = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


@dataclass
class OnlineSoftmaxStep:
    """The running state after one block of a row has been seen."""

    block: int  # index of the block just added
    scores: np.ndarray  # the block's scores
    m_prev: float  # running max before this block (-inf before the first)
    m: float  # running max after this block
    rescale: float  # exp(m_prev - m), applied to the old sum (1.0 on the first block)
    l: float  # running sum of exp(s - m) over every score seen so far


@dataclass
class OnlineAttentionStep(OnlineSoftmaxStep):
    """As OnlineSoftmaxStep, plus the un-normalised output: sum_j exp(s_j - m) * v_j so far."""

    acc: np.ndarray | float = 0.0


def _blocks(n: int, block_size: int):
    block_size = as_count("block_size", block_size)
    for start in range(0, n, block_size):
        yield start, min(start + block_size, n)


def _safe(m: float) -> float:
    # exp(s - m) with m = -inf (no finite score yet) would be exp(nan); relative to 0 it is exp(-inf) = 0.
    return 0.0 if m == -np.inf else m


def online_softmax(x, block_size: int):
    """Softmax of one row of scores, seen ``block_size`` scores at a time.

    Returns ``(probs, steps)``: the probabilities (equal to ``softmax(x)``) and one OnlineSoftmaxStep per block.
    """
    probs, steps = _online(x, None, block_size)
    return probs, steps


def online_attention(scores, values, block_size: int):
    """One query's attention output, streaming over the keys ``block_size`` at a time.

    ``scores`` is the query's row of scores, shape ``(n,)``; ``values`` holds one value per key, shape ``(n,)``
    or ``(n, dv)``. Returns ``(out, steps)``; each step's ``acc`` is the running un-normalised output relative to
    that step's running max, so ``out = steps[-1].acc / steps[-1].l``.
    """
    return _online(scores, values, block_size)


def _online(x, values, block_size):
    x = _float_array(x)
    if x.ndim != 1:
        raise ValueError(f"online softmax works on one row of scores, shape (n,); got shape {x.shape}")
    if x.size == 0:
        raise ValueError("scores must not be empty")
    _check_scores(x)
    if values is not None:
        values = _float_array(values)
        if values.ndim not in (1, 2) or values.shape[0] != x.shape[0]:
            raise ValueError(f"values must have shape (n,) or (n, dv) with n = {x.shape[0]}; got {values.shape}")
        acc = np.zeros(values.shape[1:], dtype=np.result_type(x, values))
    m, l = -np.inf, 0.0
    steps = []
    for b, (start, stop) in enumerate(_blocks(x.shape[0], block_size)):
        s = x[start:stop]
        m_new = max(m, float(np.max(s)))  # -- update the running max
        rescale = 1.0 if b == 0 else float(np.exp(m - _safe(m_new)) if m != -np.inf else 0.0)
        p = np.exp(s - _safe(m_new))  # this block's terms, relative to the new max
        l = l * rescale + float(np.sum(p))  # -- rescale the old sum, add the new block
        if values is None:
            steps.append(OnlineSoftmaxStep(block=b, scores=s.copy(), m_prev=m, m=m_new, rescale=rescale, l=l))
        else:
            acc = acc * rescale + p @ values[start:stop]  # -- rescale the old output, accumulate p @ V
            steps.append(
                OnlineAttentionStep(block=b, scores=s.copy(), m_prev=m, m=m_new, rescale=rescale, l=l, acc=acc.copy())
            )
        m = m_new
    if values is None:
        probs = np.exp(x - _safe(m)) / l if l > 0 else np.zeros_like(x)
        return probs, steps
    out = acc / l if l > 0 else np.zeros_like(acc)
    if out.ndim == 0:
        out = out.item()
        for st in steps:
            st.acc = float(st.acc)
    return out, steps
