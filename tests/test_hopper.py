"""Rung 3 of the kernel ladder, ``flashlab.kernels.ladder.rung3_hopper``, on CPU tensors through Triton's interpreter.

- ``hidden_sides`` (which edges of the band hide real keys, so which element masks the loop applies) against a
  brute-force reading of ``flashlab.core.masking.visible_mask``;
- ``rows_stacked``: which layouts its 2-D descriptors over the rows of all heads can describe;
- the repair pass: hidden keys whose V rows hold NaN do not reach rows that never see them (the main kernel's
  plain ``P V`` marks the rows it poisoned with a NaN lse, the second launch redoes their tiles with the guarded
  ``P V``), on the diagonal's side and on the window's left edge; on finite inputs the pass is launched wherever
  the mask hides keys, not launched where it hides none, and changes no bit;
- where it runs and when it is picked: float32 refused with a reason, never preferred on CPU tensors, the
  preferred head dims and lengths on a GPU, and ``ladder.select`` honouring a rung's ``preferred``;
- odd shapes against the float64 reference (``flashlab.reference.torch_float64``): lengths that are not multiples
  of the tile, grouped-query heads, padded head dims, causal with Nq < Nk and Nq > Nk (rows that see no key), a
  window on both sides, rows at a padded row stride.

Every expected value comes from the float64 reference, from ``visible_mask`` or from another rung; the kernel runs
on the interpreter with ``CPU_CONFIG`` tiles (16 x 16), so the shapes are a few tiles each.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_ladder import LSE_TOL, assert_matches_float64, make_qkv

from flashlab import flash_attention
from flashlab.core.masking import visible_mask
from flashlab.core.numerics import relative_error, tolerance
from flashlab.kernels import ladder
from flashlab.kernels.device import CPU_CONFIG, kernel_band
from flashlab.kernels.ladder import rung3_hopper as hopper
from flashlab.reference.torch_float64 import attention_float64

BLOCK_M, BLOCK_N = CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's warnings for the NaN inputs below


def band_of(nq, nk, causal, window):
    """The band ``(offset, win_left, win_right, qk_scale)`` as the kernels take it, for lengths nq, nk."""
    return kernel_band(nq, nk, 16, causal, window, None)[:4]


def run_hopper(q, k, v, causal=False, window=None):
    """``(o, lse)`` from the hopper rung, which must run here (no fallback warning)."""
    assert ladder.rung_named(hopper.NAME).unavailable(q, k, v, causal, window) is None
    return flash_attention(q, k, v, causal=causal, window=window, return_lse=True, rung=hopper.NAME)


def finite_rows(o):
    """(B, H, N) True where a row of the output is finite in every column."""
    return torch.isfinite(o).all(-1)


# ---- which edges of the band hide real keys ------------------------------------------------------------------------


def brute_force_sides(nq, nk, causal, window):
    """From the mask alone: does some row have a hidden key left of the keys it sees (right of them)?

    A row that sees no key lies wholly on one side: its diagonal key ``i + nk - nq`` (always visible when it is a
    key) is before key 0, so every key is on its right, or past the last key, so every key is on its left."""
    mask = visible_mask(nq, nk, causal, window)
    left = right = False
    for i, row in enumerate(mask):
        seen = np.flatnonzero(row)
        if seen.size:
            left |= bool(seen[0] > 0)
            right |= bool(seen[-1] < nk - 1)
        else:
            diag = i + nk - nq
            assert diag < 0 or diag >= nk  # a key on the diagonal would be visible
            right |= diag < 0
            left |= diag >= nk
    return left, right


SIDE_SHAPES = [(5, 5), (3, 9), (9, 3), (1, 6), (6, 1), (20, 33)]
SIDE_MASKS = [
    (False, None),
    (True, None),
    (False, (3, 0)),
    (False, (0, 5)),
    (False, (None, 2)),
    (False, (3, None)),
    (True, (2, None)),
    (False, (0, 0)),
    (False, (50, 50)),  # wider than every matrix here: hides nothing
    (True, (None, None)),
]


@pytest.mark.parametrize("causal, window", SIDE_MASKS, ids=lambda x: str(x))
@pytest.mark.parametrize("nq, nk", SIDE_SHAPES, ids=lambda x: str(x))
def test_hidden_sides_match_the_mask(nq, nk, causal, window):
    assert hopper.hidden_sides(nq, nk, band_of(nq, nk, causal, window)) == brute_force_sides(nq, nk, causal, window)


def test_hidden_sides_covers_each_combination():
    # the cases above are not all one answer: each (left, right) pair occurs
    seen = {brute_force_sides(nq, nk, c, w) for nq, nk in SIDE_SHAPES for c, w in SIDE_MASKS}
    assert seen == {(False, False), (True, False), (False, True), (True, True)}


# ---- the layouts its descriptors describe --------------------------------------------------------------------------


def transposed(b, n, h, d):
    """A (B, H, N, D) view of a (B, N, H, D) tensor: the heads of one row next to each other."""
    return torch.zeros(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)


def misaligned(shape):
    """A contiguous bf16 tensor starting one element (2 bytes) past a 16-byte boundary."""
    flat = torch.zeros(int(np.prod(shape)) + 8, dtype=torch.bfloat16)
    assert flat.data_ptr() % 16 == 0
    return flat[1 : 1 + int(np.prod(shape))].view(shape)


ROWS_STACKED = [
    ("contiguous", lambda: torch.zeros(2, 3, 5, 16, dtype=torch.bfloat16), True),
    ("contiguous-d8", lambda: torch.zeros(2, 3, 5, 8, dtype=torch.bfloat16), True),
    ("contiguous-fp16-d24", lambda: torch.zeros(1, 2, 7, 24, dtype=torch.float16), True),
    ("rows-of-8-bytes", lambda: torch.zeros(2, 3, 5, 4, dtype=torch.bfloat16), False),
    ("transposed", lambda: transposed(2, 5, 3, 16), False),
    ("transposed-one-batch", lambda: transposed(1, 5, 3, 16), False),  # the heads still interleave
    ("transposed-one-head", lambda: transposed(2, 5, 1, 16), True),  # the same memory as contiguous
    ("transposed-one-row", lambda: transposed(2, 1, 3, 16), True),
    ("last-dim-strided", lambda: torch.zeros(2, 3, 5, 32, dtype=torch.bfloat16)[..., ::2], False),
    ("padded-rows-48-bytes", lambda: torch.zeros(2, 3, 5, 24, dtype=torch.bfloat16)[..., :16], True),
    ("padded-rows-40-bytes", lambda: torch.zeros(2, 3, 5, 20, dtype=torch.bfloat16)[..., :16], False),
    ("every-other-batch", lambda: torch.zeros(4, 3, 5, 16, dtype=torch.bfloat16)[::2], False),
    ("every-other-head", lambda: torch.zeros(2, 6, 5, 16, dtype=torch.bfloat16)[:, ::2], False),
    ("one-batch-of-every-other-head", lambda: torch.zeros(1, 6, 5, 16, dtype=torch.bfloat16)[:, ::2], False),
    ("misaligned-start", lambda: misaligned((2, 3, 5, 16)), False),
]


@pytest.mark.parametrize("make, stacked", [c[1:] for c in ROWS_STACKED], ids=[c[0] for c in ROWS_STACKED])
def test_rows_stacked_accepts_exactly_the_layouts_of_one_2d_tensor(make, stacked):
    x = make()
    assert hopper.rows_stacked(x) is stacked
    if stacked:  # the rows of every head, one after another, at one row stride: row r of the 2-D tensor is
        b, h, n, d = x.shape  # (batch, head, row) = divmod chains of r, at address base + r * row stride
        row = x.stride(2) if n > 1 else d
        idx = torch.arange(b * h * n)
        bi, hi, ni = idx // (h * n), idx // n % h, idx % n
        offsets = bi * x.stride(0) + hi * x.stride(1) + ni * x.stride(2)
        assert torch.equal(offsets, idx * row)


# ---- the repair pass -----------------------------------------------------------------------------------------------


@pytest.fixture
def repair_calls(monkeypatch):
    """Record the repair launches; ``skip=True`` makes the launch a no-op (the main kernel's output as it is)."""
    real = hopper.repair
    state = SimpleNamespace(calls=0, skip=False)

    def recording(*args, **kwargs):
        state.calls += 1
        if not state.skip:
            real(*args, **kwargs)

    monkeypatch.setattr(hopper, "repair", recording)
    return state


# (id, causal, window, the keys whose V rows hold NaN, which rows see none of them): the diagonal hides keys >= 30
# from the rows before 30 (MASK_RIGHT); the window's left edge hides keys < 5 from the rows from 9 on (MASK_LEFT).
# In both, a key tile that holds NaN keys is also loaded by rows that do not see them.
POISON = [
    ("causal", True, None, slice(30, None), lambda i: i < 30),
    ("window-left", False, (4, 2), slice(0, 5), lambda i: i >= 9),
]


def poisoned_inputs(nan_keys, seed):
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, torch.bfloat16, seed=seed)
    bad = v.clone()
    bad[:, :, nan_keys] = float("nan")
    return q, k, v, bad


