"""The kernel ladder: every rung of the forward kernel computes the same attention, on the same cases, and the
ladder picks, refuses and falls back as ``flash_attention(..., rung=)`` says.

- every rung against the float64 reference (``flashlab.reference.torch_float64``) on the same random cases: odd
  lengths, head dims that are not powers of two, grouped-query heads, causal and window masks, every dtype, lse;
- what the rungs differ by, made visible: the lesson loop multiplies every key tile, skip-and-split only the tiles
  ``flashlab.core.masking.tile_map`` computes (the matrix products Triton's interpreter executes, counted);
- the selection: an unknown name, a rung that cannot run (a warning and a right answer, never a silent
  substitute), ``rung=None``; gradients through a named rung;
- the benchmark's ``flashlab_<rung>`` backends and the ladder's tools for notebook 05 (``bench.ladder_results``).

Sized for the interpreter (a few programs per call); the ``gpu`` tests run every rung compiled at real sizes.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from conftest import ROOT
from flashlab import flash_attention
from flashlab.bench import BACKENDS, DEFAULT_BACKENDS, BenchResults, run_sweep
from flashlab.bench import ladder_results as bench_ladder
from flashlab.bench.implementations import RUNG_PREFIX, rung_backend
from flashlab.core.masking import tile_map
from flashlab.core.numerics import relative_error, tolerance
from flashlab.host.plan import CALLS
from flashlab.kernels import ladder
from flashlab.kernels.device import CPU_CONFIG
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads

RUNG_NAMES = ladder.names()
LSE_TOL = 1e-4  # lse in fp32 from exact products of the rounded inputs; relative where |lse| > 1


def make_qkv(b, hq, hk, nq, nk, d, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, device=device).to(dtype) for h, n in ((hq, nq), (hk, nk), (hk, nk))]


def skip_where_unavailable(rung, q, k, v, causal=False, window=None):
    """A rung that cannot run here (a GPU-only rung on the CPU) is skipped with its reason: run anyway, it would
    warn and give another rung's answer."""
    why = ladder.rung_named(rung).unavailable(q, k, v, causal, window)
    if why is not None:
        pytest.skip(f"rung {rung!r} cannot run here: {why}")


def check_rung(rung, q, k, v, causal=False, window=None, lse_tol=LSE_TOL, skip_unavailable=True):
    """One rung's output and lse against the float64 reference: relative error within the dtype's tolerance, rows
    that see no key exactly zero with lse = -inf. ``skip_unavailable=False`` checks whatever the call falls back to."""
    if skip_unavailable:
        skip_where_unavailable(rung, q, k, v, causal, window)
    o, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True, rung=rung)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    return assert_matches_float64(o, lse, *attention_float64(q, k, v, causal, window), q.dtype, rung, lse_tol)


def assert_matches_float64(o, lse, ref_o, ref_lse, dtype, label="", lse_tol=LSE_TOL):
    """o finite and within the dtype's relative error of the float64 reference ``(ref_o, ref_lse)``, lse within
    ``lse_tol`` (relative where |lse| > 1), rows that see no key exactly zero with lse = -inf; returns the error."""
    assert torch.isfinite(o).all()
    err = relative_error(o, ref_o)
    assert err <= tolerance(dtype), f"{label}: relative error {err:.2e} over {tolerance(dtype):.0e} ({dtype})"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{label}: lse must be -inf exactly where a row sees no key"
    assert (o[empty] == 0).all()
    if (~empty).any():
        gap = (lse.double()[~empty] - ref_lse[~empty]).abs() / ref_lse[~empty].abs().clamp_min(1.0)
        assert gap.max().item() < lse_tol, f"{label}: lse off by {gap.max().item():.1e}"
    return err


# b, hq, hk, nq, nk, d, dtype, causal, window: odd lengths, Nq != Nk both ways, D = 24 / 40 / 80 (padded), GQA,
# rows that see no key (causal with Nq > Nk), windows on one side and both, every dtype
CASES = [
    (1, 2, 1, 37, 45, 24, torch.float32, True, None),
    (1, 3, 1, 19, 50, 40, torch.float16, False, None),
    (2, 2, 2, 33, 17, 16, torch.bfloat16, True, None),
    (1, 4, 2, 29, 41, 40, torch.float32, False, (6, 3)),
    (1, 2, 1, 40, 40, 24, torch.bfloat16, True, (9, None)),
    (1, 2, 2, 21, 35, 80, torch.float16, False, (None, 0)),
    (1, 1, 1, 1, 23, 16, torch.float32, True, None),
]


