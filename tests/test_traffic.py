"""The traffic measurement (``python -m flashlab.bench --mode traffic``): everything that does not need a GPU.

ncu's CSV is read from hand-written fixtures in ncu's two layouts (tests/fixtures/ncu_traffic_*.csv); the
recording the notebooks read is exercised on a SYNTHETIC file (tests/fixtures/traffic-synthetic.json, made by
make_synthetic_traffic.py from the models), never on a measurement. The GPU run itself is one test marked gpu.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from flashlab.bench import traffic
from flashlab.bench.results import newest_gpu_results
from flashlab.bench.traffic import (
    KERNEL_COLUMNS,
    MARKER,
    TrafficCase,
    TrafficConfig,
    TrafficResults,
    attribute_kernels,
    case_rows,
    naive_pass_names,
    parse_ncu_csv,
)
from flashlab.calculators import roofline

FIXTURES = ROOT / "tests" / "fixtures"
RAW = (FIXTURES / "ncu_traffic_raw.csv").read_text()
DETAILS = (FIXTURES / "ncu_traffic_details.csv").read_text()
SYNTHETIC = FIXTURES / "traffic-synthetic.json"

NAIVE = TrafficCase("naive", "bf16", 128, 1024, False, 1, 16)
FLASH = TrafficCase("flashlab", "bf16", 128, 1024, False, 1, 16)


def manifest(*cases, status="ok"):
    return [c.fields() | dict(status=status, reason="") for c in cases]


# -- reading ncu's CSV -------------------------------------------------------------------------------------------


def test_raw_page_gives_one_record_per_kernel_in_base_units():
    kernels = parse_ncu_csv(RAW)
    assert [k["id"] for k in kernels] == list(range(7))  # the ==PROF== lines and the units row are not kernels
    assert kernels[0]["kernel"] == kernels[5]["kernel"] == MARKER
    assert kernels[6]["kernel"] == "_attn_fwd"
    assert "SoftMaxForward" in kernels[3]["kernel"]  # names with commas inside quotes stay whole
    assert kernels[1]["dram__bytes_read.sum"] == 8_454_144  # thousands separators dropped
    assert kernels[6]["dram__bytes_write.sum"] == 2_883_584
    assert kernels[6]["gpu__time_duration.sum"] == 21_504
    assert kernels[6]["lts__t_sectors_op_read.sum"] == 2_097_152


def test_details_page_and_scaled_units_read_the_same_values():
    by_id = {k["id"]: k for k in parse_ncu_csv(DETAILS)}
    assert sorted(by_id) == [0, 6]
    flash = by_id[6]
    assert flash["kernel"] == "_attn_fwd"
    assert flash["dram__bytes_read.sum"] == pytest.approx(12.62e6)  # Mbyte -> bytes
    assert flash["gpu__time_duration.sum"] == pytest.approx(21_500)  # usecond -> ns
    assert flash["lts__t_sectors_op_read.sum"] == pytest.approx(2.10e6)  # Msector -> sectors
    assert by_id[0]["dram__bytes_read.sum"] == pytest.approx(2050)  # Kbyte is 1000 bytes, as ncu prints it
    raw = {k["id"]: k for k in parse_ncu_csv(RAW)}[6]
    for metric in ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum"):
        assert flash[metric] == pytest.approx(raw[metric], rel=2e-3), metric  # the two layouts agree


def test_an_h200_report_excerpt_reads_and_attributes_as_recorded():
    # the first four cases of the H200 recording, ncu's own raw CSV (device, launch and link columns dropped)
    text = (FIXTURES / "ncu_h200_raw_excerpt.csv").read_text()
    cases = json.loads((FIXTURES / "ncu_h200_raw_excerpt.cases.json").read_text())
    rows = attribute_kernels(parse_ncu_csv(text), cases)
    assert [r["backend"] for r in rows] == ["naive"] * 4 + ["flashlab", "sdpa_flash", "sdpa_cudnn"]
    assert [r["pass"] for r in rows[:4]] == ["QK^T", "scale", "softmax", "PV"]
    # the recording the excerpt was cut from (the first of that day; the second added flashlab's backward)
    recorded = TrafficResults.load(ROOT / "data" / "results" / "h200-traffic-bf16-2026-12-01-run1.json")
    for got, want in zip(rows, recorded.kernels[: len(rows)], strict=True):
        assert got["kernel"] == want["kernel"]
        for column in ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "l2_read_bytes", "duration_ns"):
            assert got[column] == want[column], column
    assert rows[0]["dram_read_bytes"] == 8_411_648 and rows[0]["duration_ns"] == 15_008  # "ns" is ncu's unit


def test_every_naive_kernel_of_the_recording_is_named_for_its_pass():
    recorded = TrafficResults.load(ROOT / "data" / "results" / "h200-traffic-bf16-2026-12-01.json")
    for case in recorded.ok_cases(backend="naive"):
        own = recorded.kernels_of(backend="naive", head_dim=case["head_dim"], seq_len=case["seq_len"],
                                  causal=case["causal"])  # fmt: skip
        passes = naive_pass_names([k["kernel"] for k in own])
        want = {"QK^T", "scale", "softmax", "PV"} | ({"mask build", "mask"} if case["causal"] else set())
        assert set(passes) == want, (case["seq_len"], case["causal"], passes)
        assert passes[0] == "QK^T" and passes[-1] == "PV"


def test_text_without_a_csv_header_is_refused():
    with pytest.raises(ValueError, match="--csv"):
        parse_ncu_csv("==PROF== Connected to process 1\n==ERROR== LibraryNotLoaded\n")


# -- giving kernels to cases -------------------------------------------------------------------------------------


def test_kernels_between_markers_belong_to_each_case_and_naive_passes_are_named():
    rows = attribute_kernels(parse_ncu_csv(RAW), manifest(NAIVE, FLASH), {"ncu": "Version 2025.3.1.0"})
    assert all(MARKER not in r["kernel"] for r in rows)
    naive = [r for r in rows if r["backend"] == "naive"]
    flash = [r for r in rows if r["backend"] == "flashlab"]
    assert [r["pass"] for r in naive] == ["QK^T", "scale", "softmax", "PV"]
    assert [r["position"] for r in naive] == [0, 1, 2, 3] and {r["case"] for r in naive} == {0}
    assert [r["kernel"] for r in flash] == ["_attn_fwd"] and flash[0]["case"] == 1
    assert flash[0]["l2_read_bytes"] == 2_097_152 * 32  # sectors are 32 bytes
    assert flash[0]["ncu"] == "Version 2025.3.1.0" and set(KERNEL_COLUMNS) <= set(flash[0])


def test_causal_eager_kernels_are_named_by_their_pass():
    names = ["void at::native::(anonymous namespace)::FillFunctor<bool>", "triu_tril_kernel<bool, false>",
             "nvjet_tst_192x192", "vectorized_elementwise_kernel<MulFunctor<float>>", "masked_fill_kernel",
             "cunn_SoftMaxForward<8>", "sm90_xmma_gemm_bf16bf16_bf16f32"]  # fmt: skip
    assert naive_pass_names(names) == ["mask build", "mask build", "QK^T", "scale", "mask", "softmax", "PV"]
    bare = [
        "FillFunctor",
        "triu_tril_kernel",
        "nvjet_tst_192x192",
        "vectorized_elementwise_kernel",
        "vectorized_elementwise_kernel",
        "cunn_SoftMaxForward",
        "nvjet_tst_128x64",
    ]  # function names only
    assert naive_pass_names(bare) == ["mask build", "mask build", "QK^T", "scale", "mask", "softmax", "PV"]
    assert naive_pass_names(bare[2:4] + bare[5:]) == ["QK^T", "scale", "softmax", "PV"]


def test_markers_that_disagree_with_the_manifest_are_an_error():
    kernels = parse_ncu_csv(RAW)
    with pytest.raises(ValueError, match="2 case markers .* profiled 3"):
        attribute_kernels(kernels, manifest(NAIVE, FLASH, FLASH))
    with pytest.raises(ValueError, match="before the first case marker"):
        attribute_kernels(kernels[1:5] + kernels[5:], manifest(FLASH))


def test_case_rows_sum_each_cases_kernels_and_skip_unprofiled_cases():
    cases = manifest(NAIVE) + manifest(FLASH, status="oom") + manifest(FLASH)  # the oom case was never profiled
    rows = attribute_kernels(parse_ncu_csv(RAW), [cases[0], cases[2]])
    naive, oom, flash = case_rows(cases, rows)
    assert naive["kernels"] == 4
    assert naive["dram_read_bytes"] == 8_454_144 + 33_619_968 + 33_587_200 + 37_814_272
    assert naive["dram_write_bytes"] == 12_582_912 + 13_107_200 + 12_845_056 + 2_097_152
    assert oom["kernels"] == 0 and math.isnan(oom["hbm_bytes"])
    assert flash["kernels"] == 1 and flash["hbm_bytes"] == 12_615_680 + 2_883_584
    x = 16 * 1024 * 128 * 2  # one of Q, K, V, O over 16 heads
    assert flash["io_bytes"] == flash["model_bytes"] == 4 * x
    assert flash["ratio"] == pytest.approx((12_615_680 + 2_883_584) / (4 * x))
    assert naive["lesson_bytes"] == 16 * (4 * 1024 * 1024 * 2) + 4 * x  # the lesson's four passes plus Q, K, V, O
    assert naive["model_bytes"] == 16 * (6 * 1024 * 1024 * 2) + 4 * x  # eager PyTorch: six passes


def test_a_case_that_failed_while_profiled_keeps_its_kernels_out_of_the_next_case():
    running = manifest(NAIVE)[0] | dict(status="running", profiled=True)  # the child ended inside this case
    config = TrafficConfig(seq_lens=(1024,), head_dims=(128,), causal="no", backends=("naive", "flashlab"), heads=16)
    cases = traffic.complete_manifest([running, manifest(FLASH)[0] | dict(profiled=True)], config)
    assert [c["status"] for c in cases] == ["error", "ok"]
    rows = attribute_kernels(parse_ncu_csv(RAW), cases)
    naive, flash = case_rows(cases, rows)
    assert naive["status"] == "error" and naive["kernels"] == 0 and "ended" in naive["reason"]
    assert flash["kernels"] == 1 and flash["dram_read_bytes"] == 12_615_680  # still the flash kernel's own
    short = traffic.complete_manifest([manifest(NAIVE)[0]], config)
    assert [c["status"] for c in short] == ["ok", "skipped"]


def test_the_child_checks_and_runs_every_case_and_writes_its_manifest(tmp_path, capsys):
    # the child's steps on the CPU (no profiler, no marker; flashlab in Triton's interpreter), tiny cases
    config = TrafficConfig(seq_lens=(40,), head_dims=(16,), dtype="fp32", causal="yes", heads=2, check_rows=8,
                           backends=("naive", "flashlab", "sdpa_cudnn", "flashlab_backward"))  # fmt: skip
    traffic.run_child(config, tmp_path / "cases.json", device="cpu")
    cases = json.loads((tmp_path / "cases.json").read_text())
    status = {c["backend"]: c["status"] for c in cases}
    assert status["naive"] == status["flashlab"] == "ok", cases
    assert all(c["profiled"] for c in cases if c["status"] == "ok")
    assert cases[0]["rel_err"] < 1e-5  # checked against the float64 reference before it ran
    assert status["sdpa_cudnn"] == "error" and not next(c for c in cases if c["backend"] == "sdpa_cudnn")["profiled"]
    if status["flashlab_backward"] == "unavailable":  # until flashlab.kernels.flash_backward exists
        assert "not available" in cases[-1]["reason"]
    assert "[4/4" in capsys.readouterr().out


# -- the models the measurement is put beside --------------------------------------------------------------------


def test_eager_naive_model_counts_every_kernel():
    s, x = 8192 * 8192 * 2, 8192 * 128 * 2
    kernels = roofline.eager_naive_attention_kernels(8192, 128)
    assert [k.name for k in kernels] == ["QK^T", "scale", "softmax", "PV"]
    assert [(k.read, k.write) for k in kernels] == [(2 * x, s), (s, s), (s, s), (s + x, x)]
    assert roofline.eager_naive_attention_traffic(8192, 128) == 813_694_976
    causal = roofline.eager_naive_attention_kernels(8192, 128, causal=True)
    assert [k.name for k in causal] == ["QK^T", "scale", "mask", "softmax", "PV"]
    assert roofline.eager_naive_attention_traffic(8192, 128, causal=True) == 813_694_976 + 2 * s + 8192**2
    # 16 heads at 8K: 6 passes over S, 13.0 GB, where the lesson's 4 passes give 8.6 GB
    assert 16 * roofline.eager_naive_attention_traffic(8192, 128) == pytest.approx(13.02e9, rel=1e-3)
    assert roofline.flash_attention_backward_traffic(8192, 128) == 8 * x + 3 * 8192 * 4  # + lse, delta in fp32
    with pytest.raises(ValueError, match="n"):
        roofline.eager_naive_attention_kernels(0, 128)


def test_gap_explanations_come_from_the_counters():
    results = TrafficResults.load(SYNTHETIC)
    table = traffic.predicted_vs_measured(results)
    assert table and {r["backend"] for r in table} == {"naive", "flashlab", "sdpa_flash", "sdpa_cudnn"}
    flash = next(r for r in table if r["backend"] == "flashlab" and r["seq_len"] == 2048 and not r["causal"])
    case = next(c for c in results.ok_cases(backend="flashlab", seq_len=2048, causal=False, head_dim=64))
    o = case["io_bytes"] / 4
    held = o - case["dram_write_bytes"]
    assert any(roofline.format_bytes(held) in w and "not yet written back" in w for w in flash["why"])
    assert any("K and V pass through L2 16.0 times" in w for w in flash["why"])  # 2048 / 128-row tiles
    causal = next(r for r in table if r["backend"] == "flashlab" and r["seq_len"] == 2048 and r["causal"])
    assert any(w.startswith("causal: 0.5") for w in causal["why"])  # fewer K/V tiles through L2
    naive = next(r for r in table if r["backend"] == "naive" and r["seq_len"] == 4096 and not r["causal"])
    passes = float(naive["why"][0].split()[0])
    c = next(c for c in results.ok_cases(backend="naive", seq_len=4096, causal=False, head_dim=naive["head_dim"]))
    assert passes == pytest.approx((c["hbm_bytes"] - c["io_bytes"]) / c["score_bytes"], abs=0.05)


def test_headline_quotes_predicted_and_measured_bytes_and_their_ratio():
    results = TrafficResults.load(SYNTHETIC)
    naive = results.ok_cases(backend="naive", seq_len=4096, head_dim=128, causal=False)[0]
    flash = results.ok_cases(backend="flashlab", seq_len=4096, head_dim=128, causal=False)[0]
    line = traffic.headline(results, 4096, 128)
    assert roofline.format_bytes(naive["hbm_bytes"]) in line and roofline.format_bytes(flash["model_bytes"]) in line
    assert f"measured {naive['hbm_bytes'] / flash['hbm_bytes']:.0f}x" in line
    assert "not both measured" in traffic.headline(results, 8192, 128)


def test_growth_with_n_separates_n_squared_from_n():
    slopes = traffic.growth_with_n(TrafficResults.load(SYNTHETIC))
    assert slopes[("flashlab", 128, False)] == pytest.approx(1.0, abs=0.01)  # Q, K, V, O: linear in N
    assert 1.9 < slopes[("naive", 128, False)] < 2.3  # the score matrix: N^2 (steeper while L2 still absorbs some)
    l2 = traffic.growth_with_n(TrafficResults.load(SYNTHETIC), "l2_bytes")
    assert l2[("flashlab", 128, False)] > 1.5  # K/V re-reads through L2 grow as N^2


# -- files ------------------------------------------------------------------------------------------------------


def test_files_have_the_promised_shape_and_the_loader_picks_the_newest_gpu_recording(tmp_path):
    results = TrafficResults.load(SYNTHETIC)
    assert traffic.newest_traffic_results(FIXTURES) is None  # synthetic: never offered as a recording
    meta = results.meta | dict(is_cuda_gpu=True, synthetic=False, device_name="NVIDIA H200")
    for date in ("2026-12-01T10:00:00Z", "2026-12-02T09:00:00Z"):
        m = meta | {"date": date}
        TrafficResults(m, results.cases, results.kernels).save(tmp_path / traffic.default_prefix(m).name)
    (tmp_path / "h200-bf16-2026-12-03.json").write_text(json.dumps({"meta": meta | {"mode": "prefill"}}))
    newest = traffic.newest_traffic_results(tmp_path)
    assert newest_gpu_results(tmp_path) == tmp_path / "h200-bf16-2026-12-03.json"  # the timing loader skips traffic
    assert newest == tmp_path / "h200-traffic-bf16-2026-12-02.json"
    data = json.loads(newest.read_text())
    assert set(data) == {"meta", "cases", "kernels"}
    assert {"device_name", "torch", "triton", "date", "command", "ncu"} <= set(data["meta"])
    assert set(data["cases"][0]) == set(traffic.CASE_COLUMNS)
    with open(newest.with_suffix(".csv")) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == KERNEL_COLUMNS and len(rows) == len(results.kernels)
    back = TrafficResults.load(newest)
    assert back.cases[0]["hbm_bytes"] == pytest.approx(results.cases[0]["hbm_bytes"])
    assert math.isnan(next(c for c in back.cases if c["status"] != "ok")["hbm_bytes"])


# -- the command, without a GPU or without ncu ------------------------------------------------------------------


def test_without_a_gpu_the_command_says_so_and_exits_non_zero():
    if traffic.unavailable_reason() is None:
        pytest.skip("this machine can measure")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "flashlab.bench", "--mode", "traffic", "--quick"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flashlab.bench --mode traffic: cannot measure here:") and "GPU" in last
    assert "Traceback" not in proc.stderr


def test_without_ncu_the_reason_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    monkeypatch.setattr(traffic.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(traffic.os.path, "isfile", lambda p: False)
    reason = traffic.unavailable_reason(cuda_available=True)
    assert "Nsight Compute" in reason and "--ncu" in reason
    assert "not an executable" in traffic.unavailable_reason("/no/such/ncu", cuda_available=True)


def test_ncu_is_found_on_the_path_and_run_with_the_promised_flags(tmp_path, monkeypatch):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho 'NVIDIA (R) Nsight Compute Command Line Profiler'\necho 'Version 2025.3.1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    assert traffic.find_ncu() == str(fake)
    assert traffic.ncu_version(str(fake)) == "Version 2025.3.1.0"
    assert traffic.unavailable_reason(cuda_available=True) is None
    cmd = traffic.ncu_command(str(fake), traffic.METRICS, tmp_path / "r", ["python", "-m", "x"])
    text = " ".join(cmd)
    for flag in ("--profile-from-start off", "--clock-control none", "--target-processes all",
                 "--replay-mode kernel", "--metrics " + ",".join(traffic.METRICS)):  # fmt: skip
        assert flag in text
    assert cmd[-3:] == ["python", "-m", "x"]


def test_cli_routes_traffic_mode_and_its_flags_reproduce_the_config(capsys):
    from flashlab.bench.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--mode", "traffic", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--mode traffic" in out and "--ncu" in out and "--heads" in out
    config = TrafficConfig(seq_lens=(1024, 3000), head_dims=(64,), causal="yes", heads=8).resolve()
    args = traffic.build_parser().parse_args(config.to_argv())
    again = traffic.config_from_args(args).resolve()
    assert again.cases() == config.cases()
    assert [c.heads for c in again.cases()] == [8, 8] * len(traffic.TRAFFIC_BACKENDS)


def test_default_cases_are_the_recorded_grid():
    cases = TrafficConfig().cases()
    assert {c.seq_len for c in cases} == {1024, 2048, 4096, 8192, 16384}
    assert {(c.head_dim, c.heads) for c in cases} == {(64, 32), (128, 16)}  # H = 2048 / D, B = 1
    assert {c.batch for c in cases} == {1} and {c.causal for c in cases} == {False, True}
    assert set(traffic.TRAFFIC_BACKENDS) == {c.backend for c in cases}
    assert cases[0].head_dim == 128 and not cases[0].causal  # the lesson's case comes first
    with pytest.raises(ValueError, match="unknown traffic backend"):
        TrafficConfig(backends=("sdpa_math",)).resolve()


@pytest.mark.gpu
def test_quick_recording_on_a_gpu_with_ncu(tmp_path):
    if traffic.unavailable_reason() is not None:
        pytest.skip(traffic.unavailable_reason())
    config = TrafficConfig(seq_lens=(1024,), head_dims=(128,), causal="no", backends=("naive", "flashlab"))
    results = traffic.measure_traffic(config)
    naive, flash = results.ok_cases(backend="naive")[0], results.ok_cases(backend="flashlab")[0]
    assert naive["kernels"] >= 3 and flash["kernels"] >= 1
    assert flash["dram_read_bytes"] >= 0.9 * 3 * flash["io_bytes"] / 4  # Q, K, V cross HBM at least once
    assert naive["hbm_bytes"] > 3 * flash["hbm_bytes"]
    Path(results.save(tmp_path / "t")[0]).read_text()


FAKE_NCU = """#!/usr/bin/env python3
# Stands in for ncu: profiling writes an empty report and the manifest the child would write; --import prints
# the fixture's CSV; --version answers.
import json, sys
args = sys.argv[1:]
if "--version" in args:
    print("Version 2099.1.0 (fake)")
