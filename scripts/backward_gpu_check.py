"""Check flashlab's backward kernels on a CUDA GPU, then time them against SDPA's backward, in one process.

    python scripts/backward_gpu_check.py [--check] [--quick] [--sweep]   (JSON under $OUT, rewritten after each cell)

1. Correctness (--check): gradients dq, dk, dv of ``flash_attention`` against float64 ``torch.autograd`` of the
   materialised attention (``attention_float64_grads``, on a subset of K/V heads) at a few sizes: GQA, causal,
   windows, odd lengths and head dims, bf16 / fp16 / fp32; and determinism (two backward runs, bit-identical gradients).
2. Timing: bf16, D in {64, 128} x N in {1K .. 16K} x causal / non-causal, batch * N = 16K tokens, heads = 2048 / D.
   The backward from dO (``torch.autograd.grad(o, (q, k, v), do)``) for flashlab and SDPA's FLASH_ATTENTION and
   CUDNN_ATTENTION backends (pinned); medians of ``triton.testing.do_bench``. FLOPs = 2.5 x the forward's
   (4 B H N^2 D, halved for causal). Every cell's gradients are checked (one K/V head) before it is timed.
3. Sweep (--sweep): fixed tile configs of each backward kernel at a few cells, to tune the search space.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashlab.core.numerics import grad_tolerance, relative_error  # noqa: E402
from flashlab.host.attention import flash_attention  # noqa: E402
from flashlab.kernels.backward import rung1_two_pass as backward  # noqa: E402
from flashlab.reference.torch_float64 import attention_float64_grads, query_heads  # noqa: E402

BACKENDS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def make_inputs(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hk, nk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hk, nk, d, device="cuda", generator=g).to(dtype)
    do = torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype)
    return q, k, v, do


def flash_grads(q, k, v, do, causal=False, window=None, scale=None):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, causal=causal, window=window, scale=scale)
    return torch.autograd.grad(o, (q, k, v), do)


def grad_errors(q, k, v, do, grads, causal=False, window=None, scale=None, kv_heads=(0,), ref=None):
    """Relative errors of (dq, dk, dv) against float64 autograd on batch entry 0 and the given K/V heads (``ref``:
    that reference, if already computed)."""
    group = q.shape[1] // k.shape[1]
    if ref is None:
        ref = attention_float64_grads(q, k, v, do, causal, window, scale, batch=[0], kv_heads=list(kv_heads))
    heads = query_heads(list(kv_heads), group)
    got = (grads[0][[0]][:, heads], grads[1][[0]][:, list(kv_heads)], grads[2][[0]][:, list(kv_heads)])
    for x in got:
        assert torch.isfinite(x).all(), "non-finite gradient"
    return [relative_error(a, r) for a, r in zip(got, ref, strict=True)]


DETERMINISM_SHAPE = (2, 16, 4, 2048, 2048, 128)  # b, hq, hk, nq, nk, d
CASES = [  # b, hq, hk, nq, nk, d, dtype, causal, window, scale
    (2, 8, 2, 1024, 1024, 128, torch.bfloat16, True, None, None),
    (1, 8, 8, 2048, 2048, 128, torch.bfloat16, False, None, None),
    (1, 4, 1, 4096, 4096, 128, torch.float16, True, (512, 0), None),
    (1, 4, 2, 1000, 1537, 64, torch.bfloat16, False, (300, 200), None),
    (2, 6, 3, 777, 513, 80, torch.float16, True, None, -0.2),
    (1, 2, 1, 1023, 1023, 128, torch.float32, True, None, None),
    (1, 2, 2, 300, 300, 256, torch.bfloat16, False, None, None),
    (1, 4, 2, 9, 2000, 64, torch.bfloat16, False, None, None),  # a decode-sized call with a gradient
]


def check_correctness():
    rows = []
    for b, hq, hk, nq, nk, d, dtype, causal, window, scale in CASES:
        q, k, v, do = make_inputs(b, hq, hk, nq, nk, d, dtype, seed=nq + nk + d)
        grads = flash_grads(q, k, v, do, causal, window, scale)
        errs = grad_errors(q, k, v, do, grads, causal, window, scale, kv_heads=range(hk))
        tol = grad_tolerance(dtype)
        ok = all(e <= tol for e in errs)
        name = str(dtype).removeprefix("torch.")
        print(
            f"check b={b} hq={hq} hk={hk} nq={nq} nk={nk} d={d} {name} causal={causal} window={window} "
            f"scale={scale}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} (tol {tol:.0e}) "
            + ("ok" if ok else "FAIL")
        )
        rows.append(
            dict(
                b=b,
                hq=hq,
                hk=hk,
                nq=nq,
                nk=nk,
                d=d,
                dtype=name,
                causal=causal,
                window=window,
                scale=scale,
                errors=errs,
                tolerance=tol,
                ok=ok,
            )
        )
    # determinism: the same inputs twice, bit-identical gradients
    q, k, v, do = make_inputs(*DETERMINISM_SHAPE, torch.bfloat16, seed=1)
    first = flash_grads(q, k, v, do, causal=True)
    same = all(
        all(torch.equal(a, b) for a, b in zip(first, flash_grads(q, k, v, do, causal=True), strict=True))
        for _ in range(3)
    )
    print(f"determinism {DETERMINISM_SHAPE} causal, 3 reruns: {'bit-identical' if same else 'DIFFERENT'}")
    rows.append(dict(determinism=same))
    return rows


def bwd_flops(b, h, n, d, causal):
    return 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)


def backward_timer(impl, q, k, v, do, causal):
    """A function running the backward from dO of one forward (graph kept), for do_bench."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if impl.startswith("flashlab"):
        o = flash_attention(q, k, v, causal=causal)
    else:
        with sdpa_kernel(BACKENDS[impl]):
            o = sdpa(q, k, v, is_causal=causal)

    def run():
        if impl == "flashlab_serial":  # the dQ kernel after the dK/dV kernel on one stream, not beside it
            backward.CONCURRENT_DQ = False
            try:
                return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            finally:
                backward.CONCURRENT_DQ = True
        if impl == "flashlab":
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        with sdpa_kernel(BACKENDS[impl]):
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    return run


