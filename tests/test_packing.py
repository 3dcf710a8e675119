"""Packed batches: the tile map over documents laid end to end, against a brute-force reading of the element mask.

The teaching point: a kernel over the packed row must compute exactly the tiles in which some query sees some key
of its own document, and no more; on a long-tailed batch that is far less than padding every document to the
longest. Where packing does *not* beat padding (equal lengths, tiles straddling document ends) is tested too.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT
from flashlab import exercises
from flashlab.core.masking import (
    FULL,
    PARTIAL,
    SKIPPED,
    PackedTileCounts,
    packed_tile_counts,
    packed_tile_map,
    packed_visible_mask,
    tile_map,
    visible_mask,
)
from flashlab.exercises.nb03_tiling import test_packed_short_documents_share_a_tile as graded_short_documents
from flashlab.grade.solutions import load_solutions


def brute_force_packed_mask(lengths_q, lengths_k, causal=False, window=None):
    """Query i may see key j? Same document, and the document's own mask lets it -- one pair at a time."""
    doc_q = np.repeat(np.arange(len(lengths_q)), lengths_q)  # (Nq,) document of each query
    doc_k = np.repeat(np.arange(len(lengths_k)), lengths_k)  # (Nk,)
    pos_q = np.arange(doc_q.size) - np.concatenate([[0], np.cumsum(lengths_q)[:-1]])[doc_q]  # place in its document
    pos_k = np.arange(doc_k.size) - np.concatenate([[0], np.cumsum(lengths_k)[:-1]])[doc_k]
    own = [visible_mask(nq, nk, causal, window) for nq, nk in zip(lengths_q, lengths_k, strict=True)]
    mask = np.zeros((doc_q.size, doc_k.size), dtype=bool)
    for i in range(doc_q.size):
        for j in range(doc_k.size):
            if doc_k[j] == doc_q[i]:
                mask[i, j] = own[doc_q[i]][pos_q[i], pos_k[j]]
    return mask


