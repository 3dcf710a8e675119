"""Where the host's time goes in a packed varlen training step's attention (forward, then backward of a fixed
upstream gradient; the bar's 16K-token log-normal batch, D = 64, causal): the time to issue a step against the
time a step takes back to back, then cProfile of the issuing.

python lab/probes/varlen_host_profile.py OUT_FILE"""

import cProfile
import io
import pstats
import sys
import time

import torch
from probe_log import log_to

from flashlab import flash_attention_varlen
from flashlab.bench.varlen import VarlenPlan, mix_lengths

say = log_to(sys.argv[1])
lengths = mix_lengths("log-normal", VarlenPlan(tokens=16384), seed=0)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
nmax = max(lengths)
q = torch.randn(16384, 16, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
k, v = (torch.randn(16384, 4, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in "kv")
do = torch.randn_like(q)


def forward():
    return flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True)


def step():
    forward().backward(do)


for label, fn in (("forward", forward), ("forward + backward", step)):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    issued = (time.perf_counter() - t0) / 50
    torch.cuda.synchronize()
    done = (time.perf_counter() - t0) / 50
    say(f"{label}: the host issues one in {issued * 1e6:.0f} us; back to back one takes {done * 1e6:.0f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    say(text.getvalue())
