"""Reference solutions for notebook 03's exercises (tiling in NumPy). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 03.tiled_attention
import numpy as np


def tiled_attention(q, k, v, block_m, block_n, causal=False):
    nq, d = q.shape
    nk, dv = v.shape
    offset = nk - nq  # causal masks are aligned bottom-right: row i sees keys j <= i + offset
    scale = 1.0 / np.sqrt(d)
    o = np.zeros((nq, dv))
    for r0 in range(0, nq, block_m):
        r1 = min(r0 + block_m, nq)
        q_tile = q[r0:r1]  # (bm, D)
        m = np.full(r1 - r0, -np.inf)  # (bm,) running max
        l = np.zeros(r1 - r0)  # (bm,) running sum
        acc = np.zeros((r1 - r0, dv))  # (bm, Dv) running output
        for c0 in range(0, nk, block_n):
            c1 = min(c0 + block_n, nk)
            if causal and c0 > (r1 - 1) + offset:
                break  # this tile and every later one is above the diagonal: skipped
            s = q_tile @ k[c0:c1].T * scale  # (bm, bn) the only scores that exist
            if causal:
                rows = np.arange(r0, r1)[:, None] + offset
                s = np.where(np.arange(c0, c1)[None, :] <= rows, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)  # rows with nothing visible yet
            alpha = np.exp(m - m_safe)
            p = np.exp(s - m_safe[:, None])
            l = alpha * l + p.sum(axis=1)
            acc = alpha[:, None] * acc + p @ v[c0:c1]
            m = m_new
        seen = l > 0
        o[r0:r1][seen] = acc[seen] / l[seen][:, None]
    return o


# %% exercise 03.count_causal_tiles
def count_causal_tiles(nq, nk, block_m, block_n):
    offset = nk - nq
    computed = total = 0
    for r0 in range(0, nq, block_m):
        last_row = min(r0 + block_m, nq) - 1
        for c0 in range(0, nk, block_n):
            total += 1
            if c0 <= last_row + offset:  # the tile's last row reaches its first key
                computed += 1
    return computed, total - computed


# %% exercise 03.count_packed_tiles
def count_packed_tiles(lengths, block_m, block_n, causal=False):
    ends = []  # one past each document's last token
    for n in lengths:
        ends.append((ends[-1] if ends else 0) + n)
    total = ends[-1]
    computed = 0
    for r0 in range(0, total, block_m):
        r1 = min(r0 + block_m, total)
        key_tiles = set()  # the key tiles some query row of this tile sees
        start = 0
        for end in ends:
            if start < r1 and end > r0:  # this document has query rows in the tile
                last_row = min(end, r1) - 1
                last_key = last_row if causal else end - 1  # its rows see keys start .. last_key
                key_tiles.update(range(start // block_n, last_key // block_n + 1))
            start = end
        computed += len(key_tiles)
    return computed