elif "--import" in args:
    print(open(%r).read())
else:
    open(args[args.index("--export") + 1] + ".ncu-rep", "w").write("report")
    cases = %r
    open(args[args.index("--traffic-child") + 1], "w").write(json.dumps(cases))
    print("==PROF== Connected to process 1")
    print("[1/2] naive: ok")
"""


def test_the_parent_runs_ncu_reads_its_report_and_writes_the_files(tmp_path, monkeypatch):
    import torch

    import flashlab.bench.stamp

    cases = [c | dict(profiled=True) for c in manifest(NAIVE, FLASH)]
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU % (str(FIXTURES / "ncu_traffic_raw.csv"), cases))
    fake.chmod(0o755)
    stamp = dict(tool="flashlab.bench", device_name="NVIDIA H200", is_cuda_gpu=True, torch="t", triton="tr",
                 cuda="13.0", date="2026-12-01T10:00:00Z")  # fmt: skip
    monkeypatch.setattr(traffic, "unavailable_reason", lambda ncu=None: None)
    monkeypatch.setattr(flashlab.bench.stamp, "environment_stamp", lambda device: dict(stamp))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"L2_cache_size": 60 * 2**20}))
    config = TrafficConfig(seq_lens=(1024,), head_dims=(128,), causal="no", backends=("naive", "flashlab"), heads=16,
                           ncu=str(fake))  # fmt: skip
    results = traffic.measure_traffic(config, keep_report=tmp_path / "kept.ncu-rep")
    assert results.meta["ncu"] == "Version 2099.1.0 (fake)" and results.meta["l2_bytes"] == 60 * 2**20
    assert [c["kernels"] for c in results.cases] == [4, 1]
    assert (tmp_path / "kept.ncu-rep.csv").read_text().startswith("==PROF==")
    json_path, _ = results.save(tmp_path / traffic.default_prefix(results.meta).name)
    assert json_path.name == "h200-traffic-bf16-2026-12-01.json"
    assert "naive" in traffic.summary_table(results)


# -- the notebooks' cells, on a recording and without one -------------------------------------------------------


def _run_cells(path, ids, monkeypatch, found):
    import matplotlib
    import nbformat

    matplotlib.use("Agg")
    monkeypatch.setattr(traffic, "notebook_traffic", lambda directory, live="auto": found)
    nb = nbformat.read(ROOT / "notebooks" / path, as_version=4)
    namespace: dict = {}
    cells = {c.id: c for c in nb.cells}
    for cell_id in ids:
        exec(compile(cells[cell_id].source, f"{path}:{cell_id}", "exec"), namespace)
    return namespace


NB02_TRAFFIC = ["nb02-01", "nb02-t1", "nb02-t3", "nb02-t5", "nb02-t7"]


def test_notebook_02_traffic_cells_show_a_recording(monkeypatch, capsys):
    found = (TrafficResults.load(SYNTHETIC), "recorded (synthetic test fixture)")
    ns = _run_cells("02_score_matrix_and_traffic.ipynb", NB02_TRAFFIC, monkeypatch, found)
    out = capsys.readouterr().out
    assert ns["D_T"] == 128 and ns["N_T"] == 4096  # the lesson's head dim; the longest length recorded
    assert "SYNTHETIC" in out and "reproduce with" in out
    assert "QK^T" in out and "softmax" in out and "total: measured" in out
    assert "naive / flashlab, no mask: predicted" in out and "not yet written back" in out
    assert "how the bytes grow with n" in out


def test_notebook_02_traffic_cells_without_a_recording(monkeypatch, capsys):
    _run_cells("02_score_matrix_and_traffic.ipynb", NB02_TRAFFIC, monkeypatch, (None, "no traffic recording"))
    out = capsys.readouterr().out
    assert "Nothing measured to show" in out and "python -m flashlab.bench --mode traffic" in out


def test_notebook_05_roofline_uses_measured_bytes_where_recorded(monkeypatch, capsys):
    found = (TrafficResults.load(SYNTHETIC), "recorded (synthetic test fixture)")
    monkeypatch.chdir(ROOT / "notebooks")  # the notebook reads ../data/results
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the recorded GPU sweep, never a live one
    ns = _run_cells("05_timing_on_gpu.ipynb", ["999323e5", "c179b1bc", "nb05-traffic", "c847ecce"], monkeypatch, found)
    out = capsys.readouterr().out
    assert ns["SOURCE"] == "recorded GPU"
    measured = [r for r in ns["results"].ok_rows() if ns["measured_bytes"](r) is not None]
    assert measured and {r["seq_len"] for r in measured} <= {1024, 2048, 4096}  # the fixture's lengths only
    r = measured[0]
    case = TrafficResults.load(SYNTHETIC).ok_cases(
        backend=r["backend"], head_dim=r["head_dim"], seq_len=r["seq_len"], causal=r["causal"]
    )[0]
    assert ns["traffic"](r) == pytest.approx(case["hbm_bytes"] / case["heads"] * r["batch"] * r["heads"])
    assert f"{len(measured)} of " in out and "measured HBM bytes from recorded" in out


def test_the_child_stops_starting_cases_when_its_time_is_nearly_gone(tmp_path):
    config = TrafficConfig(seq_lens=(40,), head_dims=(16,), dtype="fp32", causal="no", heads=2, timeout_s=0,
                           backends=("naive", "flashlab"))  # fmt: skip
    traffic.run_child(config, tmp_path / "cases.json", device="cpu")
    cases = json.loads((tmp_path / "cases.json").read_text())
    assert [c["status"] for c in cases] == ["skipped", "skipped"] and "time limit" in cases[0]["reason"]


# -- decode: the bytes an 8-bit cache saves -------------------------------------------------------------------


DECODE = dict(seq_lens=(96,), head_dims=(32,), dtype="bf16", causal="no", heads=4, kv_heads=2, batch=2, check_rows=8)


def test_decode_cases_read_one_token_against_a_cache_whose_bytes_the_8_bit_twin_halves():
    cases = TrafficConfig(backends=("paged256", "paged256_fp8"), **DECODE).cases()
    assert [(c.backend, c.kv_heads, c.decode) for c in cases] == [("paged256", 2, True), ("paged256_fp8", 2, True)]
    sixteen, eight = (traffic.predictions(c)["model_bytes"] for c in cases)
    q_and_o = 2 * 2 * 4 * 32 * 2  # one token of q and of o, every (sequence, query head), bf16
    assert sixteen - q_and_o == 2 * 2 * 2 * 96 * 32 * 2  # K and V: B x Hk x N x D, two bytes each
    assert eight - q_and_o == (sixteen - q_and_o) // 2
    assert traffic.predictions(TrafficCase("flashlab", "bf16", 32, 96, False, 2, 4))["model_bytes"] > sixteen
    with pytest.raises(ValueError, match="kv_heads is for the decode backends"):
        TrafficConfig(backends=("flashlab",), heads=4, kv_heads=2).resolve()
    with pytest.raises(ValueError, match="dividing heads"):
        TrafficConfig(backends=("paged256",), heads=4, kv_heads=3).resolve()
    config = TrafficConfig(backends=("paged16", "paged16_fp8"), **DECODE).resolve()
    again = traffic.config_from_args(traffic.build_parser().parse_args(config.to_argv())).resolve()
    assert again.cases() == config.cases()


def test_the_child_checks_a_decode_step_on_each_cache_against_what_it_stands_for(tmp_path):
    # on the CPU (the interpreter): the 8-bit cache's step is checked against float64 of the dequantised cache
    config = TrafficConfig(backends=("paged16", "paged16_fp8"), **DECODE)
    traffic.run_child(config, tmp_path / "cases.json", device="cpu")
    cases = json.loads((tmp_path / "cases.json").read_text())
    assert [(c["backend"], c["status"], c["kv_heads"]) for c in cases] == [
        ("paged16", "ok", 2),
        ("paged16_fp8", "ok", 2),
    ], cases
    assert all(c["rel_err"] < 1e-2 for c in cases)


def test_the_8_bit_read_ratio_pairs_each_8_bit_case_with_its_16_bit_twin():
    fields = dict(dtype="bf16", head_dim=128, seq_len=32768, causal=False, batch=8, heads=64, kv_heads=8)
    rows = [dict(fields, backend="paged256", status="ok", dram_read_bytes=1000.0),
            dict(fields, backend="paged256_fp8", status="ok", dram_read_bytes=520.0),
            dict(fields, backend="paged16_fp8", status="ok", dram_read_bytes=600.0)]  # fmt: skip  # no 16-bit twin
    ratios = traffic.eight_bit_read_ratios(TrafficResults({}, rows, []))
    assert ratios == {("paged256_fp8", "D=128 N=32768 B=8 H=64/8"): 0.52}
