"""Where the host's time goes in a packed varlen training step's attention (forward, then backward of a fixed
upstream gradient; the bar's 16K-token log-normal batch, D = 64, causal): the time to issue a step against the
time a step takes back to back, then cProfile of the issuing.

python lab/probes/varlen_host_profile.py OUT_FILE"""

import cProfile
import io
import pstats
import sys

import torch
from probe_log import log_to
from varlen_batch import issue_and_finish, lognormal_batch

from flashlab import flash_attention_varlen

say = log_to(sys.argv[1])
q, k, v, do, cu, nmax = lognormal_batch(16384, 64)


def forward():
    return flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True)


def step():
    forward().backward(do)


for label, fn in (("forward", forward), ("forward + backward", step)):
    for _ in range(5):
        fn()
    issued, done = issue_and_finish(fn, 50)
    say(f"{label}: the host issues one in {issued:.0f} us; back to back one takes {done:.0f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    say(text.getvalue())