@pytest.mark.parametrize("causal, window, nan_keys, clean_row", [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_nan_values_of_hidden_keys_reach_only_the_rows_that_see_them(causal, window, nan_keys, clean_row):
    q, k, v, bad = poisoned_inputs(nan_keys, seed=11)
    assert any(hopper.hidden_sides(40, 40, band_of(40, 40, causal, window)))
    o, lse = run_hopper(q, k, bad, causal, window)
    clean = torch.tensor([clean_row(i) for i in range(40)])
    assert torch.equal(finite_rows(o), clean.expand(1, 2, 40)), "finite exactly on the rows that see no NaN key"
    ref_o, ref_lse = attention_float64(q, k, v, causal, window)  # the clean inputs: V does not change the lse
    err = relative_error(o[:, :, clean], ref_o[:, :, clean])
    assert err <= tolerance(torch.bfloat16), f"relative error {err:.2e} on the rows that see no NaN key"
    gap = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
    assert gap.max().item() < LSE_TOL, "every row's lse, poisoned or not, is the clean one (no mark left behind)"
    lower = flash_attention(q, k, bad, causal=causal, window=window, rung="skip_split")
    assert torch.equal(finite_rows(lower), finite_rows(o))
    assert relative_error(o[:, :, clean], lower[:, :, clean]) <= tolerance(torch.bfloat16)


@pytest.mark.parametrize("causal, window, nan_keys, clean_row", [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_without_the_repair_the_poisoned_rows_are_marked_with_a_nan_lse(repair_calls, causal, window, nan_keys,
                                                                        clean_row):  # fmt: skip
    q, k, v, bad = poisoned_inputs(nan_keys, seed=12)
    repair_calls.skip = True
    o, lse = run_hopper(q, k, bad, causal, window)
    assert repair_calls.calls == 1
    bad_rows = ~finite_rows(o)
    assert torch.equal(torch.isnan(lse), bad_rows), "a NaN lse exactly on the rows that came out non-finite"
    clean = torch.tensor([clean_row(i) for i in range(40)])
    assert (bad_rows & clean).any(), "the plain P V reached rows that see no NaN key: the case needs the repair"
    assert bad_rows[:, :, ~clean].all(), "and every row that sees one"


@pytest.mark.parametrize(
    "causal, window, nk, launched",
    [
        (True, None, 48, True),
        (False, (3, None), 48, True),
        (False, (None, 0), 48, True),
        (False, None, 48, False),
        (False, (100, 100), 48, False),
        (False, None, 40, True),
    ],
    ids=["causal", "window-left", "window-right", "no-mask", "window-wider-than-the-matrix", "no-mask-key-tail"],
)
def test_the_repair_pass_is_launched_only_where_a_tile_holds_keys_to_ignore(repair_calls, causal, window, nk,
                                                                            launched):  # fmt: skip
    # keys a row must ignore: those the band hides, and past the end of K (a key count off the 16-key tile) the
    # next head's first rows, which the last key tile reads through the stacked 2-D descriptor
    q, k, v = make_qkv(1, 2, 1, 40, nk, 16, torch.bfloat16, seed=13)
    hides = any(hopper.hidden_sides(40, nk, band_of(40, nk, causal, window)))
    assert launched == (hides or nk % BLOCK_N != 0)
    run_hopper(q, k, v, causal, window)
    assert repair_calls.calls == (1 if launched else 0)


@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, (5, 3)), (False, None)], ids=["causal", "window", "key-tail"]
)
def test_on_finite_inputs_the_repair_pass_changes_no_bit(repair_calls, causal, window):
    q, k, v = make_qkv(1, 2, 1, 40, 37, 24, torch.bfloat16, seed=14)
    o, lse = run_hopper(q, k, v, causal, window)
    repair_calls.skip = True
    o_main, lse_main = run_hopper(q, k, v, causal, window)
    assert repair_calls.calls == 2
    assert not torch.isnan(lse_main).any(), "finite inputs: no row marked"
    assert torch.equal(o, o_main) and torch.equal(lse, lse_main)
    assert_matches_float64(o, lse, *attention_float64(q, k, v, causal, window), torch.bfloat16)


# ---- where it runs, and when it is picked --------------------------------------------------------------------------


def test_unavailable_refuses_float32_and_runs_16_bit_inputs_on_cpu():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32, seed=15)
    why = hopper.unavailable(q, k, v, True, None)
    assert isinstance(why, str) and "float32" in why
    for dtype in (torch.bfloat16, torch.float16):
        assert hopper.unavailable(q.to(dtype), k.to(dtype), v.to(dtype), True, None) is None


