"""The Hopper varlen forward (``flashlab.kernels.varlen.hopper``) on Triton's interpreter, against float64 attention on
each sequence's slice: the tiles copied through descriptors that end at each sequence's last row, the grid of the
tiles that exist (each program finding its sequence on the device), GQA, causal and window masks aligned to each
sequence's end, lengths 0 and 1, Nq != Nk. And what the descriptors' ends promise: a neighbouring sequence's
inf or NaN never reaches another sequence, and no program writes another sequence's rows."""

from __future__ import annotations

import pytest
import torch
from test_varlen import check_forward, packed_case, varlen_attention_float64

from flashlab.core.integers import cdiv
from flashlab.kernels.device import CPU_CONFIG, kernel_band
from flashlab.kernels.varlen import hopper as varlen_hopper

# (query lengths, key lengths, Hq, Hk, causal, window, dtype): a 0 and a 1 in every batch, Nq != Nk, sequences
# longer than a tile and shorter
CASES = [
    ([5, 0, 37, 1], [9, 3, 40, 4], 4, 2, False, None, torch.float16),
    ([5, 0, 37, 1], [9, 3, 40, 4], 4, 2, True, None, torch.bfloat16),
    ([3, 1, 0, 45, 17], [3, 0, 6, 50, 17], 3, 1, True, None, torch.float16),
    ([33, 1, 0, 6], [33, 2, 5, 0], 2, 2, False, (4, 3), torch.bfloat16),
    ([20, 1, 0], [50, 1, 2], 4, 1, True, (7, None), torch.float16),
    ([0, 18, 0], [0, 21, 3], 2, 1, True, None, torch.bfloat16),  # the first sequence ends at row 0 of q and k
]


def run(q, k, v, cu_q, cu_k, lq, lk, causal, window, o=None):
    band = kernel_band(max(lq), max(lk), q.shape[-1], causal, window, None)[1:4]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    varlen_hopper.launch(q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal, window, band)
    return o, lse


@pytest.mark.parametrize("lq, lk, hq, hk, causal, window, dtype", CASES)
def test_forward_equals_float64_per_sequence(lq, lk, hq, hk, causal, window, dtype):
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, hq, hk, 64, dtype, seed=len(lq) + hq)
    o, lse = run(q, k, v, cu_q, cu_k, lq, lk, causal, window)
    check_forward(o, lse, *varlen_attention_float64(q, k, v, cu_q, cu_k, causal, window), cu_q, dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy, on the poisoned sequence
def test_a_neighbours_inf_and_nan_stay_in_their_sequence():
    """The key tiles of sequence 0 run on into sequence 1's keys; the descriptor ends at sequence 0's last key, so
    those rows arrive as zeros and sequence 1's inf and NaN never meet another sequence's rows."""
    lq, lk = [7, 5, 9], [7, 6, 9]
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, 2, 1, 64, torch.float16, seed=3)
    clean_o, clean_lse = run(q, k, v, cu_q, cu_k, lq, lk, True, None)
    check_forward(clean_o, clean_lse, *varlen_attention_float64(q, k, v, cu_q, cu_k, True), cu_q, torch.float16)
    k[int(cu_k[1])], v[int(cu_k[1]) + 1] = float("inf"), float("nan")
    o, lse = run(q, k, v, cu_q, cu_k, lq, lk, True, None)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[int(cu_q[1]) : int(cu_q[2])] = False
    assert torch.equal(o[others], clean_o[others]) and torch.equal(lse[:, others], clean_lse[:, others])
    assert not torch.isfinite(o[~others]).all()  # the poisoned sequence itself does see its keys


def test_every_row_is_written_by_its_own_sequence_only():
    """o starts as NaN: every real row comes out right (so written), though the last tile of a sequence reaches
    into the next one's rows: its store is cut at the sequence's end, or, causal (the slots walked from the last),
    it would overwrite them after their own program wrote them."""
    lq, lk = [19, 3, 26], [19, 10, 30]
    assert any(n % CPU_CONFIG["BLOCK_M"] for n in lq), "a sequence must end inside a tile"
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, 2, 2, 64, torch.bfloat16, seed=4)
    o, lse = run(q, k, v, cu_q, cu_k, lq, lk, True, None, o=torch.full_like(q, float("nan")))
    check_forward(o, lse, *varlen_attention_float64(q, k, v, cu_q, cu_k, True), cu_q, torch.bfloat16)


def test_the_grid_holds_every_tile_and_at_most_one_empty_slot_a_sequence():
    """Sequence b's tiles start at slot ``cu_q[b] // BLOCK_M + b``: they never overlap the next sequence's, and the
    grid's ``cdiv(total_q, BLOCK_M) + B`` slots hold every sequence's last tile, whatever the lengths."""
    g = torch.Generator().manual_seed(0)
    for bm in (16, 64, 128):
        for _ in range(50):
            lengths = torch.randint(0, 3 * bm, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            first = [cu[b] // bm + b for b in range(len(lengths))]
            for b, n in enumerate(lengths):
                end = first[b] + cdiv(n, bm)  # past sequence b's last tile
                assert b + 1 == len(lengths) or end <= first[b + 1]
                assert end <= cdiv(cu[-1], bm) + len(lengths)
                assert b + 1 == len(lengths) or first[b + 1] - end <= 1  # at most one empty slot between


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda q, k: (q.float(), k.float()), "16-bit inputs only"),
        (lambda q, k: (q[..., :32].contiguous(), k[..., :32].contiguous()), "head dims"),
        (lambda q, k: (q.transpose(0, 1).contiguous().transpose(0, 1), k), "packed rows of heads"),
    ],
)
def test_what_it_cannot_run_is_said(make, why):
    q, k, _, _, _, _ = packed_case([4, 4], [4, 4], 2, 2, 64, torch.float16)
    q, k = make(q, k)
    assert why in varlen_hopper.unavailable(q, k, k)


