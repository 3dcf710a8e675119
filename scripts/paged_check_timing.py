"""Paged decode with the default values check against contiguous decode, on a GPU: is the check free?

    python scripts/paged_check_timing.py [--n 32768] [--batch 8] [--steps 200]

B sequences of N keys, 32 query / 8 KV heads, D = 128, bf16, one query token per step. ``contiguous`` is
``flash_attention`` on ``(B, Hk, N, D)`` K/V; ``paged16`` and ``paged256`` are ``flash_attention_with_kvcache`` on
the same keys in a shuffled pool of 16- or 256-token blocks (``paged_kv_cache``), with ``check_values`` True (the
default: checked on the device), "sync" (read on the host) and False. Every path is first checked against the
float64 reference on the first and last sequence; then a loop of ``--steps`` eager calls, as a decode loop makes
them, is timed from its first launch to the GPU's end (the fastest of 5 loops): a host synchronisation inside a
call shows there, where a per-kernel timer would hide it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, without installing flashlab

import torch  # noqa: E402

import flashlab  # noqa: E402
from flashlab import flash_attention, flash_attention_with_kvcache  # noqa: E402
from flashlab.kernels.decode.kvcache import paged_kv_cache  # noqa: E402
from flashlab.reference.torch_float64 import attention_float64  # noqa: E402


def loop_us(step, queries) -> float:
    """Microseconds per call of ``step(q)`` over ``queries``, the fastest of 5 loops, GPU work included."""
    for q in queries[:5]:
        step(q)  # plan, autotune, the direct launch checked
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for q in queries:
            step(q)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / len(queries) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    b, hq, hk, n, d = args.batch, 32, 8, args.n, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(b, hk, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    queries = torch.randn(args.steps, b, hq, 1, d, device="cuda", generator=g, dtype=torch.bfloat16)
    steps = {"contiguous": lambda q: flash_attention(q, k, v)}
    for bs in (16, 256):
        kc, vc, table, seqlens = paged_kv_cache(k, v, bs)
        for check in (True, "sync", False):
            steps[f"paged{bs} check_values={check!r}"] = lambda q, kc=kc, vc=vc, t=table, s=seqlens, c=check: (
                flash_attention_with_kvcache(q, kc, vc, s, t, check_values=c)
            )
    q = queries[0]
    for name, step in steps.items():  # checked before timed: the first and last sequence against float64
        o = step(q)
        for i in (0, b - 1):
            ref, _ = attention_float64(q[i : i + 1], k[i : i + 1], v[i : i + 1])
            err = float((o[i : i + 1].double() - ref).abs().max())
            assert err < 2e-2, f"{name}: sequence {i} is off by {err:.3g}"
    flashlab.check_kvcache_errors()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={b}, N={n}, Hq={hq}, Hk={hk}, D={d}, bf16")
    base = loop_us(steps["contiguous"], queries)
    for name, step in steps.items():
        us = base if name == "contiguous" else loop_us(step, queries)
        print(f"{name:32s} {us:8.1f} us/step   {base / us:5.2f}x contiguous")


if __name__ == "__main__":
    main()