def test_a_named_hopper_rung_on_float32_warns_and_falls_back():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, torch.float32, seed=16)
    with pytest.warns(RuntimeWarning, match="rung 'hopper' cannot run here .*float32.*'skip_split'"):
        o = flash_attention(q, k, v, causal=True, rung="hopper")
    assert relative_error(o, attention_float64(q, k, v, True)[0]) <= tolerance(torch.float32)


def test_never_preferred_on_cpu_tensors():
    q, k, v = make_qkv(1, 1, 1, 1024, 1024, 128, torch.bfloat16, seed=17)  # the GPU's preferred shape
    assert hopper.preferred(q, k, v, True, None) is False


def cuda_like(nq, nk, d):
    """Stand-ins with what ``preferred`` reads of a CUDA tensor: its device kind and its shape."""
    return (SimpleNamespace(is_cuda=True, shape=(1, 1, nq, d)), SimpleNamespace(is_cuda=True, shape=(1, 1, nk, d)))


@pytest.mark.parametrize(
    "nq, nk, d, picked",
    [(1024, 1024, 128, True), (2048, 4096, 65, True), (1024, 1024, 96, True), (1024, 1024, 64, False),
     (1024, 1024, 129, False), (1024, 1024, 256, False), (1023, 4096, 128, False), (4096, 1023, 128, False)],
    ids=lambda x: str(x),
)  # fmt: skip
def test_preferred_on_a_gpu_at_head_dims_65_to_128_from_1024_keys_and_queries(nq, nk, d, picked):
    q, k = cuda_like(nq, nk, d)
    assert hopper.preferred(q, k, k, True, None) is picked