@pytest.mark.parametrize("rung", RUNG_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_every_rung_matches_the_float64_reference(rung, case):
    b, hq, hk, nq, nk, d, dtype, causal, window = case
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype, seed=nq * nk)
    check_rung(rung, q, k, v, causal, window)


@pytest.mark.parametrize("rung", RUNG_NAMES)
def test_hidden_nan_keys_and_values_change_no_bit(rung):
    # Keys and values the window hides from every query hold NaN. skip_split never loads their tiles; the lesson
    # loop loads them, and its mask turns their scores into -inf and its guarded P V ignores their values. Either
    # way the output is the clean run's, bit for bit.
    q, k, v = make_qkv(1, 2, 1, 8, 90, 16, torch.float32, seed=8)
    skip_where_unavailable(rung, q, k, v, True, (10, None))
    clean = flash_attention(q, k, v, causal=True, window=(10, None), rung=rung)
    k[:, :, :64], v[:, :, :64] = float("nan"), float("nan")  # keys 0..63: before every row's window (72..89)
    assert torch.equal(flash_attention(q, k, v, causal=True, window=(10, None), rung=rung), clean)


# ---- what the rungs differ by: the tiles they multiply -------------------------------------------------------------


@pytest.fixture
def count_dots(monkeypatch):
    """Count the matrix products Triton's interpreter executes (each computed tile takes two: S = Q K^T, P V)."""
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpreterBuilder, "create_dot"):
        pytest.skip("this Triton's interpreter has no create_dot to count")
    real, calls = interpreter.InterpreterBuilder.create_dot, []

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", counting)

    def run(fn):
        calls.clear()
        fn()
        return len(calls)

    return run


@pytest.mark.parametrize("causal, window", [(True, None), (True, (12, None)), (False, (5, 3)), (False, None)])
def test_the_lesson_loop_visits_every_tile_and_skip_split_only_the_visible_ones(count_dots, causal, window):
    b, hq, nq, nk = 1, 2, 40, 70
    q, k, v = make_qkv(b, hq, 1, nq, nk, 16, torch.float32, seed=3)
    plan = tile_map(nq, nk, CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"], causal=causal, window=window)
    rungs = ("lesson_loop", "skip_split")
    visited = {rung: count_dots(lambda r=rung: flash_attention(q, k, v, causal, window, rung=r)) for rung in rungs}
    assert visited["lesson_loop"] == 2 * b * hq * plan.state.size  # every (query tile, key tile)
    assert visited["skip_split"] == 2 * b * hq * plan.n_computed  # only the tiles the mask leaves visible
    if plan.n_skipped:
        assert visited["skip_split"] < visited["lesson_loop"]


def test_rung_none_on_cpu_runs_skip_split(count_dots):
    q, k, v = make_qkv(1, 2, 1, 40, 70, 16, torch.float32, seed=4)  # Nq = 40: past split-KV's few query rows
    assert ladder.select(None, q, k, v, True, None)[0].name == "skip_split"
    default = count_dots(lambda: flash_attention(q, k, v, causal=True))
    assert default == count_dots(lambda: flash_attention(q, k, v, causal=True, rung="skip_split"))
    assert default < count_dots(lambda: flash_attention(q, k, v, causal=True, rung="lesson_loop"))


# ---- choosing a rung -----------------------------------------------------------------------------------------------


def test_the_registry_is_ordered_and_described():
    assert RUNG_NAMES[:2] == ("lesson_loop", "skip_split")  # slowest first; further rungs go after
    for r in ladder.RUNGS:
        assert r.removes and "\n" not in r.removes
        assert callable(r.load().launch)


def test_an_unknown_rung_is_a_value_error_naming_the_rungs():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="unknown rung 'fastest'.*lesson_loop, skip_split"):
        flash_attention(q, k, v, rung="fastest")
    with pytest.raises(TypeError, match="rung must be"):
        flash_attention(q, k, v, rung=2)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attention(q, k, v, rung="skip_split", num_splits=2)


def unavailable_rung(name, why="needs hardware this machine lacks"):
    """A stand-in rung that never runs here (the ladder's next rung on a machine without its GPU)."""
    return dataclasses.replace(ladder.RUNGS[-1], name=name, removes="a test's stand-in", unavailable=lambda *a: why)