def brute_force_states(mask, block_m, block_n):
    nq, nk = mask.shape
    state = np.empty((-(-nq // block_m), -(-nk // block_n)), dtype=np.int8)
    for ti in range(state.shape[0]):
        for tj in range(state.shape[1]):
            tile = mask[ti * block_m : (ti + 1) * block_m, tj * block_n : (tj + 1) * block_n]
            state[ti, tj] = SKIPPED if not tile.any() else FULL if tile.all() else PARTIAL
    return state


def long_tailed(rng, n, scale=40.0):
    """Document lengths with a long tail: most short, a few long."""
    return [int(x) for x in np.ceil(rng.lognormal(np.log(scale), 1.0, n))]


CASES = [
    # (lengths_q, lengths_k, block_m, block_n, causal, window)
    ([5, 3, 9], None, 4, 4, False, None),
    ([5, 3, 9], None, 4, 4, True, None),
    ([1] * 9, None, 4, 3, True, None),  # many one-token documents share a tile
    ([7, 2, 12, 1], [9, 2, 15, 3], 3, 5, True, None),  # a cached prefix per document: Nk > Nq, bottom-right causal
    ([6, 10], [2, 4], 4, 2, True, None),  # Nq > Nk: the first rows of each document see nothing
    ([11, 4, 8], None, 5, 3, True, (3, 0)),  # a sliding window inside each document
    ([16, 8, 24], None, 8, 8, True, None),  # documents that end on tile edges
]


@pytest.mark.parametrize("lq,lk,bm,bn,causal,window", CASES)
def test_packed_mask_and_tile_map_match_brute_force(lq, lk, bm, bn, causal, window):
    want_mask = brute_force_packed_mask(lq, lk or lq, causal, window)
    np.testing.assert_array_equal(packed_visible_mask(lq, lk, causal, window), want_mask)
    tm = packed_tile_map(lq, lk, bm, bn, causal, window)
    np.testing.assert_array_equal(tm.state, brute_force_states(want_mask, bm, bn))
    assert (tm.nq, tm.nk) == want_mask.shape


def test_random_long_tailed_batches_match_brute_force_and_beat_padding():
    rng = np.random.default_rng(7)
    for _ in range(40):
        lengths = long_tailed(rng, int(rng.integers(2, 9)), scale=12.0)
        bm, bn = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        causal = bool(rng.integers(2))
        mask = packed_visible_mask(lengths, None, causal)
        tm = packed_tile_map(lengths, lengths, bm, bn, causal)
        counts = packed_tile_counts(lengths, None, bm, bn, causal)
        # the packed count is the number of tiles the element mask leaves non-empty
        assert counts.packed == tm.n_computed == int((brute_force_states(mask, bm, bn) != SKIPPED).sum())
        assert counts.per_document <= counts.padded  # tiling each document alone never loses to padding
        assert counts.packed <= counts.dense
        want_dense = -(-sum(lengths) // bm) * -(-sum(lengths) // bn)
        assert counts.dense == want_dense


def test_the_notebooks_batch_saves_most_of_the_padded_work():
    lengths = [109, 54, 60, 8, 545, 283, 66, 196]  # notebook 03's long-tailed draw
    c = packed_tile_counts(lengths, None, 64, 64, causal=True)
    per_row = tile_map(545, 545, 64, 64, causal=True).n_computed  # 9 tiles a side: 45
    assert per_row == 45 and c.padded == 8 * 45
    assert c.packed < c.padded / 4 and c.per_document < c.padded / 4
    assert c.saved_vs_padded == pytest.approx(1 - c.packed / c.padded)


def test_aligned_documents_tile_alike_both_ways():
    """Lengths that are whole tiles: no tile holds two documents, so fixed tiles equal tiles per document."""
    rng = np.random.default_rng(3)
    for causal in (False, True):
        lengths = [int(x) * 8 for x in rng.integers(1, 9, 6)]
        c = packed_tile_counts(lengths, None, 8, 8, causal)
        assert c.packed == c.per_document <= c.padded


def test_fixed_tiles_can_lose_to_padding_when_documents_are_equal():
    """Eight 200-token documents in 128-token tiles: nothing to pad, and tiles that straddle two documents cost
    extra -- fixed tiles over the packed row compute more than padding, tiles per document exactly as much."""
    c = packed_tile_counts([200] * 8, None, 128, 128, causal=True)
    assert c.per_document == c.padded == 8 * 3
    assert c.packed > c.padded


def test_many_short_documents_share_fixed_tiles():
    c = packed_tile_counts([1] * 100, None, 128, 128, causal=True)
    assert c == PackedTileCounts(packed=1, per_document=100, padded=100, dense=1)


def test_tile_map_is_a_tile_map():
    tm = packed_tile_map([3, 4], None, 2, 2)
    assert tm.state.dtype == np.int8 and tm.state.shape == (4, 4) and (tm.block_m, tm.block_n) == (2, 2)
    assert tm.n_computed + tm.n_skipped == 16


@pytest.mark.parametrize(
    "lq,lk,error,words",
    [
        ([], None, ValueError, "non-empty 1-D"),
        (5, None, ValueError, "non-empty 1-D"),
        ([[3, 4]], None, ValueError, "non-empty 1-D"),
        ([3, 0, 2], None, ValueError, r"lengths_q\[1\] must be at least 1"),
        ([3, -1], None, ValueError, r"lengths_q\[1\] must be at least 1"),
        ([3, 2.5], None, TypeError, r"lengths_q\[1\] must be an integer"),
        ([3, True], None, TypeError, r"lengths_q\[1\] must be an integer"),
        ([3, 4], [3], ValueError, "same documents; got 2 query lengths and 1 key lengths"),
        ([3, 4], [3, 0], ValueError, r"lengths_k\[1\] must be at least 1"),
    ],
)
def test_bad_lengths_are_named(lq, lk, error, words):
    for fn in (
        lambda: packed_tile_map(lq, lk, 4, 4),
        lambda: packed_tile_counts(lq, lk, 4, 4),
        lambda: packed_visible_mask(lq, lk),
    ):
        with pytest.raises(error, match=words):
            fn()


def test_bad_blocks_and_causal_are_named():
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        packed_tile_map([3], None, 0, 4)
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        packed_tile_counts([3], None, 4, 2.0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        packed_tile_map([3], None, 4, 4, causal="yes")


def test_numpy_lengths_and_large_batches():
    lengths = np.array([70_000, 1, 30_000], dtype=np.int32)
    c = packed_tile_counts(lengths, None, 128, 128, causal=True)
    assert all(isinstance(x, int) for x in (c.packed, c.per_document, c.padded, c.dense))
    assert c.per_document == sum(tile_map(n, n, 128, 128, causal=True).n_computed for n in (70_000, 1, 30_000))


# -- the exercise: its graded tests pass the reference solution and catch the likely wrong counts ----------------


def _solution(name="count_packed_tiles"):
    scope = {}
    exec(load_solutions(ROOT / "instructor" / "solutions")[f"03.{name}"], scope)
    return scope[name]


def test_the_exercise_tests_pass_the_reference_solution():
    tests = exercises.tests_of("03.count_packed_tiles")
    assert len(tests) >= 3
    solve = _solution()
    for test in tests:
        test(solve)


def test_the_exercise_tests_name_a_per_document_count():
    def per_document(lengths, block_m, block_n, causal=False):
        return packed_tile_counts(lengths, None, block_m, block_n, causal).per_document

    with pytest.raises(AssertionError, match="each document tiled from its own first token"):
        graded_short_documents(per_document)

    def counted(way):
        return lambda lengths, bm, bn, causal=False: getattr(packed_tile_counts(lengths, None, bm, bn, causal), way)

    for way in ("per_document", "padded", "dense"):  # each wrong count fails every test, bar one document's
        passed = []
        for test in exercises.tests_of("03.count_packed_tiles"):
            try:
                test(counted(way))
            except AssertionError:
                continue
            passed.append(test.__name__)
        assert passed in ([], ["test_packed_one_document"]), (way, passed)
