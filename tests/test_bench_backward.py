"""The benchmark's backward mode on the CPU at tiny sizes: gradients checked before timing, FLOPs, the CLI."""

from __future__ import annotations

import math

from flashlab.bench import BenchConfig, run_sweep
from flashlab.bench.cli import main
from flashlab.bench.implementations import Backend, naive_attention
from flashlab.calculators import roofline

TINY = dict(
    mode="backward", device="cpu", seq_lens=(37,), head_dims=(16,), dtypes=("fp32",), tokens=74, model_dim=32,
    warmup=0.0, rep=1.0, ceilings=False,
)  # fmt: skip


def test_backward_sweep_checks_then_times_every_gradient():
    # a backend whose dV is wrong (V enters detached: no gradient flows to it) must be caught, not timed
    broken = Backend("no_dv", "v detached", lambda q, k, v, causal: naive_attention(q, k, v.detach() + 0 * v, causal))
    cfg = BenchConfig(backends=("naive", "flashlab", "sdpa_math"), causal="yes", **TINY)
    results = run_sweep(cfg, extra_backends=[broken], progress=False)
    rows = {r["backend"]: r for r in results.rows}
    forward_flops = 2 * 2 * roofline.attention_flops(37, 16, causal=True)  # batch 74 // 37, heads 32 // 16
    for name in ("naive", "flashlab", "sdpa_math"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["rel_err"] <= r["tol"] and r["time_ms"] > 0
        assert r["flops"] == 2.5 * forward_flops
        assert math.isclose(r["tflops"], r["flops"] / (r["time_ms"] * 1e-3) / 1e12)
    assert rows["no_dv"]["status"] == "wrong" and "dv" in rows["no_dv"]["reason"]
    assert math.isnan(rows["no_dv"]["time_ms"])
    assert "--mode backward" in results.meta["command"]


def test_python_m_flashlab_bench_mode_backward(tmp_path, capsys):
    argv = ["--device", "cpu", "--quick", "--mode", "backward", "--seq-lens", "33", "--head-dims", "16"]
    argv += ["--tokens", "66", "--model-dim", "32"]  # B = 2, 2 heads (the quick defaults give 3 and 4)
    argv += ["--backends", "flashlab,sdpa_flash", "--causal", "no", "--no-progress", "--out", str(tmp_path / "bw")]
    results = main(argv)
    out = capsys.readouterr().out
    assert "backward (dq, dk, dv from dO) TFLOP/s" in out
    assert (tmp_path / "bw.json").exists() and (tmp_path / "bw.csv").exists()
    assert {r["status"] for r in results.rows} == {"ok"}
