"""``--mode varlen`` on the CPU: its length mixes, its FLOP count, its checks before timing, its files and flags.

The quick run goes through Triton's interpreter on tiny mixes (the code path CI can test; the times say nothing
about a GPU); PyTorch's varlen_attn needs CUDA and is recorded as skipped here.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from flashlab.bench import varlen
from flashlab.bench.cli import main as bench_main

# --- the mixes and their FLOPs ------------------------------------------------------------------------------------


def test_the_gpu_mixes_are_the_ones_asked_for():
    plan = varlen.GPU_PLAN
    assert (plan.tokens, plan.heads, plan.head_dim, plan.dtype) == (32768, 16, 128, "bf16")
    uniform = varlen.mix_lengths("uniform", plan)
    assert sum(uniform) == 32768 and min(uniform) >= 512 and max(uniform) <= 4096
    tail = varlen.mix_lengths("long-tail", plan)
    assert sum(tail) == 32768 and tail.count(16384) == 1
    assert all(128 <= n <= 1024 for n in tail if n != 16384) and len(tail) > 20  # many short, one long
    docs = varlen.mix_lengths("documents", plan)
    assert sum(docs) == 32768 and all(1 <= n <= 8192 for n in docs)
    ends, total = set(), 0
    for n in docs:
        total += n
        ends.add(total)
    assert 16384 in ends  # no document crosses the end of its 16K row
    assert varlen.mix_lengths("uniform", plan, seed=0) == uniform != varlen.mix_lengths("uniform", plan, seed=1)


@pytest.mark.parametrize("lo, hi, total", [(7, 19, 48), (3, 8, 19), (512, 4096, 32768), (5, 10, 5)])
def test_uniform_lengths_stay_in_range_and_sum_exactly(lo, hi, total):
    import random

    for seed in range(20):
        out = varlen.uniform_lengths(lo, hi, total, random.Random(seed))
        assert sum(out) == total and all(lo <= n <= hi for n in out)


def test_useful_flops_match_a_hand_count():
    # lengths 3 and 5, 2 heads, D 16: per head 4 n^2 D = 4*9*16 + 4*25*16 = 576 + 1600 = 2176; 2 heads: 4352
    assert varlen.useful_flops([3, 5], heads=2, head_dim=16, causal=False) == 4352
    assert varlen.useful_flops([3, 5], heads=2, head_dim=16, causal=True) == 2176  # the causal half
    # padded to the longest: 2 sequences x 2 heads x 4 * 25 * 16 = 6400
    assert varlen.padded_flops([3, 5], heads=2, head_dim=16, causal=False) == 6400
    assert varlen.useful_flops([0, 5], heads=1, head_dim=16, causal=False) == 1600  # an empty sequence: none


def test_dry_run_lists_every_mix_mask_and_direction(capsys):
    assert bench_main(["--mode", "varlen", "--dry-run", "--device", "cuda"]) is None
    out = capsys.readouterr().out
    for text in ("32768 tokens a batch, H = 16, D = 128, bf16", "flashlab_varlen, flashlab_padded, flashlab_loop, "
                 "torch_varlen_attn, sdpa_flash_padded", "uniform", "long-tail", "documents", "padding wastes",
                 "causal   train", "no mask  forward"):  # fmt: skip
        assert text in out, f"{text!r} not in the dry run:\n{out}"
    assert "29 sequences, 129-16384 tokens" in out  # the long-tail mix's one 16K sequence
    assert len(out.strip().splitlines()) == 1 + 3 * (1 + 4)


# --- checked before timed -----------------------------------------------------------------------------------------


def _tiny(lengths=(5, 11, 3)):
    plan = varlen.VarlenPlan(tokens=sum(lengths), heads=2, head_dim=16, dtype="fp32", rounds=1, check_rows=4)
    lays = varlen.layouts(*varlen._inputs(list(lengths), plan, "cpu", 0), list(lengths))
    meta = dict.fromkeys(varlen.STAMP_COLUMNS)
    return plan, list(lengths), lays, meta


def test_a_variant_off_by_more_than_the_tolerance_is_wrong_and_not_timed(monkeypatch):
    plan, lengths, lays, meta = _tiny()

    def runs(lengths, device):  # SDPA on the padded batch: right, a little wrong, and right but wrong gradients
        def sdpa(q, k, v, c):
            return F.scaled_dot_product_attention(q, k, v, is_causal=c)

        def bad_grad(q, k, v, c):
            o = sdpa(q, k, v, c)
            return o + (0.01 * o - (0.01 * o).detach())  # the same values, gradients 1 % too large

        return {"flashlab_varlen": ("padded", sdpa), "sdpa_flash_padded": ("padded", lambda *a: sdpa(*a) * 1.001),
                "flashlab_padded": ("padded", bad_grad), "torch_varlen_attn": "absent: not here"}  # fmt: skip

    monkeypatch.setattr(varlen, "variant_runs", runs)
    names = ("flashlab_varlen", "sdpa_flash_padded", "flashlab_padded", "torch_varlen_attn")
    for direction in ("forward", "train"):
        refs = varlen.References(lays, lengths, True, plan.check_rows)
        rows = {r["variant"]: r for r in varlen.run_group("m", lengths, True, direction, names, lays, refs, plan,
                                                             "cpu", meta)}  # fmt: skip
        right = rows["flashlab_varlen"]
        assert right["status"] == "ok" and right["exact"] and right["time_ms"] > 0 and right["varlen_speedup"] == 1
        assert rows["sdpa_flash_padded"]["status"] == "wrong" and rows["sdpa_flash_padded"]["time_ms"] is None
        assert rows["torch_varlen_attn"]["status"] == "absent"
        grad = rows["flashlab_padded"]
        if direction == "train":  # 1 % off in every gradient: far past fp32's 5e-5
            assert right["grad_err"] <= right["grad_tol"]
            assert grad["status"] == "wrong" and "gradients" in grad["reason"] and grad["grad_err"] > 1e-3
        else:
            assert grad["status"] == "ok"


def test_padding_is_exact_under_the_causal_mask_only():
    plan, lengths, lays, meta = _tiny()
    for causal in (True, False):
        refs = varlen.References(lays, lengths, causal, plan.check_rows)
        rows = {r["variant"]: r for r in varlen.run_group("m", lengths, causal, "train", ["sdpa_flash_padded"],
                                                             lays, refs, plan, "cpu", meta)}  # fmt: skip
        r = rows["sdpa_flash_padded"]
        assert r["status"] == "ok" and r["rel_err"] <= r["tol"] and r["grad_err"] <= r["grad_tol"]
        assert r["exact"] is causal  # without the mask the real rows also see the padded keys
        assert (r["seq_err"] <= r["tol"]) is causal
        assert r["layout_tokens"] == 3 * 11 and r["layout_flops"] == 3.5 * varlen.padded_flops(lengths, 2, 16, causal)
        assert r["useful_flops"] == 3.5 * varlen.useful_flops(lengths, 2, 16, causal)


# --- the whole command --------------------------------------------------------------------------------------------


def test_quick_cpu_run_writes_json_csv_and_txt(tmp_path, capsys):
    prefix = tmp_path / "run"
    argv = ["--mode", "varlen", "--device", "cpu", "--quick", "--mixes", "documents", "--causal", "yes",
            "--direction", "forward", "--no-progress", "--out", str(prefix)]  # fmt: skip
    results = bench_main(argv)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["meta"]["mode"] == "varlen" and data["meta"]["tool"] == "flashlab.bench"
    assert data["meta"]["command"].startswith("python -m flashlab.bench --mode varlen")
    assert "torch" in data["meta"] and "date" in data["meta"] and "device_name" in data["meta"]
    lengths = data["meta"]["lengths"]["documents"]
    assert sum(lengths) == varlen.CPU_PLAN.tokens
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == list(varlen.VARIANTS)
    for name in ("flashlab_varlen", "flashlab_padded", "flashlab_loop", "sdpa_flash_padded"):
        r = rows[name]
        assert r["status"] == "ok" and r["exact"] is True, r  # causal: the padded runs are exact too
        assert r["rel_err"] <= r["tol"] and r["time_ms"] > 0
        assert r["tflops"] == pytest.approx(r["useful_flops"] / (r["time_ms"] * 1e-3) / 1e12)
        assert r["useful_flops"] == varlen.useful_flops(lengths, 2, 16, True)
    assert rows["torch_varlen_attn"]["status"] in ("skipped", "absent")  # CUDA only
    assert rows["flashlab_varlen"]["varlen_speedup"] == 1.0
    assert rows["flashlab_loop"]["varlen_speedup"] == pytest.approx(
        rows["flashlab_loop"]["time_ms"] / rows["flashlab_varlen"]["time_ms"]
    )
    with (tmp_path / "run.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == varlen.ROW_COLUMNS and len(list(reader)) == len(rows)
    txt = (tmp_path / "run.txt").read_text()
    out = capsys.readouterr().out
    assert "documents, causal, forward" in txt and txt in out + "\n" and "[1/1] documents causal forward" in out
    assert results["rows"][0]["variant"] == "flashlab_varlen"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mixes", "uniform,spiral"], "spiral"),
        (["--variants", "flashlab_varlen,naive"], "naive"),
        (["--head-dim", "20"], "multiple of 8"),
        (["--direction", "sideways"], "sideways"),
        (["--quick", "--tokens", "20"], "long-tail"),  # too few tokens for the 29-token long sequence
        (["--quick", "--tokens", "50"], "documents"),  # rows of 24 tokens do not divide 50
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_flags_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "varlen", "--device", "cpu", "--dry-run", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_existing_out_is_refused(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "varlen", "--device", "cpu", "--quick", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err


def test_torch_varlen_attn_is_found_and_takes_this_torchs_mask_argument():
    import importlib.util

    call = varlen.torch_varlen_attn()
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        assert call is None
        return
    assert callable(call)
    q = torch.randn(6, 1, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises((NotImplementedError, RuntimeError)):  # CUDA only: the CPU refuses it, not the arguments
        call(q, q, q, cu, 6, True)


# --- the bar's batches: log-normal lengths, grouped-query heads, several sizes in one run -------------------------


@pytest.mark.parametrize("count, sigma, total", [(32, 1.0, 16384), (32, 1.0, 65536), (5, 2.0, 48), (7, 0.0, 7)])
def test_lognormal_lengths_sum_exactly_and_spread(count, sigma, total):
    lengths = varlen.lognormal_lengths(count, sigma, total, random.Random(3))
    assert len(lengths) == count and sum(lengths) == total and min(lengths) >= 1
    if sigma == 0.0:  # every draw the same: lengths within one token of each other
        assert max(lengths) - min(lengths) <= 1
    if (count, total) == (32, 16384):  # sigma 1: a long tail, the longest many times the median
        assert max(lengths) > 3 * sorted(lengths)[count // 2]
    assert varlen.lognormal_lengths(count, sigma, total, random.Random(3)) == lengths


def test_grouped_query_heads_are_checked_and_timed_in_every_variant(tmp_path):
    prefix = tmp_path / "gqa"
    argv = ["--mode", "varlen", "--device", "cpu", "--quick", "--mixes", "log-normal", "--kv-heads", "1",
            "--causal", "yes", "--direction", "train", "--no-progress", "--out", str(prefix)]  # fmt: skip
    results = bench_main(argv)
    rows = {r["variant"]: r for r in results["rows"]}
    for name in ("flashlab_varlen", "flashlab_padded", "flashlab_loop", "sdpa_flash_padded"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["kv_heads"] == 1 and r["heads"] == 2  # two query heads read one K/V head
        assert r["grad_err"] <= r["grad_tol"] and r["rel_err"] <= r["tol"]
    assert sum(results["meta"]["lengths"]["log-normal"]) == varlen.CPU_PLAN.tokens


def _bar_row(variant, ms, mix="log-normal", direction="forward", causal=False, tokens=16384, head_dim=128):
    return dict(variant=variant, time_ms=ms, status="ok", mix=mix, direction=direction, causal=causal,
                tokens=tokens, head_dim=head_dim)  # fmt: skip


def test_the_bar_lines_read_the_long_tailed_cells_only():
    rows = [_bar_row("flashlab_varlen", 1.0), _bar_row("torch_varlen_attn", 1.2), _bar_row("flashlab_padded", 2.0),
            _bar_row("flashlab_varlen", 1.0, causal=True), _bar_row("torch_varlen_attn", 0.95, causal=True),
            _bar_row("flashlab_padded", 1.4, causal=True), _bar_row("flashlab_varlen", 1.0, mix="uniform"),
            _bar_row("torch_varlen_attn", 0.1, mix="uniform")]  # fmt: skip
    lines = "\n".join(varlen.bar_lines(rows))
    assert "forward: geo-mean 1.07x over 2 cells (min 0.95x)" in lines and "0.9: PASS" in lines  # uniform left out
    assert "min 1.4x over 2 cells" in lines and "every cell: FAIL" in lines  # 1.4 < 1.5
    assert "forward + backward" not in lines  # no train cells given
    rows.append(_bar_row("torch_varlen_attn", 0.85, causal=True, direction="train"))
    rows.append(_bar_row("flashlab_varlen", 1.0, causal=True, direction="train"))
    assert "forward + backward: geo-mean 0.85x over 1 cells (min 0.85x); bar >= 1.0, no cell below 0.9: FAIL" in (
        "\n".join(varlen.bar_lines(rows))
    )


def test_the_mixed_batch_bar_line_shows_a_ratio_just_under_the_bar_as_under_it():
    row = dict(_bar_row("separate_calls", 5.4, mix="mixed-batch"), varlen_speedup=5.4 / 4.508)  # 1.1979
    lines = varlen.bar_lines([row])
    assert lines == ["mixed batch, D = 128: separate prefill and decode calls / one launch 1.198x; bar >= 1.2: FAIL"]
    row["varlen_speedup"] = 1.2
    assert varlen.bar_lines([row])[0].endswith("one launch 1.200x; bar >= 1.2: PASS")


def test_several_batch_sizes_and_head_dims_are_listed_in_turn(capsys):
    argv = ["--mode", "varlen", "--device", "cuda", "--dry-run", "--mixes", "log-normal", "--tokens", "16384,65536",
            "--head-dim", "64,128", "--kv-heads", "4"]  # fmt: skip
    assert bench_main(argv) is None
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if "tokens a batch" in line]
    assert [line.split(";")[0] for line in heads] == [
        f"{t} tokens a batch, H = 16 (4 K/V heads), D = {d}, bf16" for t in (16384, 65536) for d in (64, 128)
    ]
    assert out.count("log-normal 32 sequences") == 4


def test_kv_heads_must_divide_the_query_heads(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--mode", "varlen", "--device", "cpu", "--dry-run", "--heads", "6", "--kv-heads", "4"])
    assert e.value.code == 2 and "must divide --heads" in capsys.readouterr().err


# --- a serving step: prefill chunks and decode rows over one paged cache ----------------------------------------


def test_a_mixed_batch_runs_in_one_launch_and_as_separate_calls(tmp_path):
    argv = ["--mode", "varlen", "--device", "cpu", "--quick", "--mixed-batch", "--kv-heads", "1", "--no-progress",
            "--out", str(tmp_path / "mixed")]  # fmt: skip
    results = bench_main(argv)
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == list(varlen.MIXED_VARIANTS)
    mixed = results["meta"]["mixed_batch"]
    batch = varlen.CPU_MIXED
    assert len(mixed["rows"]) == batch.prefills + batch.decodes and mixed["rows"][batch.prefills :] == [1] * 3
    assert all(n <= k for n, k in zip(mixed["rows"], mixed["lengths"], strict=True))  # a chunk is in its cache
    # causal, aligned to each sequence's end: query j of a chunk of n sees k - n + j + 1 of its k keys
    pairs = zip(mixed["rows"], mixed["lengths"], strict=True)
    flops = sum(2 * 4 * 16 * sum(k - n + j + 1 for j in range(n)) for n, k in pairs)  # 2 heads, D = 16
    for r in rows.values():
        assert r["status"] == "ok" and r["exact"] and r["rel_err"] <= r["tol"] and r["time_ms"] > 0, r
        assert r["useful_flops"] == flops and r["kv_heads"] == 1
    assert rows["separate_calls"]["varlen_speedup"] == pytest.approx(
        rows["separate_calls"]["time_ms"] / rows["one_launch"]["time_ms"]
    )
    assert "separate prefill and decode calls / one launch" in (tmp_path / "mixed.txt").read_text()


def test_a_wrong_mixed_launch_is_caught_before_timing(monkeypatch, tmp_path):
    import flashlab.host

    right = flashlab.host.flash_attention_with_kvcache

    def one_launch_off(q, *args, cu_seqlens_q=None, **kwargs):  # the packed call 1 % off, the separate ones right
        o = right(q, *args, cu_seqlens_q=cu_seqlens_q, **kwargs)
        return o * 1.01 if cu_seqlens_q is not None else o

    monkeypatch.setattr(flashlab.host, "flash_attention_with_kvcache", one_launch_off)
    plan = replace(varlen.CPU_PLAN, kv_heads=1)
    rows = {r["variant"]: r for r in varlen.run_mixed_batch(plan, varlen.CPU_MIXED, "cpu",
                                                                dict.fromkeys(varlen.STAMP_COLUMNS))}  # fmt: skip
    assert rows["one_launch"]["status"] == "wrong" and rows["one_launch"]["time_ms"] is None
    assert rows["separate_calls"]["status"] == "ok" and rows["separate_calls"]["exact"]
