"""Decode on a GPU: host time per eager call, and KV-read bandwidth, flashlab (contiguous and paged) against SDPA.

    python scripts/decode_host_time.py            # the decode grid: B in {1, 8} x N in {1K, 4K, 32K, 128K}
    OUT=dir python scripts/decode_host_time.py    # also writes dir/decode_host_time.json

For every cell (64 query / 8 KV heads, D = 128, bf16, one query token per sequence) each backend is first checked
against the float64 reference (``attention_float64`` on the first and last sequence, on each sequence's own keys),
then timed two ways:

- host time: microseconds of Python and launch work per eager call, measured like SDPA's: a tiny cell (B = 1,
  N = 1K) called in loops of 200 calls, each with the GPU idle at the start, a loop's wall time before its
  synchronise divided by its calls, the fastest of 11 loops (the GPU runs each call faster than the host issues
  the next, so the loops are host-bound);
- bandwidth: KV bytes read / median time (``triton.testing.do_bench``), eager; and for flashlab also replayed from
  a CUDA graph, which shows the GPU work alone.

Backends: ``flashlab`` (contiguous K/V, ``flash_attention``); ``paged16`` and ``paged256`` (the same keys in a
shuffled pool of 16- or 256-token blocks with ragged lengths -- sequence b holds N - b * N / (4B) keys -- read
through ``flash_attention_with_kvcache`` with ``check_values=False``, as a decode loop calls it; its host time with
the checks on is printed too); ``sdpa_flash`` and ``sdpa_cudnn`` (SDPA pinned to FLASH_ATTENTION and
CUDNN_ATTENTION). Paged bandwidth counts the keys the ragged sequences actually hold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, without installing flashlab

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from flashlab import flash_attention, flash_attention_with_kvcache  # noqa: E402
from flashlab.bench import measure  # noqa: E402
from flashlab.core.numerics import tolerance  # noqa: E402
from flashlab.kernels.decode.kvcache import paged_kv_cache  # noqa: E402
from flashlab.reference.torch_float64 import attention_float64  # noqa: E402

HQ, HK, D = 64, 8, 128
DTYPE = torch.bfloat16
WARMUP_MS, REP_MS = 10, 40  # do_bench warm-up and measuring ms per timing, kept short (a grid in well under 2 minutes)


def sdpa(member):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel([getattr(SDPBackend, member)]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def host_us(fn, calls=200):
    """Host microseconds per call after a warm-up: the benchmark's measurement (``flashlab.bench.measure.host_us``)."""
    for _ in range(20):
        fn()
    return measure.host_us(fn, "cuda", calls=calls)


