"""Exercises for notebook 03 (tiling in NumPy): the tiled forward pass, counting the tiles a causal mask skips, and
counting the tiles a packed row of documents computes.

Masks follow flashlab's convention (``flashlab.core.masking``): aligned to the bottom-right, so with Nq queries and
Nk keys query i sees keys j <= i + (Nk - Nq).
"""

from __future__ import annotations

import numpy as np

from flashlab.core.masking import packed_tile_counts, packed_tile_map, tile_map
from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import MASK_MISALIGNED, expect_array, expect_int, unpack
from flashlab.reference import attention

EXERCISES = [
    Exercise(
        id="03.tiled_attention",
        title="the tiled FlashAttention forward pass in NumPy",
        signature="q, k, v, block_m, block_n, causal=False",
        doc="""
        Attention for one head, computed tile by tile as FlashAttention does: never build the whole score matrix.

        q  (Nq, D)    queries          block_m  query rows per tile (need not divide Nq)
        k  (Nk, D)    keys             block_n  keys per tile (need not divide Nk)
        v  (Nk, Dv)   values           causal   if True, query i sees only keys j <= i + (Nk - Nq)

        Returns o, shape (Nq, Dv): softmax(q k^T / sqrt(D)) v. For each tile of query rows keep a running max m,
        a running sum l and a running output acc; for each tile of keys compute that tile's scores, update m,
        rescale l and acc by exp(m_old - m_new), add the tile's terms; divide by l at the end. With causal=True,
        skip key tiles the mask hides entirely, mask inside the others, and give zeros to a row that sees no key.
        Use NumPy; calling flashlab's own implementation scores 0. Do not change the inputs in place.
        """,
    ),
    Exercise(
        id="03.count_causal_tiles",
        title="counting computed vs skipped tiles under a causal mask",
        signature="nq, nk, block_m, block_n",
        imports="",
        doc="""
        How many (query tile, key tile) pairs a causal tiled kernel computes and how many it skips.

        nq, nk            query and key lengths (the mask is aligned bottom-right: query i sees keys
                          j <= i + (nk - nq))
        block_m, block_n  tile sizes (the last tile of each may be shorter)

        Returns (computed, skipped), two ints: a tile is skipped when the mask hides every element of it, and
        computed otherwise (even if only one element of it is visible). computed + skipped is the number of tiles.
        With nq = nk = 1024 and 128 x 128 tiles: (36, 28).
        """,
    ),
    Exercise(
        id="03.count_packed_tiles",
        title="counting the tiles a packed row of documents computes",
        signature="lengths, block_m, block_n, causal=False",
        imports="",
        doc="""
        How many (query tile, key tile) pairs a tiled kernel computes over documents packed into one row.

        lengths           the documents' lengths, in the order they lie end to end in one row of
                          sum(lengths) tokens; the row's tokens are both the queries and the keys
        block_m, block_n  tile sizes; tiles cut the row at fixed places (0, block_m, 2 * block_m, ...) whatever
                          the documents, so one tile may hold parts of several documents
        causal            if True, a token sees only itself and the tokens before it in its own document

        A query sees only keys of its own document. Returns an int: the number of tiles holding at least one
        (query, key) pair of the same document that the query may see. Every other tile is skipped.
        With lengths [3, 5] and 4 x 4 tiles: 4 (all of them), and 3 with causal=True.
        """,
    ),
]


def _case(rng, nq, nk, d, dv, scale=1.0):
    q = rng.normal(0, scale, (nq, d))
    k = rng.normal(0, 1, (nk, d))
    v = rng.normal(0, 1, (nk, dv))
    return q, k, v


MIB = 2**20


def top_left_causal(q, k, v):
    """Causal attention with the mask aligned top-left (key j <= query i): the lesson's misalignment."""
    s = q @ k.T / np.sqrt(q.shape[1])  # (Nq, Nk)
    visible = np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None]
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    return p @ v / p.sum(axis=1, keepdims=True)


def _check(answer, q, k, v, bm, bn, causal, what):
    want, _ = attention(q, k, v, causal=causal)
    args = (q, k, v, bm, bn)
    got = answer(*args, True) if causal else answer(*args)  # the non-causal tests rely on the default
    lesson = {MASK_MISALIGNED: top_left_causal(q, k, v)} if causal and q.shape[0] < k.shape[0] else {}
    expect_array(got, want, what, rtol=1e-7, atol=1e-9, known_wrong=lesson)


@graded("03.tiled_attention", 2)
def test_tiled_random_odd_shapes(answer):
    """fresh random odd shapes, tiles that do not divide the lengths"""
    rng = np.random.default_rng()
    for _ in range(3):
        nq, nk, d, dv = (int(x) for x in rng.integers([5, 5, 3, 1], [60, 80, 40, 20]))
        bm, bn = int(rng.integers(2, 17)), int(rng.integers(2, 17))
        q, k, v = _case(rng, nq, nk, d, dv)
        _check(answer, q, k, v, bm, bn, False, f"o for q ({nq}, {d}), k ({nk}, {d}), v ({nk}, {dv}), tiles {bm}x{bn}")


