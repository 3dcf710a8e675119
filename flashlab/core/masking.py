"""Which keys each query may see, and which tiles of the score matrix that leaves to compute.

One convention everywhere in flashlab (the one FlashAttention >= 2.1 uses): masks are aligned to the
*bottom-right* corner of the Nq x Nk score matrix. With ``offset = Nk - Nq``, query row i sits on the diagonal at
key column ``i + offset``; that is where the newest query meets its own key when the queries are the last Nq
tokens of the sequence.

- ``causal``: query i sees keys ``j <= i + offset``.
- ``window=(left, right)``: query i sees keys ``i + offset - left <= j <= i + offset + right``; ``None`` on a
  side means unbounded. With causal as well, the right side is clipped to 0.

A row can see no key at all (causal with Nq > Nk); every implementation returns zeros and lse = -inf there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashlab.core.integers import cdiv

# tile states in a TileMap
SKIPPED, PARTIAL, FULL = 0, 1, 2


def visible_band(nq: int, nk: int, causal: bool = False, window=None) -> tuple[int, float, float]:
    """Return ``(offset, left, right)``: query i sees keys in ``[i + offset - left, i + offset + right]``.

    ``left``/``right`` are ``inf`` where unbounded. Raises ValueError for a malformed window.
    """
    left = right = float("inf")
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None; got {window!r}")
        wl, wr = window
        for side, w in (("left", wl), ("right", wr)):
            if w is None:
                continue
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
                raise ValueError(f"window {side} must be an int >= 0 or None (unbounded); got {w!r}")
        left = float("inf") if wl is None else int(wl)
        right = float("inf") if wr is None else int(wr)
    if causal:
        right = min(right, 0)
    return nk - nq, left, right


def visible_mask(nq: int, nk: int, causal: bool = False, window=None) -> np.ndarray:
    """Boolean ``(nq, nk)`` array: True where query i may see key j."""
    offset, left, right = visible_band(nq, nk, causal, window)
    i = np.arange(nq)[:, None]  # (nq, 1)
    j = np.arange(nk)[None, :]  # (1, nk)
    diag = i + offset
    return (j >= diag - left) & (j <= diag + right)


def tile_state(r0: int, r1: int, c0: int, c1: int, band) -> int:
    """Classify the tile rows [r0, r1) x cols [c0, c1) as SKIPPED, PARTIAL or FULL.

    The band's edges ``i + offset - left`` and ``i + offset + right`` both grow by one per row, so it is enough
    to look at the tile's corners: the tile is empty if its last row ends before c0 or its first row starts after
    c1 - 1, and fully visible if its last row starts at or before c0 and its first row reaches c1 - 1.
    """
    offset, left, right = band
    if (r1 - 1) + offset + right < c0 or r0 + offset - left > c1 - 1:
        return SKIPPED
    if (r1 - 1) + offset - left <= c0 and r0 + offset + right >= c1 - 1:
        return FULL
    return PARTIAL


@dataclass
class TileMap:
    """What the tiled loop did with each (query tile, key tile) pair.

    ``state[i, j]`` is SKIPPED (never loaded: the mask hides it entirely), PARTIAL (computed with an element
    mask) or FULL (computed, nothing masked).
    """

    state: np.ndarray  # (n_query_tiles, n_key_tiles) int8
    block_m: int
    block_n: int
    nq: int
    nk: int

    @property
    def computed(self) -> np.ndarray:
        return self.state != SKIPPED

    @property
    def skipped(self) -> np.ndarray:
        return self.state == SKIPPED

    @property
    def n_computed(self) -> int:
        return int(self.computed.sum())

    @property
    def n_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def fraction_computed(self) -> float:
        return self.n_computed / self.state.size


def tile_map(nq: int, nk: int, block_m: int, block_n: int, causal: bool = False, window=None) -> TileMap:
    """The plan: which tiles a tiled kernel with these block sizes computes and which it skips."""
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"{name} must be a positive int (a block size >= 1); got {b!r}")
    band = visible_band(nq, nk, causal, window)
    n_m, n_n = cdiv(nq, block_m), cdiv(nk, block_n)
    state = np.empty((n_m, n_n), dtype=np.int8)
    for ti in range(n_m):
        r0, r1 = ti * block_m, min((ti + 1) * block_m, nq)
        for tj in range(n_n):
            c0, c1 = tj * block_n, min((tj + 1) * block_n, nk)
            state[ti, tj] = tile_state(r0, r1, c0, c1, band)
    return TileMap(state=state, block_m=block_m, block_n=block_n, nq=nq, nk=nk)
