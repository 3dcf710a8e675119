"""fp32 prefill on the skip-and-split rung with four warps against eight on the same (64, 32) tile: the time of
each cold compile (a fresh Triton cache per config, in this process) and the kernel's time once compiled, to tell
whether eight warps (which halve a cold fp32 compile: its exact dots are FMA loops each thread unrolls) cost speed.

python lab/probes/fp32_prefill_warps.py OUT_FILE"""

import os
import sys
import tempfile
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab.host.attention import forward

say = log_to(sys.argv[1])


say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
cases = [(64, 2048, False), (64, 2048, True), (128, 2048, False), (128, 2048, True), (128, 4000, True)]
for d, n, causal in cases:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, n, d, device="cuda", generator=g)
    k, v = (torch.randn(1, 4, n, d, device="cuda", generator=g) for _ in range(2))
    row = [f"D{d} N{n} {'causal' if causal else 'full  '}"]
    for warps in (4, 8):
        config = dict(BLOCK_M=64, BLOCK_N=32, num_warps=warps, num_stages=2)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        t0 = time.perf_counter()
        o, _ = forward(q, k, v, causal, None, None, config=config)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        expect = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=causal
        )
        err = ((o.double() - expect).abs().max() / expect.abs().max()).item()
        ms = do_bench(
            lambda q=q, k=k, v=v, c=causal, cfg=config: forward(q, k, v, c, None, None, config=cfg), warmup=25, rep=100
        )
        row.append(f"{warps} warps: first call {first:5.2f} s, {ms * 1e3:8.1f} us, max rel err {err:.1e}")
    say("  ".join(row))
