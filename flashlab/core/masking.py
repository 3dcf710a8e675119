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

from flashlab.core.checks import as_count, as_positive_int
from flashlab.core.integers import cdiv

# tile states in a TileMap
SKIPPED, PARTIAL, FULL = 0, 1, 2


def visible_band(nq: int, nk: int, causal: bool = False, window=None) -> tuple[int, float, float]:
    """Return ``(offset, left, right)``: query i sees keys in ``[i + offset - left, i + offset + right]``.

    ``left``/``right`` are ``inf`` where unbounded. A window side of at least ``nq + nk`` reaches past every key,
    so it is unbounded too and comes back as ``inf``: any integer is accepted (``2**70`` included) and the band's
    arithmetic never leaves int64. Raises TypeError unless ``causal`` is a bool, ValueError for a malformed window.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    nq, nk = int(nq), int(nk)
    left = right = float("inf")
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None; got {window!r}")
        sides = []
        for side, w in zip(("left", "right"), window, strict=True):
            if w is not None and (isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)) or w < 0):
                raise ValueError(f"window {side} must be an int >= 0 or None (unbounded); got {w!r}")
            sides.append(float("inf") if w is None or int(w) >= nq + nk else int(w))
        left, right = sides
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


def tile_state(r0, r1, c0, c1, band):
    """Classify the tile rows [r0, r1) x cols [c0, c1) as SKIPPED, PARTIAL or FULL.

    The band's edges ``i + offset - left`` and ``i + offset + right`` both grow by one per row, so it is enough
    to look at the tile's corners: the tile is empty if its last row ends before c0 or its first row starts after
    c1 - 1, and fully visible if its last row starts at or before c0 and its first row reaches c1 - 1.

    The corners may be NumPy arrays (one entry per tile, broadcast against each other); the result is then an
    int8 array of states.
    """
    offset, left, right = band
    if all(np.ndim(x) == 0 for x in (r0, r1, c0, c1)):
        if (r1 - 1) + offset + right < c0 or r0 + offset - left > c1 - 1:
            return SKIPPED
        if (r1 - 1) + offset - left <= c0 and r0 + offset + right >= c1 - 1:
            return FULL
        return PARTIAL
    # per row of tiles: the last row's band [lo_last, hi_last] and the first row's [lo_first, hi_first]; an
    # unbounded side becomes a reach past every key, so the arithmetic stays in integers
    reach = int(np.max(c1)) + int(np.max(r1)) + abs(int(offset)) + 1
    left = reach if left == float("inf") else int(left)
    right = reach if right == float("inf") else int(right)
    hi_last, lo_last = (r1 - 1) + (offset + right), (r1 - 1) + (offset - left)
    hi_first, lo_first = r0 + (offset + right), r0 + (offset - left)
    state = np.full(np.broadcast_shapes(*(np.shape(x) for x in (r0, r1, c0, c1))), PARTIAL, dtype=np.int8)
    state[(lo_last <= c0) & (hi_first >= c1 - 1)] = FULL
    state[(hi_last < c0) | (lo_first > c1 - 1)] = SKIPPED
    return state


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
    """The plan: which tiles a tiled kernel with these block sizes computes and which it skips.

    ``nq`` and ``nk`` must be at least 1 (an attention call has at least one query and one key), so the map always
    has at least one tile and ``fraction_computed`` is defined. Every tile is classified at once, as NumPy arrays
    of tile corners, so even 10^5 x 10^5 tokens in 16 x 16 tiles (39 million tiles) take about a second.
    """
    nq = as_positive_int("nq (query length)", nq)
    nk = as_positive_int("nk (key length)", nk)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        as_count(name, b)
    block_m, block_n = int(block_m), int(block_n)
    band = visible_band(nq, nk, causal, window)
    n_m, n_n = cdiv(nq, block_m), cdiv(nk, block_n)
    r0 = np.arange(n_m, dtype=np.int64)[:, None] * block_m  # (n_m, 1) first row of each query tile
    r1 = np.minimum(r0 + block_m, nq)  # (n_m, 1) one past its last row
    c0 = np.arange(n_n, dtype=np.int64)[None, :] * block_n  # (1, n_n) first key of each key tile
    c1 = np.minimum(c0 + block_n, nk)  # (1, n_n)
    state = tile_state(r0, r1, c0, c1, band)  # (n_m, n_n)
    return TileMap(state=state, block_m=block_m, block_n=block_n, nq=nq, nk=nk)
