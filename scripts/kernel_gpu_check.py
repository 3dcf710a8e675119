"""Check the flashlab Triton kernel on a CUDA GPU, then time it against PyTorch's SDPA backends.

    python scripts/kernel_gpu_check.py [--out DIR] [--quick]

1. Correctness: flashlab vs a float64 materialised reference on fresh random inputs (bf16, several shapes).
2. Timing: the issue's grid -- bf16, D in {64, 128} x N in {1K, 2K, 4K, 8K, 16K} x causal / non-causal, batch * N =
   16K tokens, heads = 2048 / D -- for flashlab and SDPA's FLASH_ATTENTION, CUDNN_ATTENTION and EFFICIENT_ATTENTION
   backends, each pinned with ``torch.nn.attention.sdpa_kernel``; medians of ``triton.testing.do_bench``.
   Forward FLOPs = 4 B H N^2 D, halved for causal. Prints a ratio table and writes ``kernel_gpu_check.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashlab.kernels.forward import _attn_fwd_tuned, _launch, flash_attention  # noqa: E402

BACKENDS = {
    "fa2": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def reference(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, N, N)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def check_correctness():
    rows = []
    for b, h, n, d, causal in [(2, 16, 1024, 128, True), (1, 32, 2048, 64, False), (2, 8, 1537, 128, False)]:
        g = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        o = flash_attention(q, k, v, causal=causal)
        ref = reference(q, k, v, causal)
        err = ((o.double() - ref).norm() / ref.norm()).item()
        rows.append(dict(b=b, h=h, n=n, d=d, causal=causal, rel_err=err))
        print(f"correctness b={b} h={h} n={n} d={d} causal={causal}: rel err {err:.2e}")
        assert err < 1.5e-2 and torch.isfinite(o).all(), "flashlab disagrees with the reference"
    return rows


def time_cell(d, n, causal, backends):
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    out = dict(d=d, n=n, causal=causal, b=b, h=h, flops=flops)
    ref = None
    for name in ["flashlab"] + backends:
        if name == "flashlab":

            def fn():
                return flash_attention(q, k, v, causal=causal)
        else:

            def fn(name=name):
                with sdpa_kernel(BACKENDS[name]):
                    return sdpa(q, k, v, is_causal=causal)

        try:
            o = fn()
        except RuntimeError as e:  # backend not available for this shape / build
            out[name] = None
            print(f"  {name}: unavailable ({str(e).splitlines()[0][:80]})")
            continue
        if ref is None:
            ref = o.float()
        else:
            err = ((o.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{name} disagrees with flashlab by {err:.2e}"
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        out[name] = ms
        if name == "flashlab":
            out["config"] = str(_attn_fwd_tuned.best_config)
    return out


VARIANT_CONFIGS = {
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
}
VARIANT_CELLS = [(64, 1024, True), (128, 1024, True), (64, 1024, False), (128, 1024, False),
                 (64, 16384, True), (128, 16384, True), (64, 16384, False), (128, 16384, False)]  # fmt: skip


def time_variants():
    """Fixed configs (no autotuner), with and without TMA loads, on short and long sequences."""
    rows = []
    for d, n, causal in VARIANT_CELLS:
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        line = []
        for bm, bn, w, st in VARIANT_CONFIGS[d]:
            for tma in (True, False):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                try:
                    ms = triton.testing.do_bench(
                        functools.partial(_launch, q, k, v, causal, None, None, config=cfg, use_tma=tma),
                        warmup=25,
                        rep=60,
                        return_mode="median",
                    )
                except Exception as e:  # out of resources
                    print(f"  {cfg} failed: {type(e).__name__}")
                    continue
                tf = flops / (ms * 1e-3) / 1e12
                rows.append(dict(d=d, n=n, causal=causal, bm=bm, bn=bn, warps=w, stages=st, tma=tma, tflops=tf))
                line.append((tf, f"{bm}/{bn}/w{w}/s{st}{'/tma' if tma else ''}"))
        line.sort(reverse=True)
        print(
            f"variants d={d} n={n} causal={causal}: " + "  ".join(f"{name} {tf:.0f}" for tf, name in line), flush=True
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for kernel_gpu_check.json")
    ap.add_argument("--quick", action="store_true", help="only N in {1K, 8K}")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness pass")
    ap.add_argument("--variants", action="store_true", help="also time fixed configs / tile orders (tuning aid)")
    args = ap.parse_args()
    t0 = time.time()
    info = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(info)
    result = dict(info=info, correctness=[] if args.skip_check else check_correctness(), cells=[])
    ns = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384]
    backends = list(BACKENDS)
    for d in (64, 128):
        for causal in (False, True):
            for n in ns:
                cell = time_cell(d, n, causal, backends)
                result["cells"].append(cell)
                tf = {k: cell["flops"] / (cell[k] * 1e-3) / 1e12 for k in ["flashlab"] + backends if cell.get(k)}
                print(
                    f"d={d:3d} n={n:5d} causal={causal!s:5}  "
                    + "  ".join(f"{k} {v:6.1f}" for k, v in tf.items())
                    + f"  TFLOP/s  [{cell.get('config')}]  ({time.time() - t0:.0f}s)",
                    flush=True,
                )
    if args.variants:
        result["variants"] = time_variants()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernel_gpu_check.json").write_text(json.dumps(result, indent=1))

    print("\nflashlab speed-up (time ratio) over each backend; bf16 forward")
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'TFLOP/s':>8} " + " ".join(f"{'vs ' + b:>13}" for b in backends))
    logs = {b: [] for b in backends}
    for c in result["cells"]:
        tf = c["flops"] / (c["flashlab"] * 1e-3) / 1e12
        ratios = []
        for b in backends:
            r = c[b] / c["flashlab"] if c.get(b) else float("nan")
            if c.get(b):
                logs[b].append(math.log(r))
            ratios.append(r)
        print(f"{c['d']:>4} {c['n']:>6} {c['causal']!s:>6} {tf:8.1f} " + " ".join(f"{r:13.3f}" for r in ratios))
    for b in backends:
        if logs[b]:
            geo, worst = math.exp(sum(logs[b]) / len(logs[b])), math.exp(min(logs[b]))
            print(f"geo-mean speed-up vs {b}: {geo:.3f}  (min {worst:.3f})")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
