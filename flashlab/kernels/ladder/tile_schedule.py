"""Which query tiles each program of a persistent grid takes, so that the programs finish together.

Under a causal mask query tile ``m`` reads ``m + 1`` key tiles: tiles are unequal work. A persistent grid runs one
program per multiprocessor, each walking its own list of tiles, and the call ends when the last program does.
Pairing each head's ``r``-th longest tile with its ``r``-th shortest makes units of equal work, and dealing the
units round robin balances the programs -- except in the last round: with 2048 units on 132 programs, 68 programs
take a 16th unit while 64 wait, about 3 % of the call.

``schedule`` deals the pairs round robin, head by head (so the programs running at once share a few heads' K and V
in L2), but stops a round short. The tiles left over, two to four per program, are then handed out one at a time,
longest first, each to the program with the least work so far; a program's work counts its key tiles plus a fixed
cost per tile (its start and end), so the lists stay even in tiles as well as in key tiles. Balancing by key tiles
alone, with whatever tiles come last, is fragile: the cost of a tile's start and end is not known well, and a program
handed many short tiles at the end then finishes late. The result is a table the kernel reads: where each program's
list starts, then the tiles.
"""

from __future__ import annotations

import heapq
from itertools import chain

import torch

from flashlab.core.integers import cdiv

TILE_START_COST = 2.0  # a tile's start and end (Q, first scores, epilogue), counted in key tiles (a rough H200 value)
TAIL_ROUNDS = 1  # rounds of pairs left out of the round robin, to be handed out tile by tile


def key_tiles(row_lo, block_m, block_n, nq, nk, offset, win_left, win_right, causal, window) -> int:
    """How many key tiles the query tile starting at row ``row_lo`` reads: the kernel's key range (all tiles;
    causal, up to its last row's diagonal; with a window, those its rows' bands reach)."""
    j0, j1 = 0, cdiv(nk, block_n)
    if window:
        row_hi = min(row_lo + block_m, nq) - 1
        j0 = max(row_lo + offset - win_left, 0) // block_n
        j1 = cdiv(min(row_hi + offset + win_right + 1, nk), block_n)
    elif causal:
        j1 = min(cdiv(row_lo + block_m + offset, block_n), j1)
    return max(j1 - j0, 0)