def copy_engine_grads(q, k, v, do, cu_q, cu_k, lq, lk, causal, window, scale=None):
    """dq, dk, dv from ``varlen_hopper.launch_backward`` on the interpreter, its statistics made as the
    preprocess makes them (delta = rowsum(dO * O), lse in log2 units, +inf where a row saw no key), rows padded to
    ``STATS_ALIGN``."""
    import math

    from flashlab import flash_attention_varlen

    d = q.shape[-1]
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, window=window,
                                    scale=scale, return_lse=True)  # fmt: skip
    hq, total = lse.shape
    delta = torch.full((hq, varlen_hopper.stats_stride(total, len(lq))), float("nan"))  # padding never read
    lse2 = torch.full_like(delta, float("nan"))
    end = 0
    for b in range(len(lq)):  # sequence b's rows at a multiple of STATS_ALIGN, after the previous sequence's
        start = (int(cu_q[b]) // varlen_hopper.STATS_ALIGN + b) * varlen_hopper.STATS_ALIGN
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert start >= end and start + lq[b] <= delta.shape[1], "the layout must leave room"
        end = start + lq[b]
        delta[:, start:end] = (o[rows].float() * do[rows].float()).sum(-1).T
        lse2[:, start:end] = torch.where(torch.isinf(lse[:, rows]), float("inf"), lse[:, rows] * 1.4426950408889634)
    _, win_left, win_right, qk_scale, negate = kernel_band(max(lq), max(lk), d, causal, window, scale)
    signed = 1 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    varlen_hopper.launch_backward(-q if negate else q, k, v, do, dq, dk, dv, lse2, delta, cu_q, cu_k, max(lq),
                                  max(lk), (win_left, win_right, qk_scale), abs(signed), signed)  # fmt: skip
    return dq, dk, dv


@pytest.mark.parametrize("lq, lk, hq, hk, causal, window, dtype", CASES)
def test_backward_equals_float64_per_sequence(lq, lk, hq, hk, causal, window, dtype):
    """dq, dk, dv of the copy-engine backward: every packed row written (a sequence without queries still gets its
    zero dk, dv), against float64 autograd per sequence."""
    from test_varlen import varlen_grads_float64

    from flashlab.core.numerics import grad_tolerance, relative_error

    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, hq, hk, 64, dtype, seed=len(lq) + hq + 1)
    got = copy_engine_grads(q, k, v, do, cu_q, cu_k, lq, lk, causal, window)
    refs = varlen_grads_float64(q, k, v, do, cu_q, cu_k, causal, window)
    for name, x, ref in zip("qkv", got, refs, strict=True):
        assert torch.isfinite(x).all(), f"d{name}: a row left unwritten or not finite"
        err = relative_error(x, ref)
        assert err <= grad_tolerance(dtype), f"d{name}: relative error {err:.2e}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy, on the poisoned sequence
def test_the_backward_keeps_a_neighbours_nan_in_its_sequence():
    lq, lk = [9, 5, 11], [9, 6, 13]
    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, 2, 1, 64, torch.float16, seed=5)
    clean = copy_engine_grads(q, k, v, do, cu_q, cu_k, lq, lk, True, None)
    k[int(cu_k[1]) + 2], v[int(cu_k[1])] = float("nan"), float("inf")
    q[int(cu_q[1])] = float("nan")
    dirty = copy_engine_grads(q, k, v, do, cu_q, cu_k, lq, lk, True, None)
    for i, cu in ((0, cu_q), (1, cu_k), (2, cu_k)):
        others = torch.ones(cu[-1], dtype=torch.bool)
        others[int(cu[1]) : int(cu[2])] = False
        assert torch.equal(dirty[i][others], clean[i][others]), "dqkv"[i]


def test_boundaries_of_no_rows_write_nothing():
    """The boundaries a bad call is given instead (``varlen.checked_boundaries``: every sequence empty): no program
    finds a row, and the outputs keep what they held (NaN there)."""
    lq, lk = [6, 9], [6, 9]
    q, k, v, do, _, _ = packed_case(lq, lk, 2, 1, 64, torch.float16, seed=6)
    empty = torch.zeros(3, dtype=torch.int32)
    o, lse = run(q, k, v, empty, empty, lq, lk, True, None, o=torch.full_like(q, float("nan")))
    assert torch.isnan(o).all()
    stats = torch.zeros(2, varlen_hopper.stats_stride(q.shape[0], 2))
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    band = kernel_band(max(lq), max(lk), 64, True, None, None)[1:4]
    varlen_hopper.launch_backward(q, k, v, do, *grads, stats, stats, empty, empty, max(lq), max(lk), band, 0.125, 0.125)
    assert all(torch.isnan(g).all() for g in grads)
