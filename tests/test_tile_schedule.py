"""The persistent grid's tile schedule, ``flashlab.kernels.ladder.tile_schedule`` (host side, no GPU needed).

The teaching point: under a causal mask the query tiles are unequal work, and how they are handed to one program
per multiprocessor decides when the last program ends. Dealt round robin in pairs of equal work, 2048 units on 132
programs leave 68 programs a 16th unit; dealing one round fewer and handing the rest out tile by tile, longest
first, ends the programs together. The checks below count the tiles each program gets and when it ends by the cost
model, against that round-robin walk written out here, and the key tiles a query tile reads against the mask.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashlab.core.masking import visible_band, visible_mask
from flashlab.kernels.ladder import tile_schedule

PROGRAMS = 132  # an H200's multiprocessors


def causal_lengths(nq, block=128):
    """Query tile m of a causal square call reads m + 1 key tiles of ``block`` (tiles of ``block`` rows)."""
    return [m + 1 for m in range(math.ceil(nq / block))]


def paired_round_robin_finish(lengths, heads, programs, cost):
    """When the last program ends if units of a head's tiles n - 1 - r and r are dealt round robin."""
    n = len(lengths)
    units = []
    for _ in range(heads):
        for r in range((n + 1) // 2):
            tiles = {n - 1 - r, r}
            units.append(sum(lengths[t] + cost for t in tiles))
    load = [0.0] * programs
    for u, work in enumerate(units):
        load[u % programs] += work
    return max(load)


@pytest.mark.parametrize(
    "lengths, heads, programs",
    [([1, 2, 3, 4, 5, 6, 7, 8], 512, 132), ([3, 1, 4, 1, 5], 7, 4), ([2], 3, 8), ([5, 5, 5], 40, 132)],
)
def test_every_tile_goes_to_exactly_one_program(lengths, heads, programs):
    starts, tiles = tile_schedule.schedule(lengths, heads, programs)
    assert len(starts) == programs + 1 and starts[0] == 0 and starts[-1] == len(tiles)
    assert all(a <= b for a, b in zip(starts[:-1], starts[1:], strict=True))
    assert sorted(tiles) == list(range(len(lengths) * heads))


@pytest.mark.parametrize("d, nq", [(64, 1024), (64, 2048), (64, 4096), (64, 16384), (128, 1024), (128, 8192)])
def test_the_programs_end_together_where_round_robin_pairs_leave_a_tail(d, nq):
    # The ladder's causal cells: B * N = 16K tokens, H = 2048 / D, tiles of 128 query rows and 128 keys. Whatever
    # a tile's start and end really cost (0.5 to 4 key tiles), the last program ends within 2.5 % of the mean;
    # dealt round robin in pairs, 3 % or more after it.
    lengths, heads = causal_lengths(nq), (16384 // nq) * (2048 // d)
    starts, tiles = tile_schedule.schedule(lengths, heads, PROGRAMS)
    for cost in (0.5, 1.0, 2.0, 4.0):
        ends = tile_schedule.finish_times(lengths, starts, tiles, cost)
        total = (sum(lengths) + cost * len(lengths)) * heads
        mean = total / PROGRAMS
        assert sum(ends) == pytest.approx(total)
        paired = paired_round_robin_finish(lengths, heads, PROGRAMS, cost)
        assert paired / mean > 1.03
        assert max(ends) / mean < 1.025, (cost, max(ends), mean)
    counts = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert max(counts) - min(counts) <= 1  # even in tiles too, not only in key tiles


def test_pairs_are_dealt_head_by_head_and_the_last_tiles_come_from_the_last_heads():
    # Programs running at once share a few heads' K and V in L2: each program's list runs head by head (its pairs,
    # dealt round robin), and the tiles handed out one at a time at the end come from the last heads.
    lengths, heads = causal_lengths(4096), 128
    n_m = len(lengths)
    starts, tiles = tile_schedule.schedule(lengths, heads, PROGRAMS)
    units = heads * n_m // 2
    dealt_rounds = units // PROGRAMS - tile_schedule.TAIL_ROUNDS
    first_tail_head = dealt_rounds * PROGRAMS // (n_m // 2)
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        own = [t // n_m for t in tiles[a:b]]
        dealt, tail = own[: 2 * dealt_rounds], own[2 * dealt_rounds :]
        assert dealt == sorted(dealt) and len(set(dealt)) <= dealt_rounds
        assert all(h >= first_tail_head for h in tail)
        pairs = [tiles[a + 2 * r : a + 2 * r + 2] for r in range(dealt_rounds)]
        assert all(sum(lengths[t % n_m] for t in pair) == n_m + 1 for pair in pairs)  # equal work per pair
    # and what the programs end on is short: their last tiles average well under the mean tile
    last = [lengths[tiles[b - 1] % n_m] for b in starts[1:]]
    assert sum(last) / len(last) < 0.7 * sum(lengths) / len(lengths)


@pytest.mark.parametrize(
    "nq, nk, causal, window, block_m, block_n",
    [(1000, 1000, True, None, 128, 128), (300, 700, True, None, 128, 128), (1024, 1024, False, (256, 0), 128, 128),
     (777, 901, True, (100, 0), 192, 64), (512, 512, False, None, 128, 64), (640, 640, False, (0, 300), 128, 128)],
)  # fmt: skip
def test_key_tiles_match_the_tiles_the_mask_reaches(nq, nk, causal, window, block_m, block_n):
    # The tiles from the first key tile any row sees to the last, counted from the visible mask itself
    offset, left, right = visible_band(nq, nk, causal, window)
    win_left = int(min(left, nq + nk)) if window else 0
    win_right = int(min(right, nq + nk)) if window else 0
    seen = visible_mask(nq, nk, causal, window)
    for row_lo in range(0, nq, block_m):
        cols = np.flatnonzero(seen[row_lo : row_lo + block_m].any(axis=0))
        expected = cols[-1] // block_n - cols[0] // block_n + 1 if len(cols) else 0
        if not causal and window is None:
            expected = math.ceil(nk / block_n)
        got = tile_schedule.key_tiles(row_lo, block_m, block_n, nq, nk, offset, win_left, win_right, causal,
                                      window is not None)  # fmt: skip
        assert got == expected, (row_lo, got, expected)


@pytest.mark.parametrize("lengths, heads, programs", [([], 4, 4), ([1, 2], 0, 4), ([1, 2], 4, 0)])
def test_an_empty_schedule_is_refused(lengths, heads, programs):
    with pytest.raises(ValueError, match="a schedule needs tiles, heads and programs"):
        tile_schedule.schedule(lengths, heads, programs)


def test_the_table_holds_the_starts_then_the_tiles_and_a_spare_entry():
    lengths, heads, programs = [1, 2, 3], 5, 4
    starts, tiles = tile_schedule.schedule(lengths, heads, programs)
    table = tile_schedule.table(lengths, heads, programs, "cpu")
    assert table.tolist() == [*starts, *tiles, 0] and str(table.dtype) == "torch.int32"
    assert tile_schedule.has_table(lengths, heads, programs, "cpu")
    assert tile_schedule.table(lengths, heads, programs, "cpu") is table  # kept, not rebuilt


def schedule_written_out(lengths, heads, programs, start_cost, tail_rounds):
    """``tile_schedule.schedule``'s rule in its plainest form: units of a head's i-th longest and i-th shortest
    tiles, all but the last ``tail_rounds`` rounds dealt round robin, the rest handed out one tile at a time, longest
    first, to the program with the least work (then the fewest tiles, then the lowest number)."""
    n = len(lengths)
    longest_first = sorted(range(n), key=lambda m: (-lengths[m], m))
    units = []
    for h in range(heads):
        for i in range((n + 1) // 2):
            a, z = longest_first[i], longest_first[n - 1 - i]
            units.append([h * n + a] if a == z else [h * n + a, h * n + z])
    dealt = max(len(units) // programs - tail_rounds, 0) * programs
    lists = [[] for _ in range(programs)]
    for u in range(dealt):
        lists[u % programs] += units[u]
    left = sorted((t for unit in units[dealt:] for t in unit), key=lambda t: (-lengths[t % n], t))
    for t in left:
        work = [sum(lengths[x % n] + start_cost for x in tiles) for tiles in lists]
        p = min(range(programs), key=lambda p: (work[p], len(lists[p]), p))
        lists[p].append(t)
    starts = [0]
    for tiles in lists:
        starts.append(starts[-1] + len(tiles))
    return starts, [t for tiles in lists for t in tiles]


def test_the_schedule_is_its_rule_written_out():
    """The schedule runs inside a chunked-prefill call (a new one per new lengths), so it is written for speed,
    with a shortcut for one wave of tiles; it must hand out exactly what the plain rule does, on random cases
    (one wave and many, ties, zero-length tiles, no start cost)."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        lengths = [int(x) for x in rng.integers(0, 9, n)]
        heads, programs = int(rng.integers(1, 20)), int(rng.integers(1, 60))
        start_cost, tail = float(rng.choice([0.0, 1.0, 2.0])), int(rng.integers(0, 3))
        assert tile_schedule.schedule(lengths, heads, programs, start_cost, tail) == schedule_written_out(
            lengths, heads, programs, start_cost, tail)  # fmt: skip