TOKENS, MODEL_WIDTH = 16384, 2048  # batch * N tokens; heads * D
HEAD_DIMS, LENGTHS = (128, 64), (1024, 2048, 4096, 8192, 16384)  # D = 128 first: where the work is


def time_grid(quick, save=lambda rows: None):
    ns = LENGTHS[::2][:2] if quick else LENGTHS
    rows = []
    for d in HEAD_DIMS:
        for causal in (False, True):
            for n in ns:
                b, h = TOKENS // n, MODEL_WIDTH // d
                q, k, v, do = make_inputs(b, h, h, n, n, d, torch.bfloat16, seed=n + d + causal)
                row = dict(d=d, n=n, b=b, h=h, causal=causal)
                ref = attention_float64_grads(q, k, v, do, causal, batch=[0], kv_heads=[0])
                for impl in ("flashlab", "flashlab_serial", "fa2", "cudnn"):
                    try:
                        run = backward_timer(impl, q, k, v, do, causal)
                        grads = run()
                        errs = grad_errors(q, k, v, do, grads, causal, ref=ref)
                        if max(errs) > grad_tolerance(torch.bfloat16):
                            raise AssertionError(f"gradient error {max(errs):.2e}")
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                        row[impl] = bwd_flops(b, h, n, d, causal) / (ms * 1e-3) / 1e12
                        row[f"{impl}_ms"] = ms
                        row[f"{impl}_err"] = max(errs)
                        del run, grads
                    except Exception as e:  # noqa: BLE001 - a backend that cannot run this cell is recorded
                        row[impl] = None
                        row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if row.get("flashlab"):
                    row["configs"] = backward.best_configs()
                rows.append(row)
                fa, fl, cu, one = row.get("fa2"), row.get("flashlab"), row.get("cudnn"), row.get("flashlab_serial")
                print(
                    f"D={d:3d} N={n:5d} causal={causal!s:5}  flashlab {fmt(fl)} (one stream {fmt(one)})"
                    f"  fa2 {fmt(fa)}  cudnn {fmt(cu)}  "
                    f"x fa2 {ratio(fl, fa)}  x cudnn {ratio(fl, cu)}  {row.get('configs', row.get('flashlab_error'))}",
                    flush=True,
                )
                save(rows)
                del q, k, v, do, ref
                torch.cuda.empty_cache()
    summary = {}
    serial = [x["flashlab"] / x["flashlab_serial"] for x in rows if x.get("flashlab") and x.get("flashlab_serial")]
    if serial:
        summary["two_streams_over_one"] = math.exp(sum(map(math.log, serial)) / len(serial))
        print(f"flashlab with dQ on a second stream / on one stream: geo-mean {summary['two_streams_over_one']:.3f}")
    for other in ("fa2", "cudnn"):
        r = [x["flashlab"] / x[other] for x in rows if x.get("flashlab") and x.get(other)]
        if r:
            summary[other] = dict(geomean=math.exp(sum(map(math.log, r)) / len(r)), min=min(r), max=max(r), n=len(r))
            print(f"flashlab / {other}: geo-mean {summary[other]['geomean']:.3f}, min {min(r):.3f}, max {max(r):.3f}")
    return rows, summary


