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


# -- packed batches: documents laid end to end in one row of tokens ------------------------------------------------
#
# Training packs documents of different lengths into one row; serving batches prompts of every length the same way
# (FlashAttention's "varlen" layout, ``cu_seqlens``). Document d owns queries [qs_d, qs_d + lq_d) and keys
# [ks_d, ks_d + lk_d) of the packed row, and a query sees only keys of its own document: the mask is
# block-diagonal, with the causal or window mask inside each block, aligned to that block's bottom-right corner.


def as_lengths(what: str, lengths) -> np.ndarray:
    """Document lengths as an int64 array: a non-empty 1-D sequence of ints >= 1 (Python or NumPy, not bools).

    TypeError for a non-integer entry, ValueError for an empty or nested sequence or a length below 1.
    """
    seq = list(lengths) if np.ndim(lengths) == 1 else None
    if not seq:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of document lengths; got {lengths!r}")
    return np.array([as_positive_int(f"{what}[{i}]", n) for i, n in enumerate(seq)], dtype=np.int64)


def _packed_lengths(lengths_q, lengths_k) -> tuple[np.ndarray, np.ndarray]:
    """Both length lists checked; ``lengths_k=None`` means self-attention (the same lengths)."""
    lq = as_lengths("lengths_q", lengths_q)
    lk = lq if lengths_k is None else as_lengths("lengths_k", lengths_k)
    if lq.size != lk.size:
        raise ValueError(
            f"lengths_q and lengths_k must list the same documents; got {lq.size} query lengths and {lk.size} key "
            "lengths"
        )
    return lq, lk


def packed_visible_mask(lengths_q, lengths_k=None, causal: bool = False, window=None) -> np.ndarray:
    """Boolean ``(sum(lengths_q), sum(lengths_k))`` array: True where a query of the packed row may see a key.

    Block-diagonal: document d's block is ``visible_mask(lengths_q[d], lengths_k[d], causal, window)`` and every
    pair of tokens from two different documents is hidden. Built whole, so it is for small rows and for checks.
    """
    lq, lk = _packed_lengths(lengths_q, lengths_k)
    mask = np.zeros((int(lq.sum()), int(lk.sum())), dtype=bool)  # (Nq_total, Nk_total)
    qs, ks = np.cumsum(lq) - lq, np.cumsum(lk) - lk  # first query and first key of each document
    for q0, k0, nq, nk in zip(qs, ks, lq, lk, strict=True):
        mask[q0 : q0 + nq, k0 : k0 + nk] = visible_mask(int(nq), int(nk), causal, window)
    return mask


