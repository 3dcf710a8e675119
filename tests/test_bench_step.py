"""``--mode step`` on the CPU: what it would run, one tiny training step per attention through Triton's interpreter,
its files and columns, the Amdahl prediction, an out-of-memory attention recorded as a status, and the picture the
notebook draws from a recording.

The quick run times a 2-layer model at context 64 (the code path CI can test; its times say nothing about a GPU).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashlab.bench import train_step
from flashlab.bench.cli import main as bench_main
from flashlab.bench.results import newest_gpu_results
from flashlab.calculators.roofline import end_to_end_speedup

FIXTURE = Path(__file__).parent / "fixtures" / "step-fixture.json"
TIMED = ("flashlab", "sdpa_flash", "naive", "stand_in")  # sdpa_cudnn has no CPU kernel


def amdahl(share: float, speedup: float) -> float:
    """The step speedup when a share of it gets ``speedup`` times faster, written out here."""
    return 1 / ((1 - share) + share / speedup)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("step") / "run"
    results = bench_main(["--mode", "step", "--device", "cpu", "--quick", "--no-progress", "--out", str(prefix)])
    return prefix, results


# --- what runs -----------------------------------------------------------------------------------------------------


def test_the_gpu_plan_is_the_one_asked_for():
    plan = train_step.GPU_PLAN
    assert (plan.layers, plan.d_model, plan.heads, plan.head_dim, plan.dtype) == (12, 768, 12, 64, "bf16")
    assert plan.contexts == (4096, 16384) and [plan.batch(n) for n in plan.contexts] == [4, 1]
    assert plan.vocab <= 50304 and plan.vocab % 64 == 0
    assert set(plan.backends) == {"flashlab", "sdpa_flash", "sdpa_cudnn", "naive"}


def test_dry_run_lists_the_model_and_the_contexts_without_running(capsys):
    assert bench_main(["--mode", "step", "--dry-run", "--device", "cuda"]) is None
    out = capsys.readouterr().out
    for text in ("12 layers, d_model 768, 12 heads of D = 64, vocab 50304", "3 warm-up + 10 timed steps",
                 "context 4K: B = 4, 16,384 tokens", "context 16K: B = 1, 16,384 tokens",
                 "flashlab, sdpa_flash, sdpa_cudnn, naive, and stand_in"):  # fmt: skip
        assert text in out, f"{text!r} not in the dry run:\n{out}"


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--backends", "flashlab,spiral"], "spiral"),
        (["--backends", ","], "none given"),
        (["--steps", "0"], "--steps"),
        (["--contexts", "0"], "--contexts"),
        (["--seq-lens", "4k"], "unrecognized arguments: --seq-lens"),  # another mode's flag
    ],
)
def test_bad_flags_are_refused_with_the_problem_named(argv, problem, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "step", "--device", "cpu", *argv])
    assert e.value.code == 2 and problem in capsys.readouterr().err


def test_an_existing_out_is_refused(tmp_path, capsys):
    (tmp_path / "run.csv").write_text("")
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "step", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err


# --- the quick CPU run ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_cpu_run_writes_json_csv_and_txt_with_the_columns(quick_run, capsys):
    prefix, results = quick_run
    data = json.loads(prefix.with_suffix(".json").read_text())
    assert data["meta"]["mode"] == "step" and data["meta"]["config"]["mode"] == "step"
    assert data["meta"]["command"].startswith("python -m flashlab.bench --mode step")
    rows = {r["backend"]: r for r in data["rows"]}
    assert list(rows) == [*train_step.ATTENTIONS, train_step.STAND_IN]
    for name in TIMED:
        r = rows[name]
        assert r["status"] == "ok", r
        assert len(r["step_times_ms"]) == 2 and r["step_ms"] == pytest.approx(sum(r["step_times_ms"]) / 2)  # median
        assert r["tokens_per_s"] == pytest.approx(64 / (r["step_ms"] * 1e-3))
        assert (r["layers"], r["d_model"], r["heads"], r["head_dim"], r["context"], r["batch"]) == (2, 64, 2, 32, 64, 1)
    assert rows["sdpa_cudnn"]["status"] == "skipped" and "CPU" in rows["sdpa_cudnn"]["reason"]
    with prefix.with_suffix(".csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == train_step.ROW_COLUMNS and len(list(reader)) == len(rows)
    txt = prefix.with_suffix(".txt").read_text()
    assert "context 64, B = 1" in txt and "flashlab over naive" in txt
    assert results["rows"][0]["backend"] == "flashlab"


@pytest.mark.slow
def test_every_attention_starts_from_the_float64_loss(quick_run):
    rows = {r["backend"]: r for r in quick_run[1]["rows"]}
    ref = rows["flashlab"]["ref_loss"]
    assert math.log(256) - 1 < ref < math.log(256) + 1  # random tokens over 256: about ln 256 at the start
    for name in ("flashlab", "sdpa_flash", "naive"):
        r = rows[name]
        assert abs(r["first_loss"] - ref) <= 1e-5 * ref  # float32's tolerance
        assert r["loss_rel_err"] == pytest.approx(abs(r["first_loss"] - ref) / ref, abs=1e-12)
        assert r["last_loss"] == pytest.approx(rows["flashlab"]["last_loss"], rel=1e-4)  # the same steps taken
    assert rows["stand_in"]["loss_rel_err"] is None  # returning v is not attention: not held to the reference


@pytest.mark.slow
def test_the_prediction_is_amdahl_on_the_share_and_the_kernel_speedup(quick_run):
    rows = {r["backend"]: r for r in quick_run[1]["rows"]}
    rest, base = rows["stand_in"]["step_ms"], rows["flashlab"]
    for name in ("sdpa_flash", "naive"):
        r = rows[name]
        share = min(1.0, max(0.0, 1 - rest / r["step_ms"]))
        kernel = r["attn_ms"] / base["attn_ms"]
        assert r["attention_share"] == pytest.approx(share, rel=1e-12)
        assert r["kernel_speedup"] == pytest.approx(kernel, rel=1e-12)
        assert r["predicted_speedup"] == pytest.approx(amdahl(share, kernel), rel=1e-9)
        assert r["predicted_speedup"] == pytest.approx(end_to_end_speedup(share, kernel), rel=1e-12)
        assert r["measured_speedup"] == pytest.approx(r["step_ms"] / base["step_ms"], rel=1e-12)
        assert r["isolated_share"] == pytest.approx(2 * r["attn_ms"] / r["step_ms"], rel=1e-12)
    assert base["predicted_speedup"] is None and base["measured_speedup"] is None  # flashlab is the baseline


def test_compare_fills_the_prediction_from_the_rows_alone():
    plan, meta = train_step.GPU_PLAN, json.loads(FIXTURE.read_text())["meta"]

    def row(name, step_ms, attn_ms=None, status="ok"):
        r = train_step.empty_row(plan, 4096, name, 1, meta)
        r.update(status=status, step_ms=step_ms, attn_ms=attn_ms)
        return r

    rows = [row("flashlab", 200.0, 5.0), row("sdpa_flash", 300.0, 10.0), row("naive", None, status="oom"),
            row("stand_in", 120.0)]  # fmt: skip
    train_step.compare(rows)
    fa2 = rows[1]
    assert fa2["attention_share"] == pytest.approx(0.6) and fa2["kernel_speedup"] == pytest.approx(2.0)
    assert fa2["predicted_speedup"] == pytest.approx(1 / (0.4 + 0.3)) and fa2["measured_speedup"] == 1.5
    assert rows[0]["attention_share"] == pytest.approx(0.4) and rows[0]["predicted_speedup"] is None
    assert rows[2]["predicted_speedup"] is None and rows[2]["attention_share"] is None
    noisy = [row("flashlab", 100.0, 1.0), row("sdpa_flash", 90.0, 1.0), row("stand_in", 95.0)]
    train_step.compare(noisy)  # the rest of the step measured slower than a whole one: a share of 0, not below
    assert noisy[1]["attention_share"] == 0.0 and noisy[1]["predicted_speedup"] == 1.0


def _tiny_plan(**kw):
    return replace(train_step.CPU_PLAN, steps=1, **kw)


def test_an_attention_out_of_memory_is_a_status_and_the_run_goes_on(tmp_path, monkeypatch):
    def out_of_memory(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")

    naive = train_step.BACKENDS["naive"]
    monkeypatch.setitem(train_step.BACKENDS, "naive", replace(naive, run=out_of_memory))
    argv = ["--mode", "step", "--device", "cpu", "--quick", "--backends", "sdpa_flash,naive", "--steps", "1",
            "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    results = bench_main(argv)
    rows = {r["backend"]: r for r in results["rows"]}
    assert rows["naive"]["status"] == "oom" and "out of memory" in rows["naive"]["reason"]
    assert rows["naive"]["step_ms"] is None and rows["naive"]["attn_ms"] is None
    assert rows["sdpa_flash"]["status"] == rows["stand_in"]["status"] == "ok"
    assert rows["sdpa_flash"]["measured_speedup"] is None  # flashlab did not run: nothing to compare with
    assert "oom: out of memory" in (tmp_path / "run.txt").read_text()


def test_an_attention_that_misses_the_float64_loss_is_wrong_and_not_timed(tmp_path, monkeypatch):
    naive = train_step.BACKENDS["naive"]
    monkeypatch.setitem(train_step.BACKENDS, "naive", replace(naive, run=lambda q, k, v, causal: 1.5 * naive.run(
        q, k, v, causal)))  # fmt: skip
    results = bench_main(["--mode", "step", "--device", "cpu", "--quick", "--backends", "naive", "--steps", "1",
                          "--no-progress", "--out", str(tmp_path / "run")])  # fmt: skip
    row = results["rows"][0]
    assert row["status"] == "wrong" and "float64 attention" in row["reason"]
    assert row["loss_rel_err"] > row["loss_tol"] and row["step_ms"] is None and row["attn_ms"] is None


# --- the recording the notebook reads -------------------------------------------------------------------------------


def test_the_fixture_holds_the_schema_and_its_predictions_are_amdahl():
    data = json.loads(FIXTURE.read_text())
    for r in data["rows"]:
        assert set(train_step.ROW_COLUMNS) <= set(r), set(train_step.ROW_COLUMNS) - set(r)
        if r["predicted_speedup"] is not None:
            assert r["predicted_speedup"] == pytest.approx(amdahl(r["attention_share"], r["kernel_speedup"]))


def test_plot_step_draws_tokens_per_second_and_predicted_against_measured(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    shutil.copy(FIXTURE, tmp_path / "h200-step-2026-12-04.json")
    found = newest_gpu_results(tmp_path, mode="step")
    assert found == tmp_path / "h200-step-2026-12-04.json"
    data = json.loads(found.read_text())
    fig = train_step.plot_step(data)
    bars, points = fig.axes
    heights = [p.get_height() for p in bars.patches]
    rows = data["rows"]
    assert len(heights) == len(rows)  # one bar per (attention, context), zero-high where it did not run
    assert sorted(heights) == sorted(r["tokens_per_s"] or 0 for r in rows)
    assert any(t.get_text() == "oom" for t in bars.texts)  # naive at 16K ran out of memory
    predicted = [r for r in rows if r["predicted_speedup"] is not None]
    dots = [line for line in points.lines if line.get_linestyle() == "None"]
    assert len(dots) == len(predicted) == 5
    assert {(float(d.get_xdata()[0]), float(d.get_ydata()[0])) for d in dots} == {
        (r["predicted_speedup"], r["measured_speedup"]) for r in predicted}  # fmt: skip
    summary = train_step.summary(data)
    assert "flashlab over sdpa_cudnn" in summary and "oom: out of memory" in summary