def fmt(x):
    return f"{x:6.1f}" if x else "   n/a"


def ratio(a, b):
    return f"{a / b:5.2f}" if a and b else "  n/a"


SWEEP_CELLS = [(128, 2048, False), (128, 8192, False), (128, 8192, True), (64, 4096, False), (64, 4096, True)]


def sweep():
    """Each fixed config of one kernel (the other kernel at its first config), at a few cells: ms of the backward."""
    rows = []
    for d, n, causal in SWEEP_CELLS:
        rows += sweep_cell(d, n, causal)
        torch.cuda.empty_cache()
    return rows


def sweep_cell(d, n, causal):
    b, h = TOKENS // n, MODEL_WIDTH // d
    q, k, v, do = make_inputs(b, h, h, n, n, d, torch.bfloat16, seed=3)
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    cls = backward.tuning_class(d, torch.bfloat16)
    spaces = backward.TUNING_SPACE
    base = {key: spaces[key][cls][0] for key in ("dkdv", "dq")}
    rows = []
    for key in ("dkdv", "dq"):
        for cfg in spaces[key][cls]:
            pick = dict(base, **{key: cfg})
            config = {kk: dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3]) for kk, c in pick.items()}
            try:
                ms = triton.testing.do_bench(
                    lambda config=config: backward.attention_backward(
                        do, q, k, v, o, lse, causal, None, None, config=config
                    ),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                )
                tf = bwd_flops(b, h, n, d, causal) / (ms * 1e-3) / 1e12
                text = f"{ms:.3f} ms {tf:.1f} TFLOP/s"
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory / registers
                ms, tf = None, None
                text = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(dict(d=d, n=n, causal=causal, kernel=key, config=cfg, other=pick, ms=ms, tflops=tf, note=text))
            print(f"sweep D={d} N={n} causal={causal} {key} {cfg}: {text}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="first check gradients at 8 awkward sizes (compiles more)")
    parser.add_argument("--quick", action="store_true", help="N in {1K, 4K} only")
    parser.add_argument("--sweep", action="store_true", help="after the grid, time fixed tile configs at a few cells")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        tuning_space=backward.TUNING_SPACE,
    )
    out = os.environ.get("OUT")
    path = Path(out) / "backward_gpu_check.json" if out else None

    def save(**parts):
        result.update(parts)
        if path:
            path.write_text(json.dumps(result, indent=1, default=str))

    if args.check:
        save(correctness=check_correctness())
        print(f"[{time.time() - t0:.0f}s] correctness done", flush=True)
    grid, summary = time_grid(args.quick, save=lambda rows: save(grid=rows))
    save(grid=grid, summary=summary)
    print(f"[{time.time() - t0:.0f}s] grid done", flush=True)
    if args.sweep:
        save(sweep=sweep())
        print(f"[{time.time() - t0:.0f}s] sweep done", flush=True)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