@graded("03.tiled_attention", 1)
def test_tiled_extreme_tiles(answer):
    """tiles of one row/key, and tiles bigger than the whole matrix"""
    rng = np.random.default_rng()
    q, k, v = _case(rng, 7, 11, 5, 3)
    _check(answer, q, k, v, 1, 1, False, "o with 1 x 1 tiles")
    _check(answer, q, k, v, 64, 64, False, "o with tiles bigger than the matrix")


@graded("03.tiled_attention", 2)
def test_tiled_causal(answer):
    """causal, aligned bottom-right, with Nq <= Nk and tiles that cut the diagonal"""
    rng = np.random.default_rng()
    for nq, nk in ((37, 37), (13, 41)):
        q, k, v = _case(rng, nq, nk, 9, 6)
        _check(answer, q, k, v, 8, 5, True, f"causal o for Nq = {nq}, Nk = {nk}, tiles 8x5")


@graded("03.tiled_attention", 1)
def test_tiled_causal_empty_rows(answer):
    """causal with Nq > Nk: the first Nq - Nk rows see no key and come out as zeros, not NaN"""
    rng = np.random.default_rng()
    q, k, v = _case(rng, 19, 7, 4, 3)
    _check(answer, q, k, v, 4, 4, True, "causal o for Nq = 19 > Nk = 7")


@graded("03.tiled_attention", 1)
def test_tiled_huge_scores(answer):
    """scores in the thousands must not overflow: keep the running max"""
    rng = np.random.default_rng()
    q, k, v = _case(rng, 23, 29, 8, 4, scale=300.0)
    _check(answer, q, k, v, 6, 7, False, "o for scores in the thousands")


@graded("03.tiled_attention", 2, gate=True)
def test_tiled_memory_bound(answer):
    """at 3,072 queries and keys the score matrix alone is 72 MiB: a tiled pass works in a few tiles' memory"""
    rng = np.random.default_rng()
    n, d, bm, bn = 3072, 16, 384, 64
    q, k, v = _case(rng, n, n, d, d)
    got, peak = answer.measure(q, k, v, bm, bn)
    want, _ = attention(q, k, v)
    expect_array(got, want, f"o for Nq = Nk = {n}, tiles {bm}x{bn}", rtol=1e-7, atol=1e-9)
    score_bytes = n * n * 8  # float64 scores
    bound = score_bytes // 16  # room for copies of q, k, v and o (384 KiB each) and a few tiles, not for S
    inputs = q.nbytes + k.nbytes + v.nbytes  # what the grader subtracts: the process must hold them
    assert peak <= bound, (
        f"your process's peak memory, up to the end of this call, was {peak / MIB:.0f} MiB above where it stood "
        f"before your cell ran, not counting the {inputs / MIB:.3g} MiB of q, k and v (memory your cell or an "
        f"earlier call touched counts too); a tiled pass needs under {bound / MIB:.1f} MiB here (the {n} x {n} "
        f"score matrix alone is {score_bytes / MIB:.0f} MiB, one {bm} x {n} row of tiles {bm * n * 8 / MIB:.0f} "
        f"MiB): compute one {bm} x {bn} tile of scores at a time"
    )


def _want_tiles(nq, nk, bm, bn):
    tm = tile_map(nq, nk, bm, bn, causal=True)
    return tm.n_computed, tm.n_skipped


def _count(answer, nq, nk, bm, bn):
    c, s = unpack(answer(nq, nk, bm, bn), 2, f"count_causal_tiles({nq}, {nk}, {bm}, {bn})")
    want_c, want_s = _want_tiles(nq, nk, bm, bn)
    expect_int(c, want_c, f"computed tiles for nq = {nq}, nk = {nk}, tiles {bm}x{bn}")
    expect_int(s, want_s, f"skipped tiles for nq = {nq}, nk = {nk}, tiles {bm}x{bn}")


@graded("03.count_causal_tiles", 1)
def test_tiles_square(answer):
    """1024 x 1024 in 128 x 128 tiles: 36 computed, 28 skipped"""
    c, s = unpack(answer(1024, 1024, 128, 128), 2, "count_causal_tiles(1024, 1024, 128, 128)")
    expect_int(c, 36, "computed tiles, 8 x 8 grid")
    expect_int(s, 28, "skipped tiles, 8 x 8 grid")


