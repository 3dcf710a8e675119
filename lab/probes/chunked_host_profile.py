"""Where the host time of chunked prefill with new lengths every call goes (H200): 200 calls of the loops bench's
chunked-prefill lengths under cProfile, after a pass that compiles."""

import cProfile
import io
import pstats
import sys
import time

import torch

from flashlab import flash_attention
from flashlab.bench.loops import chunk_lengths

nq, nk = (300, 1001, 7), (4000, 5301, 13)
q_buf = torch.randn(1, 16, 1000, 128, device="cuda", dtype=torch.bfloat16)
k_buf = torch.randn(1, 16, 5300, 128, device="cuda", dtype=torch.bfloat16)
v_buf = torch.randn_like(k_buf)


def step(g):
    a, b = chunk_lengths(g, nq, nk)
    return flash_attention(q_buf[:, :, :a], k_buf[:, :, :b], v_buf[:, :, :b], causal=True)


for g in range(20):
    step(g)
torch.cuda.synchronize()
for label, offset in (("changing", 1000), ("changing again", 3000)):
    t0 = time.perf_counter()
    for g in range(offset, offset + 200):
        step(g)
    torch.cuda.synchronize()
    print(label, (time.perf_counter() - t0) / 200 * 1e6, "us per call", flush=True)
prof = cProfile.Profile()
prof.enable()
for g in range(5000, 5200):
    step(g)
torch.cuda.synchronize()
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue())
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(s.getvalue())