def test_a_rung_that_cannot_run_says_so_and_the_fastest_that_can_runs(monkeypatch):
    monkeypatch.setattr(ladder, "RUNGS", (*ladder.RUNGS, unavailable_rung("stand_in")))
    q, k, v = make_qkv(1, 2, 1, 30, 30, 24, torch.float32, seed=6)
    with pytest.warns(RuntimeWarning, match="rung 'stand_in' cannot run here .needs hardware.*'skip_split'"):
        err = check_rung("stand_in", q, k, v, causal=True, skip_unavailable=False)
    assert err < tolerance(torch.float32)
    with pytest.warns(RuntimeWarning, match="stand_in"):  # every call says so, not only the first
        flash_attention(q, k, v, causal=True, rung="stand_in")
    assert ladder.select(None, q, k, v, True, None)[0].name == "skip_split"  # None: silently the fastest that runs


def test_with_no_rung_that_can_run_the_error_lists_every_reason(monkeypatch):
    monkeypatch.setattr(ladder, "RUNGS", (unavailable_rung("a", "no A"), unavailable_rung("b", "no B")))
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, seed=7)
    with pytest.raises(RuntimeError, match="b: no B; a: no A"):
        ladder.select("a", q, k, v, False, None)


@pytest.mark.parametrize("nq", [3, 30], ids=["few-rows", "prefill"])  # 3 rows: the backward's small-tile config
def test_gradients_flow_through_a_named_rung(nq, count_dots):
    q, k, v = make_qkv(1, 2, 1, nq, 37, 24, torch.float32, seed=nq)
    do = torch.randn_like(q)
    window = (8, None)  # with causal: the first key tile is hidden from every row, so the two rungs' work differs
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    run = lambda rung: flash_attention(qg, kg, vg, causal=True, window=window, rung=rung).backward(do)  # noqa: E731
    lesson_dots = count_dots(lambda: run("lesson_loop"))
    refs = attention_float64_grads(q, k, v, do, causal=True, window=window)
    for got, ref in zip((qg.grad, kg.grad, vg.grad), refs, strict=True):
        assert relative_error(got, ref) < 5e-5
    qg.grad = kg.grad = vg.grad = None
    skip_dots = count_dots(lambda: run("skip_split"))
    assert lesson_dots > skip_dots  # the backward is the same: the forward that ran was the lesson loop's


def test_forward_plans_remember_the_rung():
    # one signature asked for each rung: a call per rung, keyed by its name
    q, k, v = make_qkv(1, 1, 1, 17, 17, 16, torch.float32, seed=9)
    rungs = ("lesson_loop", "skip_split")
    for rung in rungs:
        flash_attention(q, k, v, rung=rung)
    keyed = [key for key in CALLS if key[0] == q.shape and key[2] == k.shape]
    assert {key[-1] for key in keyed} >= set(rungs)


def test_a_compiled_model_keeps_its_rung(count_dots):
    # torch.compile(fullgraph=True) over a call that names a rung: one opaque operator, run with that rung
    def block(q, k, v):
        return flash_attention(q * 1.0, k, v, causal=True, window=(8, None), rung="lesson_loop") + q

    q, k, v = make_qkv(1, 2, 1, 20, 30, 16, torch.float32, seed=10)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert count_dots(lambda: compiled(q, k, v)) == count_dots(lambda: block(q, k, v))  # the lesson loop's work
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), rtol=0, atol=0)


# ---- the benchmark's rungs -----------------------------------------------------------------------------------------


def test_every_rung_is_a_backend_that_runs_when_named():
    rungs = [b for b in BACKENDS if b.startswith(RUNG_PREFIX)]
    assert rungs == [RUNG_PREFIX + n for n in RUNG_NAMES]  # one per entry of the registry, in its order
    assert not set(rungs) & set(DEFAULT_BACKENDS)
    assert "flashlab" in DEFAULT_BACKENDS


def test_a_rung_that_cannot_run_a_cell_is_skipped_not_replaced():
    cfg = bench_ladder.LIVE_CPU
    cfg = dataclasses.replace(cfg, seq_lens=(20,), causal="no", backends=())
    results = run_sweep(cfg, extra_backends=[rung_backend(unavailable_rung("stand_in"))], progress=False)
    (row,) = results.rows
    assert row["backend"] == "flashlab_stand_in" and row["status"] == "skipped"
    assert "rung 'stand_in' cannot run here: needs hardware" in row["reason"]


