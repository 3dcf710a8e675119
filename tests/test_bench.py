"""The benchmark harness on the CPU at tiny sizes: its grid, its reference check, its files, its failure modes."""

from __future__ import annotations

import csv
import datetime
import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import triton

from conftest import ROOT
from flashlab import bench, reference
from flashlab.bench import Backend, BenchConfig, BenchResults, naive_attention, run_sweep
from flashlab.bench.measure import TOLERANCE
from flashlab.bench.results import ratio_text
from flashlab.host.fp8 import FP8_FORWARD_TOLERANCE
from flashlab.reference.torch_float64 import attention_float64

# a tiny, awkward sweep: N = 37 (odd), D = 24 (not a power of two), B = 2, H = 2
TINY = dict(device="cpu", seq_lens=(37,), head_dims=(24,), dtypes=("fp32",), tokens=74, model_dim=48)
FAST = dict(warmup=0.0, rep=1.0)


def tiny_config(**overrides) -> BenchConfig:
    return BenchConfig(**{**TINY, **FAST, "backends": ("naive", "sdpa_math"), **overrides})


def by_backend(results: BenchResults) -> dict:
    return {(r["backend"], r["causal"]): r for r in results.rows}


# --- the grid and the FLOP count -----------------------------------------------------------------------------------


def test_default_grid_is_the_issues():
    # the GPU defaults, asked for explicitly (the CPU's defaults are tiny)
    cfg = BenchConfig(
        device="cpu",
        seq_lens=(1024, 2048, 4096, 8192, 16384),
        head_dims=(64, 128),
        dtypes=("bf16",),
        tokens=16384,
        model_dim=2048,
    ).resolve()
    cells = cfg.cells()
    assert len(cells) == 5 * 2 * 2
    assert {c.batch * c.seq_len for c in cells} == {16384}
    assert {(c.head_dim, c.heads) for c in cells} == {(64, 32), (128, 16)}
    assert [c.causal for c in cells[:6]] == [False] * 5 + [True]


def test_cpu_defaults_are_tiny():
    cfg = BenchConfig(device="cpu").resolve()
    assert max(cfg.seq_lens) <= 128 and cfg.dtypes == ("fp32",)
    assert cfg.backends == bench.DEFAULT_BACKENDS and "flashlab_lesson_loop" not in cfg.backends


def test_flops_follow_the_lesson():
    # the lesson: 4 x 8,192^2 x 128 = 34.4 GFLOP per head; causal does half
    assert round(bench.attention_flops(1, 1, 8192, 128, causal=False) / 1e9, 1) == 34.4
    assert round(bench.attention_flops(1, 1, 8192, 128, causal=True) / 1e9, 1) == 17.2
    cell = bench.Cell("bf16", 128, 8192, False, batch=2, heads=16)
    assert cell.flops == 2 * 16 * 4 * 8192**2 * 128
    assert cell.io_bytes == 4 * 2 * 16 * 8192 * 128 * 2  # Q, K, V, O at 2 bytes


# --- the reference check -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(37, 37), (5, 37)])
def test_naive_attention_equals_numpy_reference(causal, nq, nk):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, nq, 24, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, nk, 24, generator=g, dtype=torch.float64) for _ in range(2))
    want, _ = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=causal)
    got = naive_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(37, 37), (5, 37), (41, 29)])