def packed_tile_map(lengths_q, lengths_k, block_m: int, block_n: int, causal: bool = False, window=None) -> TileMap:
    """The plan for one tiled pass over a packed row: which (query tile, key tile) pairs it computes.

    Tiles cut the packed row without regard to where documents end, so a tile may hold parts of several
    documents. A tile is SKIPPED when no document has a visible (query, key) pair inside it -- two different
    documents meet there, or the causal mask hides it -- FULL when one document covers the whole tile and sees
    all of it, PARTIAL otherwise. ``lengths_k=None`` means the same lengths as the queries (a training row).

    Each document is classified with ``tile_state`` over the tiles its block overlaps, in its own coordinates, so
    the work grows with the tiles the documents touch, not with the whole grid times the number of documents.
    """
    lq, lk = _packed_lengths(lengths_q, lengths_k)
    block_m, block_n = as_count("block_m", block_m), as_count("block_n", block_n)
    nq, nk = int(lq.sum()), int(lk.sum())
    state = np.full((cdiv(nq, block_m), cdiv(nk, block_n)), SKIPPED, dtype=np.int8)  # (n_m, n_n)
    qs, ks = np.cumsum(lq) - lq, np.cumsum(lk) - lk
    for q0, k0, n_q, n_k in zip(qs.tolist(), ks.tolist(), lq.tolist(), lk.tolist(), strict=True):
        band = visible_band(n_q, n_k, causal, window)  # in the document's own coordinates
        t0, t1 = q0 // block_m, cdiv(q0 + n_q, block_m)  # the query tiles this document overlaps
        u0, u1 = k0 // block_n, cdiv(k0 + n_k, block_n)  # and its key tiles
        rows = np.arange(t0, t1, dtype=np.int64)[:, None] * block_m  # (tiles, 1) first packed row of each tile
        cols = np.arange(u0, u1, dtype=np.int64)[None, :] * block_n  # (1, tiles)
        # the part of each tile inside this document, in document coordinates: rows [r0, r1), keys [c0, c1)
        r0, r1 = np.maximum(rows, q0) - q0, np.minimum(rows + block_m, min(q0 + n_q, nq)) - q0
        c0, c1 = np.maximum(cols, k0) - k0, np.minimum(cols + block_n, min(k0 + n_k, nk)) - k0
        doc = tile_state(r0, r1, c0, c1, band)  # (tiles, tiles) this document's share of each tile
        # a share is FULL only if the document also covers the tile's every row and key
        whole = ((rows >= q0) & (np.minimum(rows + block_m, nq) <= q0 + n_q)) & (
            (cols >= k0) & (np.minimum(cols + block_n, nk) <= k0 + n_k)
        )
        doc = np.where((doc == FULL) & ~whole, PARTIAL, doc).astype(np.int8)
        sub = state[t0:t1, u0:u1]
        sub[...] = np.maximum(sub, doc)  # SKIPPED < PARTIAL < FULL: any visible share makes the tile computed
    return TileMap(state=state, block_m=block_m, block_n=block_n, nq=nq, nk=nk)


@dataclass(frozen=True)
class PackedTileCounts:
    """Tiles computed for one batch of documents, three ways.

    - ``packed``: one row holding every document end to end, cut into tiles at fixed places, tiles skipped where
      no document sees anything (``packed_tile_map``; a block mask over the packed row works this way).
    - ``per_document``: the same row, but each document tiled from its own first token, as FlashAttention's
      variable-length kernels do (``cu_seqlens``): no tile holds two documents, so it is the sum of each
      document's own ``tile_map``.
    - ``padded``: each document in a row of its own, padded at the end to the longest query and key length;
      every row computes the tiles that mask leaves in a ``max(lengths_q) x max(lengths_k)`` call.
    - ``dense``: the packed row as one sequence with no mask at all: every tile of the square.
    """

    packed: int
    per_document: int
    padded: int
    dense: int

    @property
    def saved_vs_padded(self) -> float:
        """The fraction of the padded batch's tiles that packing does not compute."""
        return 1 - self.packed / self.padded


def packed_tile_counts(
    lengths_q, lengths_k, block_m: int, block_n: int, causal: bool = False, window=None
) -> PackedTileCounts:
    """Computed tiles for a packed row against padding to the longest document and against a dense square.

    Exact integers; the arguments mean what they mean in ``packed_tile_map``. Neither way of tiling the packed row
    always wins: many short documents share one fixed tile (``packed`` is smaller), while documents whose ends fall
    inside tiles pay for the straddling tiles twice over (``per_document`` is smaller). When every document is as
    long as the longest, fixed tiles that straddle two documents can even make ``packed`` exceed ``padded``;
    ``per_document`` never does for self-attention (``lengths_k`` None or equal to ``lengths_q``), since each
    document's tiles are a corner of the longest one's.
    """
    lq, lk = _packed_lengths(lengths_q, lengths_k)
    packed = packed_tile_map(lq, lk, block_m, block_n, causal, window).n_computed
    per_row = tile_map(int(lq.max()), int(lk.max()), block_m, block_n, causal, window).n_computed
    per_document = sum(
        tile_map(n_q, n_k, block_m, block_n, causal, window).n_computed
        for n_q, n_k in zip(lq.tolist(), lk.tolist(), strict=True)
    )
    dense = cdiv(int(lq.sum()), block_m) * cdiv(int(lk.sum()), block_n)
    return PackedTileCounts(packed=packed, per_document=per_document, padded=int(lq.size) * per_row, dense=dense)
