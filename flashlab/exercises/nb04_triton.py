"""Exercise for notebook 04 (the Triton kernel): write the body of the kernel's inner loop in Triton.

The learner's function runs inside ``flashlab.exercises.triton_harness``, a small Triton kernel that does everything
else (load the Q tile, walk the K/V tiles, write O = acc / l), in the learner's process, through Triton's
interpreter on the CPU. ``answer(q, k, v, block_m, block_n)`` is that kernel's output; the tests check it against the
NumPy reference on small awkward shapes, and name the lesson's mistake when the output is the one a forgotten
rescale would give.
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import RESCALE_FORGOTTEN, expect_array
from flashlab.reference import attention

EXERCISES = [
    Exercise(
        id="04.attention_inner_step",
        title="the inner loop of the Triton kernel: one key/value tile",
        signature="q, k, v, valid, m, l, acc, scale",
        imports="import triton.language as tl  # noqa: F401 -- the tl operations you will need",
        doc="""
        One step of the FlashAttention kernel's inner loop, written with triton.language (tl) operations.
        The kernel around it loads the tiles and calls it once per key/value tile; it runs inside that kernel.

        q      (BLOCK_M, BLOCK_D) fp32   this program's query tile
        k, v   (BLOCK_N, BLOCK_D) fp32   the current key and value tiles
        valid  (BLOCK_N,) bool          False for key slots past the end of the sequence (give them score -inf)
        m      (BLOCK_M,)               running max of each query row's scores
        l      (BLOCK_M,)               running sum of exp(s - m)
        acc    (BLOCK_M, BLOCK_D)       running un-normalised output
        scale  float                    1/sqrt(D)

        Returns (m_new, l_new, acc_new). The lesson's loop: scores s = q k^T * scale (tl.dot, tl.trans);
        mask invalid keys with tl.where; m_new = max(m, row max of s); alpha = exp(m - m_new);
        p = exp(s - m_new[:, None]); l_new = alpha * l + row sum of p; acc_new = alpha[:, None] * acc + p v.
        It runs as part of the kernel (decorating it with @triton.jit is optional). Calling flashlab's own
        kernel scores 0.
        """,
        time_limit_s=90.0,
        memory_mib=4096,
        triton=True,
        check_inputs=False,
        child_imports=("numpy", "torch", "triton", "triton.language"),
        harness="triton_harness",
    ),
]


def no_rescale(q, k, v, block_n):
    """What the kernel gives if the step forgets the rescale: each tile's terms added against its own max."""
    s = q @ k.T / np.sqrt(q.shape[1])  # (Nq, Nk)
    m = np.full(q.shape[0], -np.inf)
    l, acc = np.zeros(q.shape[0]), np.zeros((q.shape[0], v.shape[1]))
    for c0 in range(0, k.shape[0], block_n):
        t = s[:, c0 : c0 + block_n]
        m = np.maximum(m, t.max(axis=1))
        p = np.exp(t - m[:, None])
        l, acc = l + p.sum(axis=1), acc + p @ v[c0 : c0 + block_n]
    return acc / l[:, None]


def _run(answer, nq, nk, d, scale=1.0, block_m=16, block_n=16, what=""):
    rng = np.random.default_rng()
    q = rng.normal(0, scale, (nq, d))
    k, v = rng.normal(0, 1, (nk, d)), rng.normal(0, 1, (nk, d))
    q32, k32, v32 = (x.astype(np.float32).astype(np.float64) for x in (q, k, v))
    want, _ = attention(q32, k32, v32)
    got = answer(q32, k32, v32, block_m, block_n)
    lesson = {RESCALE_FORGOTTEN: no_rescale(q32, k32, v32, block_n)} if nk > block_n else {}
    expect_array(got, want, what or f"o for Nq = {nq}, Nk = {nk}, D = {d}", rtol=2e-4, atol=2e-4, known_wrong=lesson)


@graded("04.attention_inner_step", 2)
def test_inner_one_tile(answer):
    """a single key tile (Nk <= BLOCK_N): scores, softmax and P V in one step"""
    _run(answer, 16, 11, 16, what="o with one key tile (Nk = 11)")


@graded("04.attention_inner_step", 2)
def test_inner_many_tiles(answer):
    """many key tiles with a partial last one: the rescale between tiles, and masked key slots"""
    rng = np.random.default_rng()
    nq, nk = int(rng.integers(17, 40)), int(rng.integers(40, 90))
    if nk % 16 == 0:
        nk += 3
    _run(answer, nq, nk, 32, what=f"o for Nq = {nq}, Nk = {nk} (tiles of 16 keys)")


@graded("04.attention_inner_step", 1)
def test_inner_odd_head_dim(answer):
    """a head dim that is not a power of two (24, padded to 32 with zeros by the kernel)"""
    _run(answer, 20, 37, 24, what="o for D = 24")


@graded("04.attention_inner_step", 1)
def test_inner_huge_scores(answer):
    """scores in the hundreds: exp must be taken relative to the running max"""
    _run(answer, 16, 50, 16, scale=60.0, what="o for scores in the hundreds")