def test_reference_rows_equal_numpy_reference(causal, nq, nk):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, nq, 24, generator=g)
    k, v = (torch.randn(2, 3, nk, 24, generator=g) for _ in range(2))
    want, _ = reference.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=causal)
    rows = torch.tensor([0, 1, nq // 2, nq - 1])
    got = attention_float64(q, k, v, causal, rows=rows, max_bytes=1)[0]  # one head at a time
    assert got.dtype == torch.float64 and got.shape == (2, 3, 4, 24)
    np.testing.assert_allclose(got.numpy(), want[:, :, rows.numpy()], rtol=1e-10, atol=1e-12)
    if causal and nq > nk:
        assert not got[:, :, 0].any()  # row 0 sees no key: zeros, as in flashlab.reference


def test_check_rows_include_both_ends():
    rows = bench.check_rows(1000, 7).tolist()
    assert rows[0] == 0 and rows[-1] == 999 and len(rows) == 7
    assert bench.check_rows(5, 256).tolist() == [0, 1, 2, 3, 4]


# --- a sweep in process, its files and stamps ----------------------------------------------------------------------


def test_sweep_rows_files_and_stamps(tmp_path):
    cfg = tiny_config(backends=("naive", "flashlab", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"))
    results = run_sweep(cfg, progress=False)
    assert len(results.rows) == 2 * 6  # causal and not, six backends
    rows = by_backend(results)
    for name in ("naive", "flashlab", "sdpa_flash", "sdpa_math"):
        for causal in (False, True):
            r = rows[(name, causal)]
            assert r["status"] == "ok", r
            assert r["rel_err"] < 1e-5 and r["time_ms"] > 0
            assert math.isclose(r["tflops"], r["flops"] / (r["time_ms"] * 1e-3) / 1e12)
            assert math.isclose(r["bandwidth_gbps"], r["io_bytes"] / (r["time_ms"] * 1e-3) / 1e9)
            assert math.isnan(r["peak_extra_mb"])  # n/a on the CPU
    for name in ("sdpa_cudnn", "sdpa_efficient"):
        assert rows[(name, False)]["status"] == "skipped"
        assert "CPU" in rows[(name, False)]["reason"]
    assert rows[("naive", True)]["flops"] == 2 * 2 * 4 * 37**2 * 24 / 2

    json_path, csv_path = results.save(tmp_path / "run")
    assert (json_path.name, csv_path.name) == ("run.json", "run.csv")
    data = json.loads(json_path.read_text())
    meta = data["meta"]
    assert meta["tool"] == "flashlab.bench" and meta["is_cuda_gpu"] is False
    assert meta["device_name"].startswith("CPU")
    assert (meta["torch"], meta["triton"]) == (torch.__version__, triton.__version__)
    stamped = datetime.datetime.strptime(meta["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - stamped) < datetime.timedelta(minutes=10)
    assert meta["command"].startswith(
        "python -m flashlab.bench --mode prefill --device cpu --dtypes fp32 --head-dims 24"
    )
    assert data["ceilings"]["copy_tbps"] is None  # measured on GPUs only
    assert data["rows"][0]["peak_extra_mb"] is None  # NaN is written as null: strict JSON

    with csv_path.open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == bench.ROW_COLUMNS
        table = list(reader)
    assert len(table) == 12
    assert {r["device_name"] for r in table} == {meta["device_name"]}
    assert {r["torch"] for r in table} == {torch.__version__}
    assert {r["date"] for r in table} == {meta["date"]}
    assert float(table[0]["time_ms"]) == pytest.approx(results.rows[0]["time_ms"])

    loaded = BenchResults.load(json_path)
    assert loaded.meta == meta and len(loaded.rows) == 12
    assert math.isnan(loaded.rows[0]["peak_extra_mb"])


def test_wrong_answer_is_caught_before_timing():
    calls = {"off_by_5pc": 0, "nan": 0, "transposed": 0}

    def counted(name, fn):
        def run(q, k, v, causal):
            calls[name] += 1
            return fn(q, k, v, causal)

        return Backend(name, f"broken on purpose: {name}", run)

    broken = [
        counted("off_by_5pc", lambda q, k, v, causal: naive_attention(q, k, v, causal) * 1.05),
        counted("nan", lambda q, k, v, causal: naive_attention(q, k, v, causal) * float("nan")),
        counted("transposed", lambda q, k, v, causal: naive_attention(q, k, v, causal).transpose(-1, -2)),
    ]
    results = run_sweep(tiny_config(causal="yes"), extra_backends=broken, progress=False)
    rows = by_backend(results)
    assert rows[("naive", True)]["status"] == "ok"
    for name in calls:
        r = rows[(name, True)]
        assert r["status"] == "wrong", r
        assert math.isnan(r["time_ms"]) and math.isnan(r["tflops"])
        assert calls[name] == 1, f"{name} was run {calls[name]} times: it must not be timed"
    assert rows[("off_by_5pc", True)]["rel_err"] == pytest.approx(0.05, rel=1e-3)
    assert "tolerance" in rows[("off_by_5pc", True)]["reason"]
    assert "shape" in rows[("transposed", True)]["reason"]
    assert "WRONG: off_by_5pc" in bench.summary_table(results)


def test_out_of_memory_is_reported_and_the_sweep_goes_on():
    def oom(q, k, v, causal):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 17.18 GiB")

    results = run_sweep(tiny_config(causal="no"), extra_backends=[Backend("hungry", "always OOM", oom)], progress=False)
    rows = by_backend(results)
    assert rows[("hungry", False)]["status"] == "oom"
    assert "17.18 GiB" in rows[("hungry", False)]["reason"]
    assert rows[("naive", False)]["status"] == "ok" and rows[("sdpa_math", False)]["status"] == "ok"


def test_materialising_backends_pre_check_free_memory():
    # 2 x 2 x 37^2 fp32 scores, S and P: 43,808 B. Claim only 10 kB is free.
    cfg = tiny_config(causal="no", backends=("naive", "sdpa_flash", "sdpa_math"), max_memory_gb=1e-5)
    rows = by_backend(run_sweep(cfg, progress=False))
    for name in ("naive", "sdpa_math"):
        assert rows[(name, False)]["status"] == "oom"
        assert rows[(name, False)]["reason"].startswith("predicted")
    assert rows[("sdpa_flash", False)]["status"] == "ok"  # never holds the score matrix


def test_an_unavailable_backend_is_skipped_with_its_reason():
    def refuses(q, k, v, causal):
        raise RuntimeError("No available kernel. Aborting execution.")

    results = run_sweep(
        tiny_config(causal="no"), extra_backends=[Backend("picky", "no kernel", refuses)], progress=False
    )
    r = by_backend(results)[("picky", False)]
    assert r["status"] == "skipped" and "No available kernel" in r["reason"]


# --- summaries -----------------------------------------------------------------------------------------------------


def _row(backend, n, time_ms, causal=False):
    r = {c: "" for c in bench.ROW_COLUMNS}
    r.update(backend=backend, dtype="bf16", head_dim=64, seq_len=n, causal=causal, status="ok", time_ms=time_ms)
    r.update(batch=16384 // n)
    r.update(tflops=1.0 / time_ms, reason="")
    return r


def test_speedups_and_geomean():
    rows = [_row("flashlab", 1024, 1.0), _row("sdpa_flash", 1024, 2.0)]
    rows += [_row("flashlab", 2048, 4.0), _row("sdpa_flash", 2048, 2.0), _row("sdpa_cudnn", 2048, 3.0)]
    meta = dict(device_name="test", torch="t", triton="t", date="2026-01-01")
    results = BenchResults(meta=meta, rows=rows)
    assert bench.speedups(results) == {("bf16", 64, False, 1024, 16): 2.0, ("bf16", 64, False, 2048, 8): 0.5}
    assert bench.geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert bench.speedups(results, denominator="sdpa_cudnn") == {("bf16", 64, False, 2048, 8): 0.75}
    table = bench.summary_table(results)
    assert "geo-mean 1.00x over 2 cells (min 0.500x, max 2.00x)" in table
    assert "flashlab vs cuDNN (sdpa_cudnn): geo-mean 0.750x over 1 cells" in table


def test_newest_gpu_results_ignores_cpu_runs(tmp_path):
    def write(name, date, gpu):
        meta = dict(tool="flashlab.bench", date=date, is_cuda_gpu=gpu)
        (tmp_path / name).write_text(json.dumps(dict(meta=meta, rows=[])))

    write("cpu.json", "2026-12-01T00:00:00Z", False)
    assert bench.newest_gpu_results(tmp_path) is None
    write("h200-old.json", "2026-11-01T00:00:00Z", True)
    write("h200-new.json", "2026-11-29T00:00:00Z", True)
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a results file
    assert bench.newest_gpu_results(tmp_path).name == "h200-new.json"
    meta = dict(tool="flashlab.bench", date="2026-11-30T00:00:00Z", is_cuda_gpu=True, config=dict(mode="decode"))
    (tmp_path / "h200-decode.json").write_text(json.dumps(dict(meta=meta, rows=[])))
    assert bench.newest_gpu_results(tmp_path).name == "h200-new.json"  # prefill by default
    assert bench.newest_gpu_results(tmp_path, mode="decode").name == "h200-decode.json"
    # a newer 8-bit cache recording (only paged backends) is found only when asked for
    meta = dict(tool="flashlab.bench", date="2026-12-04T00:00:00Z", is_cuda_gpu=True,
                config=dict(mode="decode", kv_dtype="fp8"))  # fmt: skip
    (tmp_path / "h200-decode-fp8.json").write_text(json.dumps(dict(meta=meta, rows=[])))
    assert bench.newest_gpu_results(tmp_path, mode="decode").name == "h200-decode.json"
    assert bench.newest_gpu_results(tmp_path, mode="decode", kv_dtype="fp8").name == "h200-decode-fp8.json"


def test_default_file_names():
    meta = dict(config=dict(dtypes=["bf16"]), date="2026-11-29T16:30:00Z", is_cuda_gpu=True, device_name="NVIDIA H200")
    assert str(bench.default_prefix(meta)) == "data/results/h200-bf16-2026-11-29"
    meta.update(is_cuda_gpu=False, device_name="CPU")
    assert str(bench.default_prefix(meta)) == "test-artifacts/bench/cpu-bf16-2026-11-29"
    meta.update(is_cuda_gpu=True, device_name="NVIDIA H200", config=dict(dtypes=["bf16"], mode="decode"))
    assert str(bench.default_prefix(meta)) == "data/results/h200-decode-bf16-2026-11-29"


# --- decode: one query token against a KV cache, grouped-query heads ---------------------------------------------


def test_naive_attention_with_gqa_equals_numpy_reference():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 24, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 37, 24, generator=g, dtype=torch.float64) for _ in range(2))
    want, _ = reference.attention(q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(naive_attention(q, k, v).numpy(), want, rtol=1e-12, atol=1e-12)
    got = attention_float64(q, k, v, False, rows=torch.tensor([0]), max_bytes=1)[0]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_decode_sweep():
    cfg = BenchConfig(mode="decode", device="cpu", seq_lens=(37, 100), head_dims=(24,), batches=(1, 3))
    cfg = replace(cfg, q_heads=6, kv_heads=2, backends=("naive", "flashlab", "sdpa_flash", "sdpa_math"), **FAST)
    results = run_sweep(cfg, progress=False)
    assert len(results.rows) == 2 * 2 * 4
    assert {(r["q_len"], r["heads"], r["kv_heads"], r["causal"]) for r in results.rows} == {(1, 6, 2, False)}
    assert {(r["seq_len"], r["batch"]) for r in results.rows} == {(37, 1), (37, 3), (100, 1), (100, 3)}
    for r in results.rows:
        assert r["status"] == "ok" and r["rel_err"] < 1e-5, r
    r = results.ok_rows(backend="naive", seq_len=100, batch=3)[0]
    assert r["io_bytes"] == (2 * 3 * 6 * 1 * 24 + 2 * 3 * 2 * 100 * 24) * 4  # Q and O, then the KV cache
    assert r["flops"] == 4 * 3 * 6 * 1 * 100 * 24
    assert "--mode decode" in results.meta["command"] and "--kv-heads 2" in results.meta["command"]
    assert "decode, Q/K/V/O bandwidth in TB/s" in bench.summary_table(results)
    assert str(bench.default_prefix(results.meta)).startswith("test-artifacts/bench/cpu-decode-fp32-")


def test_the_fp8_forward_backend_is_checked_against_what_its_inputs_stand_for():
    """``--backends fp8_forward``: the cell's 16-bit tensors quantised to e4m3, the FP8 forward checked against
    float64 of the dequantised inputs within its own tolerance (not bf16's), beside the bf16 forward; a head dim it
    does not take is recorded as skipped with the reason, and the sweep goes on."""
    cfg = BenchConfig(mode="prefill", device="cpu", seq_lens=(40,), head_dims=(64, 32), tokens=40, model_dim=128,
                      dtypes=("bf16",), causal="both", backends=("flashlab", "fp8_forward"), **FAST)  # fmt: skip
    results = run_sweep(cfg, progress=False)
    fp8 = [r for r in results.rows if r["backend"] == "fp8_forward"]
    assert {(r["head_dim"], r["status"]) for r in fp8} == {(64, "ok"), (32, "skipped")}, fp8
    for r in fp8:
        if r["status"] == "ok":
            assert r["tol"] == FP8_FORWARD_TOLERANCE and r["rel_err"] < TOLERANCE["bf16"], r
        else:
            assert "head dim 32" in r["reason"]
    assert all(r["status"] == "ok" for r in results.rows if r["backend"] == "flashlab")


def test_decode_pre_check_counts_repeated_kv():
    cell = bench.Cell("bf16", 128, 131072, False, batch=8, heads=64, q_len=1, kv_heads=8)
    naive = bench.BACKENDS["naive"]
    # S and P: 8 x 64 x 131,072 entries x 2 B x 2; K and V repeated to 64 heads: 2 x 8 x 64 x 131,072 x 128 x 2 B
    assert naive.workspace_bytes(cell) == 8 * 64 * 131072 * 4 + 2 * 8 * 64 * 131072 * 128 * 2
    cfg = BenchConfig(mode="decode", device="cpu", backends=("naive", "sdpa_flash"), max_memory_gb=1e-5, **FAST)
    rows = run_sweep(cfg, progress=False).rows
    assert {r["status"] for r in rows if r["backend"] == "naive"} == {"oom"}
    assert "repeated per query head" in rows[0]["reason"]
    assert {r["status"] for r in rows if r["backend"] == "sdpa_flash"} == {"ok"}


# --- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(dtypes=("int8",)), "unknown dtype"),
        (dict(causal="maybe"), "causal"),
        (dict(seq_lens=(0,)), "seq_lens"),
        (dict(head_dims=()), "head_dims"),
        (dict(tokens=0), "tokens"),
        (dict(rep=0.0), "rep"),
        (dict(rounds=0), "rounds"),
        (dict(rounds=2.5), "rounds"),
        (dict(device="tpu"), "device"),
        (dict(check_rows=0), "check_rows"),
        (dict(mode="train"), "mode"),
        (dict(mode="decode", q_heads=6, kv_heads=4), "multiple of kv_heads"),
        (dict(mode="decode", batches=(0,)), "batches"),
        (dict(rep=float("inf")), "rep"),
        (dict(warmup=float("nan")), "warmup"),
        (dict(max_memory_gb=float("nan")), "max_memory_gb"),
        (dict(seed=-1), "seed"),
        (dict(dtypes=()), "dtypes"),
        (dict(kernel_config=(48, 64, 4, 2)), "powers of 2"),
    ],
)
def test_bad_config_raises_value_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides).resolve()


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown backend"):
        run_sweep(tiny_config(backends=("naive", "fa9")), progress=False)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_stamped_flags_reproduce_the_config(mode):
    cfg = BenchConfig(mode=mode, device="cpu", seq_lens=(37, 2048), head_dims=(24,), max_memory_gb=3.5).resolve()
    again = bench.config_from_args(bench.build_parser().parse_args(cfg.to_argv())).resolve()
    assert again == cfg


def test_gqa_shares_each_key_value_head_among_query_heads_and_survives_the_stamp():
    cfg = BenchConfig(device="cpu", seq_lens=(64,), head_dims=(16, 32), model_dim=256, gqa=4).resolve()
    cells = cfg.cells()
    assert {(c.head_dim, c.heads, c.hk) for c in cells} == {(16, 16, 4), (32, 8, 2)}  # H = 256 / D, Hk = H / 4
    again = bench.config_from_args(bench.build_parser().parse_args(cfg.to_argv())).resolve()
    assert again == cfg and "--gqa" in cfg.to_argv()
    with pytest.raises(ValueError, match="must divide the 8 query heads at D = 32"):
        BenchConfig(device="cpu", seq_lens=(64,), head_dims=(32,), model_dim=256, gqa=3).resolve()
    with pytest.raises(ValueError, match="decode takes q_heads and kv_heads"):
        BenchConfig(mode="decode", device="cpu", gqa=2).resolve()


def test_cli_rejects_malformed_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--seq-lens", "1k,two"])
    assert e.value.code == 2
    assert "--seq-lens" in capsys.readouterr().err


# --- the command line ----------------------------------------------------------------------------------------------


def run_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "flashlab.bench", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_python_m_runs_and_writes_files(tmp_path):
    args = ["--device", "cpu", "--quick", "--seq-lens", "33", "--head-dims", "16", "--causal", "yes"]
    args += ["--backends", "naive,sdpa_math", "--rep", "1", "--no-progress", "--out", str(tmp_path / "cli")]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "forward TFLOP/s" in done.stdout and "wrote" in done.stdout
    meta = json.loads((tmp_path / "cli.json").read_text())["meta"]
    assert meta["command"] == "python -m flashlab.bench " + " ".join(args)
    assert meta["config"]["seq_lens"] == [33] and meta["config"]["causal"] == "yes"
    with (tmp_path / "cli.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(r["backend"], r["status"]) for r in table] == [("naive", "ok"), ("sdpa_math", "ok")]
    assert table[0]["batch"] == "3" and table[0]["heads"] == "4"  # 128 tokens // 33, model dim 64 // 16


def test_help_explains_every_flag():
    done = run_cli("--help")
    assert done.returncode == 0
    parser = bench.build_parser()
    flags = [s for a in parser._actions for s in a.option_strings]
    brief = ["--seq-lens", "--head-dims", "--dtypes", "--causal", "--backends", "--tokens", "--model-dim"]
    brief += ["--warmup", "--rep", "--out", "--device", "--quick", "--mode", "--batches", "--q-heads", "--kv-heads"]
    for flag in set(flags) | set(brief):
        assert flag in done.stdout, f"--help does not list {flag}"
    for action in parser._actions:
        assert action.help and len(action.help) > 10, f"{action.option_strings} has no real help text"


# --- every flag checked before anything runs -------------------------------------------------------------------------

# (argv, what the one-line error must name); {tmp} is a fresh folder, {file} a regular file in it
BAD_ARGUMENTS = [
    (["--mode", "train"], "--mode"),
    (["--mode", ""], "--mode"),
    (["--mode"], "--mode"),
    (["--seq-lens", ""], "--seq-lens"),
    (["--seq-lens", "0"], "--seq-lens"),
    (["--seq-lens=-5"], "--seq-lens"),
    (["--seq-lens", "1k,two"], "--seq-lens"),
    (["--seq-lens", "64,,128"], "--seq-lens"),
    (["--seq-lens", "99999999999"], "--seq-lens"),
    (["--head-dims", ""], "--head-dims"),
    (["--head-dims", "0"], "--head-dims"),
    (["--head-dims", "1.5"], "--head-dims"),
    (["--dtypes", ""], "--dtypes"),
    (["--dtypes", ","], "--dtypes"),
    (["--dtypes", "int8"], "unknown dtype"),
    (["--causal", "maybe"], "--causal"),
    (["--backends", ""], "--backends"),
    (["--backends", "naive,fa9"], "unknown backend"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens=-1"], "--tokens"),
    (["--tokens", "1.5"], "--tokens"),
    (["--model-dim", ""], "--model-dim"),
    (["--model-dim", "0"], "--model-dim"),
    (["--gqa", "0"], "--gqa"),
    (["--gqa", "nan"], "--gqa"),
    (["--gqa", "3", "--head-dims", "16", "--model-dim", "64"], "must divide"),
    (["--mode", "decode", "--batches", "0"], "--batches"),
    (["--batches", "2"], "--batches is for --mode decode only"),
    (["--mode", "decode", "--tokens", "64"], "--tokens is not for --mode decode"),
    (["--mode", "decode", "--q-heads", "0"], "--q-heads"),
    (["--mode", "decode", "--q-heads", "6", "--kv-heads", "4"], "multiple of kv_heads"),
    (["--mode", "decode", "--kv-heads", ""], "--kv-heads"),
    (["--warmup=-1"], "--warmup"),
    (["--warmup", "nan"], "--warmup"),
    (["--warmup", "inf"], "--warmup"),
    (["--rep", "0"], "--rep"),
    (["--rep", "inf"], "--rep"),
    (["--rep", "nan"], "--rep"),
    (["--rep=-1"], "--rep"),
    (["--rep", ""], "--rep"),
    (["--rep", "fast"], "--rep"),
    (["--rounds", "0"], "--rounds"),
    (["--rounds", "2.5"], "--rounds"),
    (["--out", ""], "--out"),
    (["--out", "{tmp}/"], "--out"),
    (["--out", "{file}/sub/run"], "cannot write"),
    (["--out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/kept"], "already exists"),
    (["--device", "tpu"], "--device"),
    (["--quick=yes"], "--quick"),
    (["--no-ceilings=1"], "--no-ceilings"),
    (["--overwrite=yes"], "--overwrite"),
    (["--no-progress=x"], "--no-progress"),
    (["--check-rows", "0"], "--check-rows"),
    (["--check-rows", ""], "--check-rows"),
    (["--max-memory-gb", "0"], "--max-memory-gb"),
    (["--max-memory-gb", "nan"], "--max-memory-gb"),
    (["--max-memory-gb=-2"], "--max-memory-gb"),
    (["--seed=-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--kernel-config", "64,64,4"], "kernel_config must be 4"),
    (["--kernel-config", "48,64,4,2"], "powers of 2"),
    (["--kernel-config", "0,64,4,2"], "--kernel-config"),
    (["--tile-order", "sideways"], "--tile-order"),
    (["--tma", "maybe"], "--tma"),
    (["--reps", "5"], "--reps"),
]


@pytest.mark.parametrize("argv,names", BAD_ARGUMENTS, ids=[" ".join(a) or "''" for a, _ in BAD_ARGUMENTS])
def test_every_bad_argument_is_one_line_and_exit_status_2_before_anything_runs(
    argv, names, tmp_path, monkeypatch, capsys
):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr("flashlab.bench.cli.run_sweep", must_not_run)
    monkeypatch.chdir(tmp_path)  # the default output folder, if one is made, lands here
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "kept.json").write_text("an earlier run")
    argv = [a.format(tmp=tmp_path, file=tmp_path / "file") for a in argv]
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert names in err
    assert (tmp_path / "kept.json").read_text() == "an earlier run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_asked_for_without_a_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda"])
    assert e.value.code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err


def test_python_m_refuses_an_infinite_rep_at_once():
    done = run_cli("--device", "cpu", "--rep", "inf", "--no-progress")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m flashlab.bench: error: argument --rep: must be a finite number above 0; got 'inf' "
        "(--help lists every flag)"
    ]


# --- results on disk are never replaced without --overwrite ---------------------------------------------------------

TINY_CLI = ["--device", "cpu", "--seq-lens", "8", "--head-dims", "4", "--dtypes", "fp32", "--causal", "no"]
TINY_CLI += ["--backends", "naive", "--tokens", "8", "--model-dim", "4", "--warmup", "0", "--rep", "1", "--no-progress"]


def test_out_with_files_there_is_refused_unless_overwrite(tmp_path, capsys):
    (tmp_path / "run.csv").write_text("an earlier run")
    with pytest.raises(SystemExit) as e:
        bench.main([*TINY_CLI, "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "run.csv already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "run.csv").read_text() == "an earlier run" and not (tmp_path / "run.json").exists()
    bench.main([*TINY_CLI, "--out", str(tmp_path / "run"), "--overwrite"])
    assert (tmp_path / "run.csv").read_text().startswith("backend,")
    assert json.loads((tmp_path / "run.json").read_text())["rows"][0]["backend"] == "naive"


def test_a_second_run_the_same_day_keeps_the_first_ones_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = bench.main(TINY_CLI)
    second = bench.main(TINY_CLI)
    prefix = tmp_path / bench.default_prefix(first.meta)
    assert prefix.parent == tmp_path / "test-artifacts" / "bench"
    assert json.loads(prefix.with_suffix(".json").read_text())["meta"]["date"] == first.meta["date"]
    again = prefix.with_name(prefix.name + "-2.json")
    assert json.loads(again.read_text())["meta"]["date"] == second.meta["date"]
    assert sorted(p.name for p in prefix.parent.iterdir()) == sorted(
        [prefix.name + ".json", prefix.name + ".csv", prefix.name + "-2.json", prefix.name + "-2.csv"]
    )


def test_save_writes_beside_earlier_files_and_replaces_them_only_when_asked(tmp_path):
    results = BenchResults(meta=dict(n=1), rows=[])
    assert results.save(tmp_path / "run") == (tmp_path / "run.json", tmp_path / "run.csv")
    results.meta["n"] = 2
    assert results.save(tmp_path / "run") == (tmp_path / "run-2.json", tmp_path / "run-2.csv")
    assert json.loads((tmp_path / "run.json").read_text())["meta"]["n"] == 1
    results.meta["n"] = 3
    assert results.save(tmp_path / "run", overwrite=True)[0] == tmp_path / "run.json"
    assert json.loads((tmp_path / "run.json").read_text())["meta"]["n"] == 3
    (tmp_path / "solo.csv").write_text("only the csv")  # either file taken moves both
    assert results.save(tmp_path / "solo")[1] == tmp_path / "solo-2.csv"
    assert (tmp_path / "solo.csv").read_text() == "only the csv" and not (tmp_path / "solo.json").exists()


# --- ratios keep their significant digits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x,text",
    [(0.001234, "0.00123"), (0.0456, "0.0456"), (0.5, "0.500"), (1.0, "1.00"), (2.345, "2.35"), (12.34, "12.3"),
     (123.4, "123"), (1234.5, "1234")],
)  # fmt: skip
def test_ratio_text_has_three_significant_digits(x, text):
    assert ratio_text(x) == text


def test_a_cpu_run_prints_its_small_ratios_with_their_digits():
    rows = [_row("flashlab", 1024, 812.0), _row("sdpa_flash", 1024, 1.0)]
    table = bench.summary_table(BenchResults(meta=dict(device_name="CPU", torch="t", triton="t", date="d"), rows=rows))
    assert "geo-mean 0.00123x over 1 cells (min 0.00123x, max 0.00123x)" in table
    assert "0.00x" not in table


# --- on a GPU ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_quick_sweep_on_gpu(tmp_path):
    results = run_sweep(BenchConfig(device="cuda", quick=True, seq_lens=(1000,), head_dims=(64,)), progress=False)
    assert results.ceilings["copy_tbps"] > 0.1 and results.ceilings["matmul_tflops"] > 1
    rows = by_backend(results)
    for name in ("naive", "flashlab", "sdpa_flash", "sdpa_math"):
        assert rows[(name, True)]["status"] == "ok", rows[(name, True)]
        assert rows[(name, True)]["peak_extra_mb"] > 0


def test_paged_cache_backends():
    cfg = BenchConfig(mode="decode", device="cpu", seq_lens=(70,), head_dims=(16,), batches=(2,))
    cfg = replace(cfg, q_heads=4, kv_heads=2, backends=("flashlab", "paged16", "paged256"), **FAST)
    results = run_sweep(cfg, progress=False)
    for r in results.rows:
        assert r["status"] == "ok" and r["rel_err"] < 1e-5, r
        assert math.isnan(r["host_us"]) and math.isnan(r["host_us_median"])  # measured on GPUs only
    assert "paged16 vs flashlab (contiguous): geo-mean" in bench.summary_table(results)
    prefill = run_sweep(tiny_config(backends=("paged16",)), progress=False)
    assert {r["status"] for r in prefill.rows} == {"skipped"}
    assert "decode cells" in prefill.rows[0]["reason"]


def test_host_time_is_the_fastest_round(monkeypatch):
    # host_us reads the fastest of its 11 rounds of 40 calls: stalls that land in six of them (one call each
    # sleeping 20 ms) move the median round, not the fastest one; a slower host (every call sleeping) moves
    # both. The GPU's synchronise is stubbed.
    import statistics
    import time

    from flashlab.bench import measure

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def stalled_in_six_rounds():
        calls = [0]

        def fn():
            i = calls[0] - 10  # after the 10 warm-up calls
            calls[0] += 1
            if i >= 0 and i % 40 == 0 and i // 40 < 6:
                time.sleep(0.02)

        return fn

    rounds = measure.host_us_rounds(stalled_in_six_rounds(), "cuda", calls=40, rounds=11, warmup=10)
    assert len(rounds) == 11 and statistics.median(rounds) > 400  # 20 ms over a round's 40 calls
    assert measure.host_us(stalled_in_six_rounds(), "cuda") < 100
    assert measure.host_us(lambda: time.sleep(0.001), "cuda", calls=5, rounds=3) > 900  # 1 ms every call
    assert math.isnan(measure.host_us(stalled_in_six_rounds(), "cpu"))
    assert measure.host_us_rounds(stalled_in_six_rounds(), "cpu") == []


# --- timing in rounds ----------------------------------------------------------------------------------------------


def test_rounds_turn_the_order_so_a_slow_first_slot_lands_on_no_one_backend(monkeypatch):
    # Whatever is timed first in a round is slowed down (as a GPU's clock or caches can be, after a check): with one
    # round that is always the first backend; with three rounds turning the order, each backend is first once and
    # its median round is an unslowed one. Each round gets a third of the rep.
    from flashlab.bench import measure

    log = []

    def fake_time_ms(fn, device, warmup, rep):
        log.append((fn, rep))
        first_in_round = len(log) % 3 == 1
        return 2.0 if first_in_round else 1.0

    monkeypatch.setattr(measure, "time_ms", fake_time_ms)
    fns = [lambda: None, lambda: None, lambda: None]
    times, failed = measure.time_rounds(fns, "cuda", warmup=5.0, rep=90.0, rounds=3)
    assert failed == {}
    assert [sorted(t) for t in times] == [[1.0, 1.0, 2.0]] * 3  # each was slowed exactly once
    firsts = [log[3 * r][0] for r in range(3)]
    assert all(any(f is g for f in firsts) for g in fns)  # each backend led one round
    assert {rep for _, rep in log} == {30.0}
    log.clear()
    single, _ = measure.time_rounds(fns, "cuda", warmup=5.0, rep=90.0, rounds=1)
    assert single == [[2.0], [1.0], [1.0]]  # one round: the first backend carries the whole penalty


def test_a_backend_that_fails_while_timed_is_an_error_and_the_rest_are_timed():
    calls = [0]

    def works_once(q, k, v, causal):  # right when checked, then fails
        calls[0] += 1
        if calls[0] > 2:  # the check and the memory measurement
            raise RuntimeError("device lost while timing")
        return naive_attention(q, k, v, causal)

    cfg = tiny_config(causal="no", rounds=3)
    rows = by_backend(run_sweep(cfg, extra_backends=[Backend("flaky", "fails after its check", works_once)],
                                progress=False))  # fmt: skip
    assert rows[("flaky", False)]["status"] == "error"
    assert "device lost while timing" in rows[("flaky", False)]["reason"]
    for name in ("naive", "sdpa_math"):
        r = rows[(name, False)]
        assert r["status"] == "ok" and r["time_ms"] > 0 and r["time_spread"] >= 0


def test_each_row_keeps_its_rounds_and_its_place_in_each_rounds_order():
    results = run_sweep(tiny_config(causal="no", rounds=3), progress=False)
    rows = [r for r in results.rows if r["status"] == "ok"]
    assert len(rows) == 2
    for i, r in enumerate(rows):  # naive, then sdpa_math: round r starts at backend r % 2
        assert len(r["round_ms"]) == 3 and r["time_ms"] == sorted(r["round_ms"])[1]
        assert r["round_position"] == [(i - k) % 2 for k in range(3)]
    positions = {tuple(r["round_position"]) for r in rows}
    assert positions == {(0, 1, 0), (1, 0, 1)}  # each backend timed first in some round
    assert json.loads(json.dumps(results.to_json()))["rows"][0]["round_ms"] == rows[0]["round_ms"]


def test_the_stamp_says_how_many_rounds():
    assert BenchConfig(device="cpu").resolve().rounds == 1
    results = run_sweep(tiny_config(causal="no", rounds=2), progress=False)
    assert "--rounds 2" in results.meta["command"]
    assert "2 round(s) per cell" in results.meta["timing"]
