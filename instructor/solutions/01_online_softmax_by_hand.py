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


def streaming_attention(blocks):
    m, l, acc = -np.inf, 0.0, 0.0
    for scores, values in blocks:  # one block at a time: nothing later has been read yet
        scores = np.asarray(scores, dtype=np.float64)
        values = np.asarray(values, dtype=np.float64)
        m_new = max(m, float(scores.max()))
        alpha = np.exp(m - m_new) if m > -np.inf else 0.0  # rescale what was summed against the old max
        p = np.exp(scores - m_new)
        l = alpha * l + p.sum()
        acc = alpha * acc + p @ values  # a number for (b,) values, a (dv,) vector for (b, dv)
        m = m_new
        yield m, l, acc