@graded("03.count_causal_tiles", 2)
def test_tiles_random_square(answer):
    """fresh random lengths and tile sizes that do not divide them"""
    rng = np.random.default_rng()
    for _ in range(4):
        n, bm, bn = int(rng.integers(50, 3000)), int(rng.integers(8, 200)), int(rng.integers(8, 200))
        _count(answer, n, n, bm, bn)


@graded("03.count_causal_tiles", 2)
def test_tiles_random_rectangular(answer):
    """Nq != Nk: the diagonal sits at key i + (Nk - Nq); some query tiles may see nothing at all"""
    rng = np.random.default_rng()
    for _ in range(4):
        nq, nk = int(rng.integers(20, 2000)), int(rng.integers(20, 2000))
        bm, bn = int(rng.integers(8, 130)), int(rng.integers(8, 130))
        _count(answer, nq, nk, bm, bn)


@graded("03.count_causal_tiles", 1)
def test_tiles_long_sequence_half(answer):
    """at 8,192 tokens in 128 x 128 tiles causal computes just over half the tiles (2,080 of 4,096)"""
    c, s = unpack(answer(8192, 8192, 128, 128), 2, "count_causal_tiles(8192, 8192, 128, 128)")
    expect_int(c, 2080, "computed tiles at 8,192 tokens")
    expect_int(s, 2016, "skipped tiles at 8,192 tokens")


# the long-tailed batch notebook 03 draws (seed 2), and its count in 64 x 64 causal tiles
NOTEBOOK_BATCH = [109, 54, 60, 8, 545, 283, 66, 196]


def _expect_packed(answer, lengths, bm, bn, causal):
    what = f"count_packed_tiles({lengths if len(lengths) <= 12 else '[...]'}, {bm}, {bn}, causal={causal})"
    got = answer(list(lengths), bm, bn, causal)
    want = packed_tile_map(lengths, None, bm, bn, causal).n_computed
    c = packed_tile_counts(lengths, None, bm, bn, causal)
    wrong = [
        (c.per_document, "each document tiled from its own first token (the tiles here sit at fixed places)"),
        (c.padded, "every document padded to the longest one"),
        (c.dense, "every tile of the row, as if documents could see each other"),
    ]
    if causal:
        wrong.append((packed_tile_map(lengths, None, bm, bn, False).n_computed, "the count without the causal mask"))
    try:
        expect_int(got, want, what)
    except AssertionError as e:
        mistakes = [text for n, text in wrong if n == got and n != want] if isinstance(got, int) else []
        if mistakes:
            raise AssertionError(f"{e} -- {got} is what you get for {' or for '.join(mistakes)}") from None
        raise


@graded("03.count_packed_tiles", 1)
def test_packed_small_example(answer):
    """the docstring's example: lengths [3, 5] in 4 x 4 tiles, with and without causal"""
    _expect_packed(answer, [3, 5], 4, 4, False)
    _expect_packed(answer, [3, 5], 4, 4, True)


@graded("03.count_packed_tiles", 1)
def test_packed_notebook_batch(answer):
    """the notebook's long-tailed batch of 8 documents (1,321 tokens) in 64 x 64 tiles"""
    _expect_packed(answer, NOTEBOOK_BATCH, 64, 64, True)
    _expect_packed(answer, NOTEBOOK_BATCH, 64, 64, False)


@graded("03.count_packed_tiles", 2)
def test_packed_random_batches(answer):
    """fresh long-tailed batches, tile sizes that do not divide the documents, causal or not"""
    rng = np.random.default_rng()
    for _ in range(6):
        n = int(rng.integers(2, 13))
        lengths = [int(x) for x in np.ceil(rng.lognormal(np.log(40), 1.0, n))]
        bm, bn = int(rng.integers(4, 80)), int(rng.integers(4, 80))
        _expect_packed(answer, lengths, bm, bn, bool(rng.integers(2)))


@graded("03.count_packed_tiles", 1)
def test_packed_short_documents_share_a_tile(answer):
    """a hundred one-token documents fit in one 128 x 128 tile: the kernel computes that one tile"""
    _expect_packed(answer, [1] * 100, 128, 128, True)
    _expect_packed(answer, [1] * 300, 128, 128, False)


@graded("03.count_packed_tiles", 1)
def test_packed_straddling_tiles(answer):
    """eight 200-token documents in 128 x 128 tiles: tiles that hold two documents' ends are computed"""
    _expect_packed(answer, [200] * 8, 128, 128, True)
    _expect_packed(answer, [200] * 8, 128, 96, False)


@graded("03.count_packed_tiles", 1)
def test_packed_one_document(answer):
    """one document is an ordinary attention call: the count of tile_map for its length"""
    rng = np.random.default_rng()
    n, bm, bn = int(rng.integers(100, 1500)), int(rng.integers(8, 130)), int(rng.integers(8, 130))
    _expect_packed(answer, [n], bm, bn, True)
    _expect_packed(answer, [n], bm, bn, False)
