"""``--mode loops`` and ``--mode coldstart`` on the CPU: what they would run, their lengths, their bars, their files.

The loops run a few steps of tiny loops through Triton's interpreter (the code path CI can test; the times say
nothing about a GPU); coldstart lists its calls, and runs a few of them at toy sizes in a fresh process.
"""

from __future__ import annotations

import csv
import json
import time

import pytest
import torch

from flashlab.bench import coldstart, loops
from flashlab.bench.cli import main as bench_main
from flashlab.bench.results import newest_gpu_results

# --- the loops' lengths -------------------------------------------------------------------------------------------


def _case(family, plan=loops.GPU_PLAN):
    return [c for c in loops.cases(plan, "cpu", (family,))]


def test_the_gpu_plan_is_the_one_asked_for():
    plan = loops.GPU_PLAN
    assert plan.steps == 200 and (plan.q_heads, plan.kv_heads, plan.head_dim, plan.dtype) == (32, 8, 128, "bf16")
    assert {b for b, _ in plan.growing} == {1, 8} and {n for _, n in plan.growing} == {4096, 32768}
    assert plan.chunked == (((300, 1001, 7), (4000, 5301, 13)),) and plan.prefill_heads == 16
    assert {(b, n, bs) for b, n, bs in plan.paged} >= {(8, 32768, 16), (8, 32768, 256)}


