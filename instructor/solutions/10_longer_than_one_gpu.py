"""Reference solution for notebook 10's exercise (a pair of chunks as a bottom-right-aligned call). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 10.pair_band
import numpy as np


def pair_band(q_chunk, k_chunk, left, right):
    (qs, qe), (ks, ke) = q_chunk, k_chunk
    qa, qb = max(qs, ks - right), min(qe, ke + left)  # rows that see at least one key of the chunk
    if qa >= qb:
        return None
    ka, kb = max(ks, qa - left), min(ke, qb + right)  # keys at least one of those rows sees
    if ka >= kb:
        return None
    shift = qb - kb  # how far the pair's last query sits past its last key
    win_left = np.inf if left == np.inf else left - shift
    win_right = np.inf if right == np.inf else right + shift
    return int(qa), int(qb), int(ka), int(kb), win_left, win_right
