"""Decode over a growing contiguous cache (H200, B = 1, 32 query / 8 KV heads, D = 128, bf16): the host time of a
step with a new length against a step of a repeated length, split into planning (signature, family, call) and the
rest, then where a growing step's host time goes (cProfile), to tell which part of the step to cut."""

import cProfile
import pstats
import sys
import time

import torch

from flashlab import flash_attention
from flashlab.host import attention as forward

n0 = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
steps = 3000
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k_buf = torch.randn(1, 8, n0 + 4 * steps + 64, 128, device="cuda", dtype=torch.bfloat16)
v_buf = torch.randn_like(k_buf)


def cache(n):
    return k_buf[:, :, :n], v_buf[:, :, :n]


for n in range(n0 - 64, n0):
    flash_attention(q, *cache(n))
torch.cuda.synchronize()


def loop(lengths):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in lengths:
        flash_attention(q, *cache(n))
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / len(lengths) * 1e6, (time.perf_counter() - t0) / len(lengths) * 1e6


start = n0
for label in ("growing", "fixed", "growing", "fixed", "views only"):
    if label == "views only":
        t0 = time.perf_counter()
        for n in range(start, start + steps):
            cache(n)
        print(f"{label:10s} {(time.perf_counter() - t0) / steps * 1e6:6.1f} us/step", flush=True)
        continue
    lengths = range(start, start + steps) if label == "growing" else [start] * steps
    queued, finished = loop(lengths)
    start += steps if label == "growing" else 0
    print(f"{label:10s} queued {queued:6.1f} us/step, finished {finished:6.1f} us/step", flush=True)
# planning alone: the signature, the family's call (nothing launched)
t0 = time.perf_counter()
for n in range(start, start + steps):
    k, v = cache(n)
    key = forward.signature(q, k, v, False, None, None, None, None)
    forward.new_call(key, q, k, v, False, None, None, None, None)
print(f"planning   {(time.perf_counter() - t0) / steps * 1e6:6.1f} us/step (views, signature, family call)", flush=True)
t0 = time.perf_counter()
for _ in range(steps):
    k, v = cache(start)
    key = forward.signature(q, k, v, False, None, None, None, None)
    forward.CALLS.get(key)
print(f"lookup     {(time.perf_counter() - t0) / steps * 1e6:6.1f} us/step (views, signature, kept call)", flush=True)
start += steps
prof = cProfile.Profile()
lengths = range(start, start + steps)
torch.cuda.synchronize()
prof.enable()
for n in lengths:
    flash_attention(q, *cache(n))
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