def test_the_command_line_times_the_rungs_side_by_side(tmp_path, capsys):
    # python -m flashlab.bench's own entry point, in this process (tests/test_bench.py runs the module itself)
    from flashlab.bench import main

    backends = "flashlab_lesson_loop,flashlab_skip_split,sdpa_flash"
    args = ["--device", "cpu", "--quick", "--seq-lens", "40", "--head-dims", "16", "--causal", "yes", "--tokens", "40"]
    args += ["--model-dim", "32", "--backends", backends, "--rep", "1", "--warmup", "0", "--no-progress"]
    main([*args, "--out", str(tmp_path / "ladder")])
    rows = json.loads((tmp_path / "ladder.json").read_text())["rows"]
    assert [(r["backend"], r["status"]) for r in rows] == [(b, "ok") for b in backends.split(",")]
    assert "flashlab_skip_split / flashlab_lesson_loop, fp32 D = 16, causal:" in capsys.readouterr().out


# ---- the ladder's tools for notebook 05 ----------------------------------------------------------------------------


def ladder_results(times: dict, meta=None) -> BenchResults:
    """Hand-made results: ``times[backend][(causal, seq_len)]`` in ms, one bf16 D = 128 cell per (causal, N)."""
    rows = []
    for backend, cells in times.items():
        for (causal, n), ms in cells.items():
            flops = 4.0 * n * n * 128 / (2 if causal else 1)
            rows.append(dict(backend=backend, dtype="bf16", head_dim=128, seq_len=n, causal=causal, batch=1, heads=1,
                             status="ok", time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12))  # fmt: skip
    return BenchResults(meta=meta or {}, rows=rows)


TIMES = {
    "sdpa_flash": {(False, 1024): 1.0, (False, 2048): 4.0, (True, 1024): 0.6, (True, 2048): 2.2},
    "flashlab_skip_split": {(False, 1024): 0.9, (False, 2048): 3.2, (True, 1024): 0.5, (True, 2048): 1.8},
    "flashlab_lesson_loop": {(False, 1024): 1.0, (False, 2048): 4.0, (True, 1024): 1.0, (True, 2048): 4.0},
}


def test_steps_compare_neighbouring_rungs_per_panel():
    results = ladder_results(TIMES)
    assert bench_ladder.rung_backends(results) == ["flashlab_lesson_loop", "flashlab_skip_split"]
    (full, causal) = bench_ladder.steps(results)
    assert (full.lower, full.upper, full.causal, causal.causal) == ("flashlab_lesson_loop", "flashlab_skip_split",
                                                                    False, True)  # fmt: skip
    assert full.ratios == pytest.approx({1024: 1.0 / 0.9, 2048: 4.0 / 3.2})
    assert causal.geomean == pytest.approx(np.sqrt(2.0 * 4.0 / 1.8))
    (vs_fa2_full, _) = bench_ladder.against(results, "sdpa_flash")
    assert vs_fa2_full.upper == "flashlab_skip_split" and vs_fa2_full.lowest == pytest.approx(1.0 / 0.9)
    assert bench_ladder.against(results, "sdpa_cudnn") == []  # not in the file: nothing to compare


def test_a_rung_missing_from_the_file_is_not_drawn_and_an_unknown_one_is():
    import matplotlib

    matplotlib.use("Agg")
    times = {"flashlab_skip_split": TIMES["flashlab_skip_split"], "flashlab_next": {(False, 1024): 0.5},
             "sdpa_flash": TIMES["sdpa_flash"]}  # fmt: skip
    results = ladder_results(times, meta={"backends": {"flashlab_next": "a rung this copy does not know"}})
    assert bench_ladder.rung_backends(results) == ["flashlab_skip_split", "flashlab_next"]
    assert bench_ladder.removes(results, "flashlab_next") == "a rung this copy does not know"
    assert bench_ladder.removes(results, "flashlab_skip_split") == ladder.rung_named("skip_split").removes
    fig = bench_ladder.plot_ladder(results, title="test")
    labels = [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]
    assert labels == [["skip_split", "next", "PyTorch SDPA FlashAttention-2"],
                      ["skip_split", "PyTorch SDPA FlashAttention-2"]]  # fmt: skip
    assert [s.upper for s in bench_ladder.steps(results)] == ["flashlab_next"]


