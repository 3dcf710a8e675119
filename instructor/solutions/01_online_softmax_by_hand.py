"""Reference solutions for notebook 01's exercises (online softmax by hand). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook
(`python -m flashlab.grade.solutions` builds them).
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 01.online_softmax_update
import numpy as np


def online_softmax_update(m, l, block):
    block = np.asarray(block, dtype=np.float64)
    m_new = max(m, float(block.max()))
    rescale = 1.0 if m == -np.inf else float(np.exp(m - m_new))  # nothing seen yet: l is 0, nothing to rescale
    l_new = l * rescale + float(np.exp(block - m_new).sum())
    return m_new, l_new, rescale


# %% exercise 01.streaming_attention
import numpy as np


def streaming_attention(scores, values, block_size):
    scores = np.asarray(scores, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    m, l = -np.inf, 0.0
    acc = np.zeros(values.shape[1:])  # () for one number per key, (dv,) for a vector
    for start in range(0, len(scores), block_size):
        s, v = scores[start : start + block_size], values[start : start + block_size]
        m_new = max(m, s.max())
        alpha = np.exp(m - m_new) if m > -np.inf else 0.0  # rescale what was summed against the old max
        p = np.exp(s - m_new)
        l = alpha * l + p.sum()
        acc = alpha * acc + p @ v
        m = m_new
    out = acc / l
    return float(out) if out.ndim == 0 else out