def test_a_growing_loop_meets_a_new_length_every_call_and_the_fixed_loop_one():
    plan = loops.GPU_PLAN
    for case in _case("growing"):
        growing = [case.lengths["flashlab growing"](g)[1] for g in range(plan.calls)]
        n0 = growing[0]
        assert growing == list(range(n0, n0 + plan.calls))  # one more key every call, across every pass
        assert case.lengths["sdpa_flash growing"](5) == case.lengths["flashlab growing"](5)
        fixed = {case.lengths["flashlab fixed"](g) for g in range(plan.calls)}
        assert fixed == {(1, n0 + plan.calls // 2)}  # the middle of the lengths the growing loop meets


def test_chunked_prefill_never_repeats_a_shape_across_passes():
    plan = loops.GPU_PLAN
    (case,) = _case("chunked")
    shapes = [case.lengths["flashlab changing"](g) for g in range(plan.calls)]
    assert len(set(shapes)) == plan.calls  # every call of every pass a new (Nq, Nk)
    nqs, nks = {nq for nq, _ in shapes}, {nk for _, nk in shapes}
    assert min(nqs) == 300 and max(nqs) == 1000 and all((nq - 300) % 7 == 0 for nq in nqs)
    assert min(nks) == 4000 and max(nks) == 5300 and all((nk - 4000) % 13 == 0 for nk in nks)
    assert {case.lengths["flashlab repeated"](g) for g in range(plan.calls)} == {(650, 4650)}
    # the pairing can fail: walking both ranges in step would repeat a shape every 101 calls
    in_step = [(300 + 7 * (g % 101), 4000 + 13 * (g % 101)) for g in range(plan.calls)]
    assert len(set(in_step)) == 101


def test_dry_run_lists_every_loop_and_bar_without_running(capsys):
    assert bench_main(["--mode", "loops", "--dry-run", "--device", "cuda"]) is None
    out = capsys.readouterr().out
    for text in ("B=8 n0=32K", "B=1 n0=4K", "Nq 300-1000, Nk 4000-5300", "B=8 N=32K blocks of 256",
                 "growing / fixed: flashlab growing / flashlab fixed <= 1.5",
                 "changing / SDPA FLASH: flashlab changing / sdpa_flash changing <= 1",
                 "contiguous / paged default: flashlab contiguous / paged16 default >= 0.9"):  # fmt: skip
        assert text in out, f"{text!r} not in the dry run:\n{out}"


# --- the bars ------------------------------------------------------------------------------------------------------


def _rows(**per_call):
    return [dict(variant=name, per_call_us=us) for name, us in per_call.items()]


@pytest.mark.parametrize(
    "what, first, second, passed",
    [
        ("growing / fixed", 140.0, 100.0, True),
        ("growing / fixed", 160.0, 100.0, False),
        ("changing / SDPA FLASH", 99.0, 100.0, True),
        ("changing / SDPA FLASH", 101.0, 100.0, False),
        ("contiguous / paged default", 90.0, 100.0, True),  # the paged call at 90 % of contiguous speed
        ("contiguous / paged default", 80.0, 100.0, False),
    ],
)
def test_each_comparison_is_held_to_its_bar(what, first, second, passed):
    case = loops.Case("f", "c", {}, lambda: [], [(what, "a", "b")])
    (c,) = loops.compare(case, _rows(a=first, b=second))
    assert c["ratio"] == pytest.approx(first / second) and c["passed"] is passed


def test_a_loop_not_timed_passes_no_bar_and_a_shown_ratio_holds_none():
    case = loops.Case("f", "c", {}, lambda: [], [("growing / fixed", "a", "b"), ("growing / SDPA FLASH", "a", "b")])
    held, shown = loops.compare(case, _rows(a=None, b=100.0))
    assert held["ratio"] is None and held["passed"] is None
    shown = loops.compare(case, _rows(a=50.0, b=100.0))[1]
    assert shown["bar"] is None and shown["passed"] is None and shown["ratio"] == 0.5


# --- timing --------------------------------------------------------------------------------------------------------


def test_loop_seconds_times_the_whole_loop_and_keeps_the_outputs_asked_for():
    def step(g):
        time.sleep(0.002)
        return torch.full((1,), float(g))

    seconds, kept = loops.loop_seconds(step, range(3, 8), "cpu", keep=(3, 7))
    assert seconds >= 5 * 0.002
    assert sorted(kept) == [3, 7] and kept[7].item() == 7.0
    assert len(loops.step_seconds(step, range(4), "cpu")) == 4


def _tiny_case(wrong: bool) -> loops.Case:
    """One decode loop through flashlab, and one whose output is wrong by a little more than the tolerance."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    k, v = torch.randn(1, 2, 29, 16, generator=gen), torch.randn(1, 2, 29, 16, generator=gen)

    def sdpa(g):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return o * (1.001 if wrong else 1.0)  # fp32's tolerance is 1e-5

    def build():
        return [loops.Variant("right", lambda g: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                              enable_gqa=True), lambda g: (q, k, v, False), lambda g: (1, 29)),
                loops.Variant("maybe wrong", sdpa, lambda g: (q, k, v, False), lambda g: (1, 29))]  # fmt: skip

    params = dict(dtype="fp32", batch=1, q_heads=4, kv_heads=2, head_dim=16, causal=False)
    return loops.Case("growing", "tiny", params, build, [("growing / fixed", "maybe wrong", "right")])


def test_a_loop_that_fails_the_float64_check_is_not_timed():
    plan = loops.LoopPlan(steps=2, passes=2)
    rows = {r["variant"]: r for r in loops.run_case(_tiny_case(wrong=True), plan, "cpu")}
    assert rows["right"]["status"] == "ok" and len(rows["right"]["pass_ms"]) == 2
    assert rows["right"]["rel_err"] <= rows["right"]["tol"]
    bad = rows["maybe wrong"]
    assert bad["status"] == "wrong" and "relative error" in bad["reason"]
    assert bad["per_call_us"] is None and bad["pass_ms"] == [] and bad["first_pass_ms"] is not None
    (c,) = loops.compare(_tiny_case(True), list(rows.values()))
    assert c["passed"] is None
    good = {r["variant"]: r for r in loops.run_case(_tiny_case(wrong=False), plan, "cpu")}
    assert good["maybe wrong"]["status"] == "ok"


@pytest.mark.slow
def test_quick_cpu_run_writes_json_csv_and_txt(tmp_path, capsys):
    prefix = tmp_path / "run"
    argv = ["--mode", "loops", "--device", "cpu", "--quick", "--steps", "2", "--no-progress", "--out", str(prefix)]
    results = bench_main(argv)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["meta"]["mode"] == "loops" and data["meta"]["tool"] == "flashlab.bench"
    assert data["meta"]["command"].startswith("python -m flashlab.bench --mode loops")
    rows = data["rows"]
    assert {r["family"] for r in rows} == set(loops.FAMILIES)
    assert len(rows) == sum(len(c.lengths) for c in loops.cases(loops.CPU_PLAN, "cpu"))
    for r in rows:  # every loop checked against float64 and timed
        assert r["status"] == "ok", r
        assert r["rel_err"] <= r["tol"]
        assert r["per_call_us"] == pytest.approx(r["loop_ms"] * 1e3 / 2)
        assert len(r["pass_ms"]) == 1 and len(r["step_us"]) == 2 == len(r["step_nk"])
        assert r["first_pass_ms"] > 0
    growing = next(r for r in rows if r["variant"] == "flashlab growing")
    assert growing["step_nk"] == [growing["nk_last"] + 1, growing["nk_last"] + 2]  # still new lengths
    held = [c for c in data["comparisons"] if c["bar"] is not None]
    assert {c["comparison"] for c in held} == set(loops.BARS)
    assert all(isinstance(c["passed"], bool) for c in held)
    with (tmp_path / "run.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == loops.ROW_COLUMNS and len(list(reader)) == len(rows)
    txt = (tmp_path / "run.txt").read_text()
    assert "bars: " in txt and "growing decode, B=2 n0=37" in txt and txt in capsys.readouterr().out + "\n"
    assert results["rows"][0]["variant"] == rows[0]["variant"]
    # the notebook's loader: a CPU run is never a recording; the same file stamped by a GPU is the newest loops one
    assert newest_gpu_results(tmp_path, mode="loops") is None
    data["meta"]["is_cuda_gpu"] = True
    (tmp_path / "gpu.json").write_text(json.dumps(data))
    assert newest_gpu_results(tmp_path, mode="loops") == tmp_path / "gpu.json"
    assert newest_gpu_results(tmp_path, mode="decode") is None


def test_an_unknown_family_and_an_existing_out_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "loops", "--families", "growing,spiral"])
    assert e.value.code == 2 and "spiral" in capsys.readouterr().err
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "loops", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err


# --- coldstart -----------------------------------------------------------------------------------------------------


def test_coldstart_lists_forty_assorted_calls(capsys):
    assert bench_main(["--mode", "coldstart", "--dry-run"]) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 40
    calls = coldstart.CALLS
    assert len(calls) == 40 and len({c.name for c in calls}) == 40
    assert all(c.name in "\n".join(lines) for c in calls)
    assert {c.dtype for c in calls} == {"bf16", "fp16", "fp32"}
    dims = {c.head_dim for c in calls}
    assert min(dims) <= 32 and max(dims) == 256 and any(d & (d - 1) for d in dims)  # a head dim not a power of 2
    assert {c.kind for c in calls} == {"prefill", "decode", "paged decode"}
    assert any(c.causal for c in calls) and any(c.window for c in calls) and any(c.q_heads > c.kv_heads for c in calls)
    assert min(c.nk for c in calls) == 1 and max(c.nk for c in calls) >= 70_000
    assert all(c.q_heads % c.kv_heads == 0 and c.head_dim % 8 == 0 and 16 <= c.head_dim <= 256 for c in calls)


def test_quick_calls_are_toy_sized_and_keep_their_kind():
    for call in coldstart.CALLS:
        small = coldstart.quick_call(call)
        assert small.nk <= 48 and small.batch == 1 and small.kv_heads <= 2
        assert small.q_heads % small.kv_heads == 0 and (small.q_heads > small.kv_heads) == (
            call.q_heads > call.kv_heads
        )
        assert (small.causal, small.dtype, small.head_dim, small.block_size) == (
            call.causal, call.dtype, call.head_dim, call.block_size)  # fmt: skip


def test_coldstart_without_a_warmup_module_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(coldstart, "warmup_module_present", lambda: False)
    fake = dict(wall_s=1.0, import_s=0.5, cache_files_at_start=0, rows=[])
    monkeypatch.setattr(coldstart, "run_child", lambda *a, **k: fake)
    results = bench_main(["--mode", "coldstart", "--device", "cpu", "--out", str(tmp_path / "cs")])
    assert [p["phase"] for p in results["meta"]["phases"]] == ["cold"]
    assert any("flashlab.warmup does not exist" in n for n in results["meta"]["notes"])
    assert "flashlab.warmup does not exist" in (tmp_path / "cs.txt").read_text()


@pytest.mark.slow
def test_coldstart_times_first_calls_in_a_fresh_process_with_an_empty_cache(tmp_path, monkeypatch):
    # the second phase with a stand-in warm-up: the child sees the folder the warm-up filled
    def fake_warmup(cache_dir, extra, timeout):
        (tmp_path / "marker").write_text(cache_dir)
        with open(f"{cache_dir}/planted", "w") as f:
            f.write("x")
        return dict(command="python -m flashlab.warmup", help="", returncode=0, wall_s=0.1, output_tail=[])

    monkeypatch.setattr(coldstart, "warmup_module_present", lambda: True)
    monkeypatch.setattr(coldstart, "run_warmup", fake_warmup)
    argv = ["--mode", "coldstart", "--device", "cpu", "--quick", "--limit", "2", "--out", str(tmp_path / "cs")]
    results = bench_main(argv)
    cold, warm = results["meta"]["phases"]
    assert (cold["phase"], warm["phase"]) == ("cold", "after warmup")
    assert cold["cache_files_at_start"] == 0 and warm["cache_files_at_start"] == 1
    assert cold["import_s"] > 0 and cold["wall_s"] > cold["import_s"] and warm["warmup_s"] == 0.1
    rows = results["rows"]
    assert [(r["phase"], r["index"]) for r in rows] == [("cold", 0), ("cold", 1), ("after warmup", 0),
                                                         ("after warmup", 1)]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r
        assert r["first_ms"] > 0 and r["second_ms"] > 0 and r["rel_err"] <= r["tol"]
    with (tmp_path / "cs.csv").open() as f:
        assert tuple(csv.DictReader(f).fieldnames) == coldstart.ROW_COLUMNS
    assert "first calls together" in (tmp_path / "cs.txt").read_text()


def test_a_child_stopped_at_its_time_limit_keeps_the_calls_it_finished(monkeypatch, tmp_path):
    def stopped_run(command, **kwargs):  # the child wrote one call's row, then ran out of time
        out_path = command[4]
        with open(out_path, "w") as f:
            json.dump(dict(import_s=1.0, cache_files_at_start=0, rows=[dict(index=0, first_ms=5.0)]), f)
        raise coldstart.subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(coldstart.subprocess, "run", stopped_run)
    result = coldstart.run_child(coldstart.CALLS[:3], "cpu", 0, str(tmp_path), timeout=7)
    assert result["rows"] == [dict(index=0, first_ms=5.0)] and "--timeout 7 s" in result["stopped"]
    monkeypatch.setattr(coldstart, "warmup_module_present", lambda: False)
    monkeypatch.setattr(coldstart, "run_child", lambda *a, **k: dict(result, rows=[]))
    results = bench_main(["--mode", "coldstart", "--device", "cpu", "--no-warmup", "--out", str(tmp_path / "cs")])
    assert any("time limit" in n and "after 0 of 40 calls" in n for n in results["meta"]["notes"])