def test_the_notebook_reads_a_recording_or_says_there_is_none(tmp_path):
    meta = {"is_cuda_gpu": True, "device_name": "a GPU"}
    json_path, _ = ladder_results(TIMES, meta=meta).save(tmp_path / "ladder")
    results, source = bench_ladder.notebook_ladder(json_path, live="auto", cuda=False)
    assert source == "recorded GPU" and len(results.rows) == len(ladder_results(TIMES).rows)
    results, source = bench_ladder.notebook_ladder(tmp_path / "missing.json", live=False, cuda=False)
    assert results is None and "no recording" in source


def test_notebook_05_shows_the_steps_of_a_recording(tmp_path, monkeypatch, capsys):
    # the notebook's ladder cells on a hand-made recording in a temporary folder (a stand-in for the H200 file)
    import matplotlib
    import nbformat

    matplotlib.use("Agg")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the recording, never a live GPU sweep
    meta = dict(is_cuda_gpu=True, device_name="a GPU", torch="t", triton="tr", date="2026-12-01T00:00:00Z",
                command="python -m flashlab.bench --backends ...")  # fmt: skip
    nb = nbformat.read(ROOT / "notebooks" / "05_timing_on_gpu.ipynb", as_version=4)
    cells = {c.id: c.source for c in nb.cells}
    recording = re.search(r'"(h200-ladder-[\w-]+)\.json"', cells["nb05-ladder-load"]).group(1)  # the file it reads
    ladder_results(TIMES, meta=meta).save(tmp_path / recording)
    namespace: dict = {}
    exec(compile(cells["999323e5"], "05:imports", "exec"), namespace)
    namespace["RESULTS_DIR"] = tmp_path
    for cell_id in ("nb05-ladder-load", "nb05-ladder-gain"):
        exec(compile(cells[cell_id], f"05:{cell_id}", "exec"), namespace)
    out = capsys.readouterr().out
    assert namespace["LADDER_SOURCE"] == "recorded GPU"
    assert "flashlab_skip_split over flashlab_lesson_loop -- removes masked-tile work" in out
    causal = next(s for s in bench_ladder.steps(namespace["rung_results"]) if s.causal)
    assert f"causal : {causal.geomean:.2f}x geo-mean over 2 lengths" in out  # computed from the file, not typed
    assert "against PyTorch SDPA FlashAttention-2" in out and "SDPA cuDNN" not in out


# ---- compiled, on a GPU --------------------------------------------------------------------------------------------

GPU_CASES = [
    # b, hq, hk, nq, nk, d, causal, window
    (2, 16, 16, 1024, 1024, 128, False, None),
    (2, 16, 16, 1024, 1024, 128, True, None),
    (3, 8, 2, 1000, 1537, 80, True, None),
    (2, 12, 4, 777, 333, 96, False, None),
    (1, 4, 4, 513, 513, 256, False, None),
    (2, 6, 3, 999, 999, 24, False, (100, 17)),
    (1, 8, 8, 2049, 2049, 64, True, (256, None)),
    (1, 2, 1, 300, 100, 40, True, None),
    (4, 32, 4, 1, 4096, 128, True, None),  # decode-sized: a named rung runs it as prefill, not split-KV
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(str(x) for x in c))
@pytest.mark.parametrize("rung", RUNG_NAMES)
def test_every_rung_matches_the_reference_on_gpu(rung, case, dtype):
    b, hq, hk, nq, nk, d, causal, window = case
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype, seed=nq + nk, device="cuda")
    check_rung(rung, q, k, v, causal, window, lse_tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNG_NAMES)
def test_gradients_through_every_rung_on_gpu(rung):
    q, k, v = make_qkv(2, 8, 2, 700, 900, 128, torch.bfloat16, seed=1, device="cuda")
    do = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    flash_attention(qg, kg, vg, causal=True, rung=rung).backward(do)
    refs = attention_float64_grads(q, k, v, do, causal=True)
    for got, ref in zip((qg.grad, kg.grad, vg.grad), refs, strict=True):
        assert relative_error(got, ref) < 3e-2


@pytest.mark.gpu
def test_the_ladder_sweep_on_gpu():
    backends = tuple(RUNG_PREFIX + n for n in RUNG_NAMES) + ("sdpa_flash",)
    cfg = dataclasses.replace(bench_ladder.LIVE_GPU, seq_lens=(1024,), backends=backends)
    results = run_sweep(cfg, progress=False)
    assert {r["status"] for r in results.rows} == {"ok"}, [r["reason"] for r in results.rows]
    assert bench_ladder.steps(results)
