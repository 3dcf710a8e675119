"""How long a launch takes once its programs have different amounts of work: the order they start in.

A GPU starts a grid's programs in grid order, each on the first SM with room for it, and the launch ends when
its last program does. With programs of equal work the order does not matter. In a ragged launch it does: a row
block of a prefill chunk over a 30K-key cache runs for as long as dozens of a short chunk's blocks, and if such a
block starts last, every other SM sits idle while it finishes.

- ``makespan`` -- that model of the block scheduler: programs given in order, each to the worker that frees
  first; returns when the last one ends.
- ``lower_bound`` -- no order does better than the larger of the work spread evenly and the longest program.
- ``row_block_work`` -- the work of each (sequence, row block) program of a causal ragged attention launch:
  the rows of the block times the keys its band reaches, in the grid's order. The reference for the sort the
  KV-cache kernel runs on the device (``flashlab.kernels.decode.kvcache.order_row_blocks``).

Sorting the programs longest first (``sorted(work, reverse=True)``) is the classic "longest processing time first"
rule: its makespan is never more than 4/3 of the best order's (Graham, 1969).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def makespan(work: Sequence[float], workers: int) -> float:
    """When the last of ``work``'s programs ends, each started in the given order on the worker that frees first
    (all free at time 0). Negative entries are programs with nothing to do and take no time."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    free = [0.0] * workers
    end = 0.0
    for w in work:
        if w <= 0:
            continue
        start = heapq.heappop(free)
        end = max(end, start + w)
        heapq.heappush(free, start + w)
    return end


def lower_bound(work: Sequence[float], workers: int) -> float:
    """What no order of ``work`` on ``workers`` workers beats: the total spread evenly, or the longest program."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    real = [w for w in work if w > 0]
    return max(sum(real) / workers, max(real, default=0.0))


def row_block_work(rows: Sequence[int], lengths: Sequence[int], group: int, block_m: int,
                   short_m: int = 0) -> list[int]:  # fmt: skip
    """Each (sequence, row block) program's work in a causal ragged launch, in the grid's order (sequence ``b``'s
    block ``m`` at ``b * row_blocks + m``, ``row_blocks`` cut for the longest sequence): the block's height times
    the keys from the first any of its rows sees to the last, -1 for a block past its sequence's rows.

    Sequence ``b`` adds ``rows[b]`` query rows to a cache of ``lengths[b]`` keys (its new rows included, aligned
    to its end); its ``group`` query heads a K/V head are packed head by head, ``group * rows[b]`` packed rows in
    blocks of ``block_m``, or of ``short_m`` where a sequence has at most ``short_m`` packed rows (a decode token's
    heads; 0: never)."""
    if len(rows) != len(lengths):
        raise ValueError(f"rows and lengths must have one entry a sequence, got {len(rows)} and {len(lengths)}")
    if group < 1 or block_m < 1 or short_m < 0:
        raise ValueError(f"group and block_m must be >= 1 and short_m >= 0, got {group}, {block_m}, {short_m}")
    row_blocks = -(-max(rows, default=0) * group // block_m)
    work = []
    for nq, nk in zip(rows, lengths, strict=True):
        if not 0 <= nq <= nk:
            raise ValueError(f"a sequence's new rows must be between 0 and its length, got {nq} of {nk}")
        packed = group * nq
        height = short_m if 0 < packed <= short_m else block_m
        for m in range(row_blocks):
            lo, hi = m * height, min((m + 1) * height, packed)
            if lo >= hi:
                work.append(-1)
                continue
            # packed row r is query position r % nq of head r // nq; position i sees keys [0, nk - nq + i]
            last = nq - 1 if lo // nq != (hi - 1) // nq else (hi - 1) % nq
            work.append(height * (nk - nq + last + 1))
    return work


__all__ = ["lower_bound", "makespan", "row_block_work"]
