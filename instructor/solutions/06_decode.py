"""Reference solution for notebook 06's exercise (split-KV merge). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 06.merge_split_kv
import numpy as np


def merge_split_kv(outs, lses):
    outs = np.asarray(outs, dtype=np.float64)  # (C, N, Dv)
    lses = np.asarray(lses, dtype=np.float64)  # (C, N)
    m = lses.max(axis=0)  # (N,)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # rows no chunk saw
    w = np.exp(lses - m_safe)  # (C, N) each chunk's share, up to exp(m)
    total = w.sum(axis=0)  # (N,)
    seen = total > 0
    o = np.zeros(outs.shape[1:])
    o[seen] = (w[:, seen, None] * outs[:, seen]).sum(axis=0) / total[seen, None]
    lse = np.full(m.shape, -np.inf)
    lse[seen] = m_safe[seen] + np.log(total[seen])
    return o, lse