def test_rung_none_on_cpu_picks_skip_split_for_16_bit_inputs():
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = make_qkv(1, 2, 1, 40, 70, 16, dtype, seed=18)  # Nq = 40: past split-KV's few query rows
        assert ladder.rung_named("hopper").unavailable(q, k, v, True, None) is None  # it could run
        assert ladder.select(None, q, k, v, True, None) == (ladder.rung_named("skip_split"), None)


@pytest.mark.parametrize("preferred, picked", [(True, "hopper"), (False, "skip_split")])
def test_select_honours_a_rungs_preferred(monkeypatch, preferred, picked):
    stand_in = dataclasses.replace(ladder.rung_named("hopper"), preferred=lambda *a: preferred)
    monkeypatch.setattr(ladder, "RUNGS", tuple(stand_in if r.name == "hopper" else r for r in ladder.RUNGS))
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.bfloat16, seed=19)
    chosen, note = ladder.select(None, q, k, v, True, None)
    assert (chosen.name, note) == (picked, None)
    assert ladder.select("hopper", q, k, v, True, None)[0].name == "hopper"  # a name runs it, preferred or not


# ---- odd shapes against the float64 reference ----------------------------------------------------------------------

# b, hq, hk, nq, nk, d, dtype, causal, window: lengths off the 16-row tile, Nq < Nk and Nq > Nk under causal (the
# first rows of the latter see no key), GQA, head dims 24 and 40 (padded to 32 and 64), a window on both sides
CASES = [
    (1, 2, 2, 37, 53, 24, torch.bfloat16, True, None),
    (1, 4, 2, 53, 37, 40, torch.float16, True, None),
    (1, 4, 2, 37, 53, 40, torch.bfloat16, False, (9, 3)),
    (2, 2, 1, 37, 37, 24, torch.float16, False, None),
    (1, 2, 2, 40, 21, 32, torch.bfloat16, True, (None, None)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_odd_shapes_match_the_float64_reference(case):
    b, hq, hk, nq, nk, d, dtype, causal, window = case
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype, seed=nq * nk + d)
    o, lse = run_hopper(q, k, v, causal, window)
    assert o.shape == q.shape and o.dtype == dtype and lse.dtype == torch.float32
    ref_o, ref_lse = attention_float64(q, k, v, causal, window)
    if causal and nq > nk:
        assert torch.isneginf(ref_lse).any(), "the case has rows that see no key"
    assert_matches_float64(o, lse, ref_o, ref_lse, dtype)


def test_rows_at_a_padded_row_stride_match_the_float64_reference():
    # q, k, v are the first 24 columns of rows of 32: stacked rows the descriptors describe at row stride 32
    q, k, v = (x[..., :24] for x in make_qkv(2, 2, 2, 29, 35, 32, torch.bfloat16, seed=20))
    assert all(hopper.rows_stacked(x) for x in (q, k, v)) and not q.is_contiguous()
    o, lse = run_hopper(q, k, v, True, None)
    assert_matches_float64(o, lse, *attention_float64(q, k, v, True), torch.bfloat16)


# ---- keys past the end of a head, and heads that interleave in memory ------------------------------------------------


@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_nan_values_of_the_next_heads_keys_change_nothing_without_a_mask(hq, hk):
    # with no mask the last key tile of K/V head 0 (keys 32..47 of 40) reads head 1's first 8 rows through the
    # stacked 2-D descriptor: their scores are masked, and their NaN values must not reach head 0 through 0 * NaN
    q, k, v = make_qkv(1, hq, hk, 20, 40, 16, torch.bfloat16, seed=21)
    assert hopper.hidden_sides(20, 40, band_of(20, 40, False, None)) == (False, False)
    ref_o, ref_lse = attention_float64(q, k, v)
    v[:, 1, :8] = float("nan")  # K/V head 1's first keys: right after head 0's last key in the stacked rows
    o, lse = run_hopper(q, k, v)
    group = hq // hk
    assert not finite_rows(o[:, group : 2 * group]).any()  # the query heads of K/V head 1 see them
    reads_head_0 = slice(0, group)
    assert_matches_float64(o[:, reads_head_0], lse[:, reads_head_0], ref_o[:, reads_head_0],
                             ref_lse[:, reads_head_0], torch.bfloat16)  # fmt: skip


def test_interleaved_heads_are_refused_and_the_next_rung_runs_them_right():
    b, h, n, d = 2, 2, 20, 16
    # (B, N, H, D) tensors transposed to (B, H, N, D), inside a buffer long enough for every row the stacked
    # reading would address (so a wrong reading reads finite numbers, not past the allocation)
    g = torch.Generator().manual_seed(22)
    buffers = [torch.randn(b * h * n * h * d, generator=g).to(torch.bfloat16) for _ in range(3)]
    q, k, v = (x[: b * n * h * d].view(b, n, h, d).transpose(1, 2) for x in buffers)
    assert not hopper.rows_stacked(q)
    assert "rows of heads one after another" in hopper.unavailable(q, k, v, True, None)  # refused, with its reason
    with pytest.warns(RuntimeWarning, match="rung 'hopper' cannot run here .*'skip_split'"):
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True, rung="hopper")
    assert_matches_float64(o, lse, *attention_float64(q, k, v, True), torch.bfloat16)


def test_the_default_rung_per_head_dim_is_the_one_the_recording_measured_faster():
    # flash_attention's default (``preferred``) against the H200 ladder recording: at the head dim where the hopper
    # rung is preferred it was faster than skip-and-split over the grid (geo-mean), at the other one slower
    import json
    import math

    from conftest import ROOT

    recording = json.loads((ROOT / "data" / "results" / "h200-ladder-bf16-2026-12-01-hopper.json").read_text())
    tflops = {(r["backend"], r["head_dim"], r["causal"], r["seq_len"]): r["tflops"]
              for r in recording["rows"] if r["status"] == "ok"}  # fmt: skip
    for d in (64, 128):
        cells = [key[2:] for key in tflops if key[:2] == ("flashlab_hopper", d)]
        ratios = [tflops[("flashlab_hopper", d, *c)] / tflops[("flashlab_skip_split", d, *c)] for c in cells]
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        fake = SimpleNamespace(is_cuda=True, shape=(1, 1, 4096, d))
        assert hopper.preferred(fake, fake, fake, False, None) == (geomean > 1.0), (d, geomean)
