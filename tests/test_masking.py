"""flashlab.core.masking against a brute-force reading of the convention, and the tile map against the mask.

The convention (FlashAttention >= 2.1): masks align to the bottom-right corner, so query i sits on key column
i + (Nk - Nq). Causal: j <= i + Nk - Nq. Window (left, right): i + Nk - Nq - left <= j <= i + Nk - Nq + right.
The tests below spell that out with plain loops and compare.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlab.core.masking import FULL, PARTIAL, SKIPPED, TileMap, tile_map, tile_state, visible_band, visible_mask


def brute_force_mask(nq, nk, causal=False, window=None):
    """Query i may see key j? One pair at a time, straight from the definition."""
    mask = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        diag = i + nk - nq  # the key column on this query's diagonal (bottom-right aligned)
        for j in range(nk):
            ok = True
            if causal and j > diag:
                ok = False
            if window is not None:
                left, right = window
                if left is not None and j < diag - left:
                    ok = False
                if right is not None and j > diag + right:
                    ok = False
            mask[i, j] = ok
    return mask


def brute_force_tiles(mask, block_m, block_n):
    """SKIPPED if no element of the tile is visible, FULL if all are, PARTIAL otherwise."""
    nq, nk = mask.shape
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    state = np.empty((n_m, n_n), dtype=np.int8)
    for ti in range(n_m):
        for tj in range(n_n):
            tile = mask[ti * block_m : (ti + 1) * block_m, tj * block_n : (tj + 1) * block_n]
            state[ti, tj] = SKIPPED if not tile.any() else FULL if tile.all() else PARTIAL
    return state


WINDOWS = [None, (0, 0), (2, 0), (0, 3), (3, 1), (None, 2), (4, None), (None, None), (0, None), (100, 100)]
SHAPES = [(1, 1), (1, 9), (9, 1), (7, 7), (5, 11), (11, 5), (13, 13), (16, 33), (33, 16)]


# ---------------------------------------------------------------------------------------------- the mask itself


@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_mask_matches_the_definition(nq, nk, causal, window):
    np.testing.assert_array_equal(visible_mask(nq, nk, causal, window), brute_force_mask(nq, nk, causal, window))


def test_causal_square_is_lower_triangular():
    np.testing.assert_array_equal(visible_mask(6, 6, causal=True), np.tril(np.ones((6, 6), dtype=bool)))


def test_causal_is_bottom_right_aligned_when_nq_differs_from_nk():
    # 2 queries that are the last 2 of 5 tokens: the first sees keys 0..3, the second all 5
    np.testing.assert_array_equal(
        visible_mask(2, 5, causal=True), np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool)
    )
    # more queries than keys: the first rows see nothing at all
    m = visible_mask(5, 2, causal=True)
    np.testing.assert_array_equal(m.sum(axis=1), [0, 0, 0, 1, 2])


def test_decode_row_sees_every_key_under_causal():
    assert visible_mask(1, 17, causal=True).all()


def test_sliding_window_counts():
    # window (2, 0) on a square: each query sees itself and up to 2 keys before it
    np.testing.assert_array_equal(visible_mask(6, 6, window=(2, 0)).sum(axis=1), [1, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(visible_mask(6, 6, window=(0, 0)), np.eye(6, dtype=bool))


def test_causal_clips_the_window_right_side():
    assert visible_band(4, 4, causal=True, window=(2, 5)) == (0, 2, 0)
    np.testing.assert_array_equal(visible_mask(6, 6, True, (2, 5)), visible_mask(6, 6, False, (2, 0)))


def test_visible_band_values():
    assert visible_band(3, 8) == (5, float("inf"), float("inf"))
    assert visible_band(8, 3, causal=True) == (-5, float("inf"), 0)
    assert visible_band(4, 4, window=(None, 1)) == (0, float("inf"), 1)
    assert visible_band(4, 4, window=[3, None]) == (0, 3, float("inf"))
    assert visible_band(4, 4, window=(np.int64(2), np.int32(1))) == (0, 2, 1)


@pytest.mark.parametrize(
    "window",
    [(-1, 0), (0, -2), (1.5, 0), (0, "3"), (True, 0), 3, (1, 2, 3), (1,), "ab", np.array([1, 2])],
)
def test_bad_window_raises_value_error_naming_window(window):
    with pytest.raises(ValueError, match="window"):
        visible_band(4, 4, window=window)
    with pytest.raises(ValueError, match="window"):
        visible_mask(4, 4, window=window)


# ---------------------------------------------------------------------------------------------- tiles


@pytest.mark.parametrize("nq,nk", SHAPES + [(64, 64), (100, 37), (37, 100)])
@pytest.mark.parametrize("block_m,block_n", [(1, 1), (2, 3), (4, 4), (5, 2), (7, 16), (64, 64)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (True, (5, None))])
def test_tile_map_matches_brute_force_classification(nq, nk, block_m, block_n, causal, window):
    tm = tile_map(nq, nk, block_m, block_n, causal, window)
    expected = brute_force_tiles(brute_force_mask(nq, nk, causal, window), block_m, block_n)
    np.testing.assert_array_equal(tm.state, expected)
    assert (tm.nq, tm.nk, tm.block_m, tm.block_n) == (nq, nk, block_m, block_n)


@settings(max_examples=150, deadline=None)
@given(
    nq=st.integers(1, 40),
    nk=st.integers(1, 40),
    block_m=st.integers(1, 12),
    block_n=st.integers(1, 12),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 20)),
    right=st.one_of(st.none(), st.integers(0, 20)),
    use_window=st.booleans(),
)
def test_tile_map_property(nq, nk, block_m, block_n, causal, left, right, use_window):
    window = (left, right) if use_window else None
    mask = brute_force_mask(nq, nk, causal, window)
    np.testing.assert_array_equal(visible_mask(nq, nk, causal, window), mask)
    np.testing.assert_array_equal(
        tile_map(nq, nk, block_m, block_n, causal, window).state, brute_force_tiles(mask, block_m, block_n)
    )


def test_tile_state_corners():
    band = visible_band(8, 8, causal=True)
    assert tile_state(0, 4, 4, 8, band) == SKIPPED  # strictly above the diagonal
    assert tile_state(4, 8, 0, 4, band) == FULL  # strictly below
    assert tile_state(0, 4, 0, 4, band) == PARTIAL  # on the diagonal


def test_no_mask_computes_every_tile():
    tm = tile_map(100, 70, 16, 32)
    assert tm.n_skipped == 0 and tm.fraction_computed == 1.0 and (tm.state == FULL).all()


def test_causal_computes_about_half_the_tiles():
    # square causal with 64 tiles a side: the diagonal and below, 64 * 65 / 2 of 64 * 64
    tm = tile_map(64 * 16, 64 * 16, 16, 16, causal=True)
    assert tm.n_computed == 64 * 65 // 2
    assert tm.n_skipped == 64 * 63 // 2
    assert tm.fraction_computed == pytest.approx(65 / 128)
    assert (tm.state.diagonal() == PARTIAL).all()
    assert (tm.state[np.tril_indices(64, -1)] == FULL).all()
    assert (tm.state[np.triu_indices(64, 1)] == SKIPPED).all()


def test_sliding_window_computes_a_band_of_tiles():
    # window (31, 0) with 16-wide tiles: each query tile touches its own diagonal tile and at most 2 before it
    tm = tile_map(256, 256, 16, 16, window=(31, 0))
    assert tm.computed.sum(axis=1).max() <= 3
    assert tm.fraction_computed < 0.2


def test_tile_map_properties_are_consistent():
    tm = tile_map(50, 30, 8, 8, causal=True)
    assert isinstance(tm, TileMap)
    assert tm.n_computed + tm.n_skipped == tm.state.size
    np.testing.assert_array_equal(tm.computed, ~tm.skipped)
    assert tm.fraction_computed == tm.n_computed / tm.state.size


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None, "3"])
def test_tile_map_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_m"):
        tile_map(8, 8, bad, 4)
    with pytest.raises(ValueError, match="block_n"):
        tile_map(8, 8, 4, bad)


def test_tile_map_accepts_numpy_ints():
    assert tile_map(8, 8, np.int64(4), np.int32(2)).state.shape == (2, 4)


def tile_map_by_loop(nq, nk, block_m, block_n, causal=False, window=None):
    """The tile map the way it used to be built: one ``tile_state`` call per tile, in Python loops."""
    band = visible_band(nq, nk, causal, window)
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    state = np.empty((n_m, n_n), dtype=np.int8)
    for ti in range(n_m):
        r0, r1 = ti * block_m, min((ti + 1) * block_m, nq)
        for tj in range(n_n):
            c0, c1 = tj * block_n, min((tj + 1) * block_n, nk)
            state[ti, tj] = tile_state(r0, r1, c0, c1, band)
    return state


@settings(max_examples=200, deadline=None)
@given(
    nq=st.integers(1, 300),
    nk=st.integers(1, 300),
    block_m=st.integers(1, 40),
    block_n=st.integers(1, 40),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 400)),
    right=st.one_of(st.none(), st.integers(0, 400)),
)
def test_vectorised_tile_map_equals_the_loop(nq, nk, block_m, block_n, causal, left, right):
    tm = tile_map(nq, nk, block_m, block_n, causal, (left, right))
    np.testing.assert_array_equal(tm.state, tile_map_by_loop(nq, nk, block_m, block_n, causal, (left, right)))
    assert tm.state.dtype == np.int8


def test_tile_map_of_100k_tokens_in_16_tiles_takes_seconds_not_minutes():
    import time

    start = time.perf_counter()
    tm = tile_map(10**5, 10**5, 16, 16, causal=True)
    elapsed = time.perf_counter() - start
    assert tm.state.shape == (6250, 6250)
    assert tm.n_computed == 6250 * 6251 // 2  # the diagonal tiles and everything below them
    assert elapsed < 30, f"tile_map took {elapsed:.1f} s"  # the loop took minutes; vectorised ~1 s


@pytest.mark.parametrize("nq, nk", [(0, 8), (8, 0), (0, 0)])
def test_tile_map_refuses_empty_lengths(nq, nk):
    # an attention call has at least one query and one key; an empty map would make fraction_computed 0 / 0
    with pytest.raises(ValueError, match="at least 1"):
        tile_map(nq, nk, 4, 4)


@pytest.mark.parametrize("causal", ["yes", 1, None, "False"])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(TypeError, match="causal must be True or False"):
        visible_band(4, 4, causal=causal)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tile_map(4, 4, 2, 2, causal=causal)


def test_numpy_bool_causal_is_fine():
    np.testing.assert_array_equal(visible_mask(5, 5, np.bool_(True)), visible_mask(5, 5, True))


@pytest.mark.parametrize("side", [9, 10**6, 2**62, 2**63 - 1, 2**63, 2**64, 10**40])
def test_window_sides_at_least_as_wide_as_the_matrix_are_unbounded(side):
    # query i's band reaches i + offset +- side; once side >= nq + nk it covers every key, whatever its size --
    # and int64 arithmetic on 2**63 - 1 would wrap around
    assert visible_band(4, 5, window=(side, side)) == (1, float("inf"), float("inf"))
    np.testing.assert_array_equal(visible_mask(4, 5, window=(side, 0)), visible_mask(4, 5, window=(None, 0)))
    wide, unbounded = tile_map(4, 5, 2, 2, window=(0, side)), tile_map(4, 5, 2, 2, window=(0, None))
    np.testing.assert_array_equal(wide.state, unbounded.state)


def test_window_sides_narrower_than_the_matrix_are_kept():
    assert visible_band(4, 5, window=(8, np.int64(3))) == (1, 8, 3)