def causal_key_tiles(n_m: int, block_m: int, block_n: int, nk: int, offset: int) -> tuple:
    """``key_tiles`` of query tiles ``0 .. n_m - 1`` under a causal mask without a window, in one expression: what
    chunked prefill works out for its new lengths on every call (a test checks it against ``key_tiles``)."""
    key_tiles_all = (nk + block_n - 1) // block_n
    return tuple(max(min((m * block_m + block_m + offset + block_n - 1) // block_n, key_tiles_all), 0)
                 for m in range(n_m))  # fmt: skip


def schedule(lengths, heads: int, programs: int, start_cost: float = TILE_START_COST, tail_rounds: int = TAIL_ROUNDS):
    """Each program's list of tiles: ``(starts, tiles)``, program ``p`` taking ``tiles[starts[p]:starts[p + 1]]`` in
    that order. A tile is ``head * len(lengths) + m``; ``lengths[m]`` is query tile ``m``'s key tiles (the same in
    every head). Every tile appears once.

    Chunked prefill meets new lengths on every call, so this runs inside the user's call: plain loops over ints,
    and one wave of tiles (no more tiles than programs, the usual case for a chunk) dealt one per program at once."""
    n_m = len(lengths)
    if n_m == 0 or heads <= 0 or programs <= 0:
        raise ValueError(f"a schedule needs tiles, heads and programs; got {n_m}, {heads}, {programs}")
    # per head, its i-th longest tile with its i-th shortest (the middle one alone): unit u = head * half + i
    half = (n_m + 1) // 2
    units = heads * half
    dealt = max(units // programs - tail_rounds, 0) * programs
    cost = [length + start_cost for length in lengths]  # the cost model (_work) per query tile
    if dealt == 0:  # nothing dealt in rounds: all the tiles are left, longest first (ties: lowest tile first)
        by_length = {}
        for m in range(n_m):
            by_length.setdefault(lengths[m], []).append(m)
        left = []
        for length in sorted(by_length, reverse=True):
            left.extend(sorted(chain.from_iterable(range(m, heads * n_m, n_m) for m in by_length[length])))
        if len(left) <= programs and min(cost) > 0:
            # every program's work is 0, so each tile in turn goes to the lowest-numbered idle program
            return list(range(len(left) + 1)) + [len(left)] * (programs - len(left)), left
        lists = [[] for _ in range(programs)]
    else:
        longest_first = sorted(range(n_m), key=lambda m: (-lengths[m], m))
        pairs = [(longest_first[i], longest_first[n_m - 1 - i]) for i in range(half)]
        lists = [[] for _ in range(programs)]
        for u in range(dealt):
            h, i = divmod(u, half)
            a, z = pairs[i]
            tiles = lists[u % programs]
            tiles.append(h * n_m + a)
            if a != z:
                tiles.append(h * n_m + z)
        left = []
        for u in range(dealt, units):
            h, i = divmod(u, half)
            a, z = pairs[i]
            left.append(h * n_m + a)
            if a != z:
                left.append(h * n_m + z)
        left.sort(key=lambda t: (-lengths[t % n_m], t))
    least = [(sum(cost[t % n_m] for t in lists[p]), len(lists[p]), p) for p in range(programs)]
    heapq.heapify(least)  # (work so far, tiles, program), least first
    for t in left:
        w, count, p = least[0]
        lists[p].append(t)
        heapq.heapreplace(least, (w + cost[t % n_m], count + 1, p))
    starts = [0]
    for tiles in lists:
        starts.append(starts[-1] + len(tiles))
    return starts, [t for tiles in lists for t in tiles]


def finish_times(lengths, starts, tiles, start_cost: float = TILE_START_COST) -> list[float]:
    """When each program ends, by the cost model ``schedule`` plays out (for checks and for the notebooks)."""
    spans = zip(starts[:-1], starts[1:], strict=True)
    return [_work(lengths, tiles[a:b], start_cost) for a, b in spans]


def _work(lengths, tiles, start_cost) -> float:
    """The cost model: a list of tiles costs its key tiles plus ``start_cost`` per tile."""
    return sum(lengths[t % len(lengths)] + start_cost for t in tiles)


_TABLES = {}  # (lengths, heads, programs, device) -> the table on that device
# Chunked prefill meets new lengths every call: the tables are bounded, and dropped whole when full (a launch
# already planned keeps its own reference).
MAX_TABLES = 1024


def _table_key(lengths, heads, programs, device):
    return tuple(lengths), heads, programs, device if type(device) is torch.device else torch.device(device)


def has_table(lengths, heads: int, programs: int, device) -> bool:
    """Whether ``table`` holds this schedule already (building one copies it to the GPU, which a CUDA graph's
    capture does not allow)."""
    return _table_key(lengths, heads, programs, device) in _TABLES


def kept_table(lengths, heads: int, programs: int, device) -> torch.Tensor | None:
    """The table ``table`` keeps for this schedule, or None where it has none yet."""
    return _TABLES.get(_table_key(lengths, heads, programs, device))


def table(lengths, heads: int, programs: int, device) -> torch.Tensor:
    """``schedule`` as the kernel reads it, on ``device``, kept per (lengths, heads, programs, device)."""
    key = _table_key(lengths, heads, programs, device)
    if key not in _TABLES:
        if len(_TABLES) >= MAX_TABLES:
            _TABLES.clear()
        starts, tiles = schedule(list(lengths), heads, programs)
        # one int32 table: programs + 1 starts, the tiles, and one spare entry (a program reads one tile ahead)
        host = torch.tensor([*starts, *tiles, 0], dtype=torch.int32)
        if key[3].type == "cuda":  # from pinned memory, queued on the stream: a pageable copy waits for the GPU
            host = host.pin_memory().to(key[3], non_blocking=True)
        _TABLES[key] = host
    return _TABLES[key]


__all__ = ["MAX_TABLES", "TAIL_ROUNDS", "TILE_START_COST", "causal_key_tiles", "finish_times", "has_table",
           "kept_table", "key_tiles", "schedule", "table"]  # fmt: skip
