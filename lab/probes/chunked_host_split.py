"""Chunked prefill with new lengths every call (H200): the time to queue 200 calls against the time to finish them,
and the host's share (the call planned, not launched), to tell a host-bound loop from a GPU-bound one."""

import time

import torch

from flashlab import flash_attention
from flashlab.bench.loops import chunk_lengths
from flashlab.host import attention as forward

nq, nk = (300, 1001, 7), (4000, 5301, 13)
q_buf = torch.randn(1, 16, 1000, 128, device="cuda", dtype=torch.bfloat16)
k_buf = torch.randn(1, 16, 5300, 128, device="cuda", dtype=torch.bfloat16)
v_buf = torch.randn_like(k_buf)


def inputs(g, fixed=False):
    a, b = (650, 4650) if fixed else chunk_lengths(g, nq, nk)
    return q_buf[:, :, :a], k_buf[:, :, :b], v_buf[:, :, :b]


for g in range(30):
    flash_attention(*inputs(g), causal=True)
    flash_attention(*inputs(g, True), causal=True)
torch.cuda.synchronize()
for label, fixed, offset in (("changing", False, 1000), ("repeated", True, 0), ("changing", False, 2000),
                             ("repeated", True, 0)):  # fmt: skip
    xs = [inputs(g, fixed) for g in range(offset, offset + 200)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in xs:
        flash_attention(*x, causal=True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(
        f"{label:9s} queued {(t1 - t0) / 200 * 1e6:7.1f} us/call, finished {(t2 - t0) / 200 * 1e6:7.1f} us/call",
        flush=True,
    )
# the GPU time of each shape alone, by events, a few shapes
for g in (3000, 3001, 3002, 3003):
    x = inputs(g)
    for _ in range(3):
        flash_attention(*x, causal=True)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        flash_attention(*x, causal=True)
    e.record()
    torch.cuda.synchronize()
    shape = tuple(x[0].shape[2:3]) + tuple(x[1].shape[2:3])
    print("shape", shape, f"GPU {s.elapsed_time(e) / 20 * 1e3:.1f} us", flush=True)
# the host alone: planning 200 new signatures (no launch)
xs = [inputs(g) for g in range(4000, 4200)]
t0 = time.perf_counter()
for q, k, v in xs:
    key = forward.signature(q, k, v, True, None, None, None, None)
    forward.new_call(key, q, k, v, True, None, None, None, None)
print(f"planning only {(time.perf_counter() - t0) / 200 * 1e6:.1f} us/call", flush=True)
# where the planning goes
import cProfile  # noqa: E402
import pstats  # noqa: E402

xs = [inputs(g) for g in range(6000, 6400)]
prof = cProfile.Profile()
prof.enable()
for q, k, v in xs:
    key = forward.signature(q, k, v, True, None, None, None, None)
    forward.new_call(key, q, k, v, True, None, None, None, None)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