def graph_ms(fn):
    """Median ms of ``fn`` replayed from a CUDA graph (the GPU work alone)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def check(o, q, k, v, lengths, name):
    """Float64 reference on the first and last sequence, each on its own keys; raises if over tolerance."""
    for b in sorted({0, q.shape[0] - 1}):
        n = lengths[b]
        ref, _ = attention_float64(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        err = float((o[b : b + 1].double() - ref).norm() / ref.norm())
        if not err <= tolerance(DTYPE):
            raise AssertionError(f"{name}: relative error {err:.3g} on sequence {b}")


def backends(q, k, v, batch, n):
    full = [n] * batch
    ragged = [n - i * n // (4 * batch) for i in range(batch)]
    fa2, cudnn = sdpa("FLASH_ATTENTION"), sdpa("CUDNN_ATTENTION")
    out = {
        "flashlab": (lambda: flash_attention(q, k, v), full),
        "sdpa_flash": (lambda: fa2(q, k, v), full),
        "sdpa_cudnn": (lambda: cudnn(q, k, v), full),
    }
    for bs in (16, 256):
        kc, vc, table, seqlens = paged_kv_cache(k, v, bs, ragged, seed=bs)
        out[f"paged{bs}"] = (lambda kc=kc, vc=vc, t=table, s=seqlens: flash_attention_with_kvcache(
            q, kc, vc, s, t, check_values=False), ragged)  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="1024,4096,32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--budget-s", type=float, default=80.0, help="skip the cells left once this many seconds passed")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = "cuda"
    rows = []
    # -- host time, on the smallest cell
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, HQ, 1, D, device=dev, generator=g).to(DTYPE)
    k, v = (torch.randn(1, HK, 1024, D, device=dev, generator=g).to(DTYPE) for _ in range(2))
    start = time.perf_counter()
    host = {name: host_us(fn) for name, (fn, _) in backends(q, k, v, 1, 1024).items()}
    kc, vc, table, seqlens = paged_kv_cache(k, v, 16)
    host["paged16 check_values=True"] = host_us(lambda: flash_attention_with_kvcache(q, kc, vc, seqlens, table))
    print(
        "host us per eager call (B=1, N=1K decode): " + ", ".join(f"{x} {us:.1f}" for x, us in host.items()), flush=True
    )
    # -- bandwidth over the grid
    for n in (int(x) for x in args.seq_lens.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            if time.perf_counter() - start > args.budget_s:
                print(f"N={n} B={batch}: skipped, past the {args.budget_s:g} s budget", flush=True)
                continue
            q = torch.randn(batch, HQ, 1, D, device=dev, generator=g).to(DTYPE)
            k, v = (torch.randn(batch, HK, n, D, device=dev, generator=g).to(DTYPE) for _ in range(2))
            for name, (fn, lengths) in backends(q, k, v, batch, n).items():
                row = dict(backend=name, seq_len=n, batch=batch, status="ok")
                try:
                    check(fn(), q, k, v, lengths, name)
                    kv_bytes = 2 * sum(lengths) * HK * D * DTYPE.itemsize
                    ms = float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
                    row.update(time_ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12)
                    if name.startswith(("flashlab", "paged")):
                        gms = graph_ms(fn)
                        row.update(graph_ms=gms, graph_tbps=kv_bytes / (gms * 1e-3) / 1e12)
                except Exception as e:  # noqa: BLE001 -- one failing backend must not end the sweep
                    row.update(status=f"{type(e).__name__}: {e}"[:200])
                rows.append(row)
                del fn
                line = f"{row['tbps']:.2f} TB/s" if row["status"] == "ok" else row["status"]
                if "graph_tbps" in row:
                    line += f" (graph replay {row['graph_tbps']:.2f})"
                print(f"[{time.perf_counter() - start:5.1f} s] N={n} B={batch} {name}: {line}", flush=True)
            torch.cuda.empty_cache()
    if time.perf_counter() - start < args.budget_s:  # prefill's first call autotunes (compiles) its kernel
        prefill = [torch.randn(1, 16, 256, D, device=dev, generator=g).to(DTYPE) for _ in range(3)]
        host["flashlab prefill N=256"] = host_us(lambda: flash_attention(*prefill, causal=True))
        print(f"host us per eager call, prefill N=256 causal: {host['flashlab prefill N=256']:.1f}")
    # -- the table
    names = list(dict.fromkeys(r["backend"] for r in rows))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("host us per eager call (B=1, N=1K decode): " + ", ".join(f"{x} {us:.1f}" for x, us in host.items()))
    print("KV-read TB/s, eager (CUDA-graph replay in brackets); paged: shuffled blocks, ragged lengths")
    print(f"{'N':>7s} {'B':>2s} " + " ".join(f"{x:>15s}" for x in names) + "  fl/cuDNN  paged16/fl  paged256/fl")
    for n in dict.fromkeys(r["seq_len"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            cell = {r["backend"]: r for r in rows if r["seq_len"] == n and r["batch"] == batch}
            cols = []
            for x in names:
                r = cell.get(x, {})
                if r.get("status") != "ok":
                    cols.append(f"{'error':>15s}")
                elif "graph_tbps" in r:
                    cols.append(f"{r['tbps']:6.2f} ({r['graph_tbps']:5.2f})")
                else:
                    cols.append(f"{r['tbps']:15.2f}")

            def ratio(a, b, cell=cell):
                ra, rb = cell.get(a, {}), cell.get(b, {})
                return f"{ra['tbps'] / rb['tbps']:.2f}" if "tbps" in ra and "tbps" in rb else "-"

            tail = f"{ratio('flashlab', 'sdpa_cudnn'):>9s} {ratio('paged16', 'flashlab'):>11s}"
            print(f"{n:7d} {batch:2d} " + " ".join(cols) + f"  {tail} {ratio('paged256', 'flashlab'):>12s}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['backend']} N={r['seq_len']} B={r['batch']}: {r['status']}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "decode_host_time.json"
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    python=platform.python_version(), date=time.strftime("%Y-%m-%d"))  # fmt: skip
        path.write_text(json.dumps(dict(meta=meta, host_us=host, rows=rows), indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
