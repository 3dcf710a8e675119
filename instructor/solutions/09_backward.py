"""Reference solutions for notebook 09's exercises (the backward pass). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 09.delta
import numpy as np


def delta(do, o):
    do = np.asarray(do, dtype=np.float64)  # (..., N, Dv)
    o = np.asarray(o, dtype=np.float64)  # (..., N, Dv)
    return (do * o).sum(axis=-1)  # (..., N): rowsum(dO * O), no N x N matrix


# %% exercise 09.tile_backward
import numpy as np


def tile_backward(p, do, q, k, v, delta, scale):
    p = np.asarray(p, dtype=np.float64)  # (bm, bn)
    dp = do @ v.T  # (bm, bn)  dP = dO V^T
    ds = p * (dp - np.asarray(delta)[:, None])  # (bm, bn)  dS = P * (dP - delta), delta of the whole row
    dq = scale * ds @ k  # (bm, D)
    dk = scale * ds.T @ q  # (bn, D)
    dv = p.T @ do  # (bn, Dv)
    return ds, dq, dk, dv
