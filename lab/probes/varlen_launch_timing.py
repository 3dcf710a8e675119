"""Host time of the packed varlen call's launches, piece by piece (16K-token log-normal batch, D = 64, causal):
the plans' states after a few calls, then the time to issue a forward, a forward + backward, and each piece of one
planned launch (its key, the stream, the direct launch) against a launch through Triton's JIT.

python lab/probes/varlen_launch_timing.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to

from flashlab import flash_attention_varlen
from flashlab.bench.varlen import VarlenPlan, mix_lengths
from flashlab.host import launches
from flashlab.host import plan as plans
from flashlab.host import varlen as host_varlen
from flashlab.host.launcher import current_stream
from flashlab.kernels import varlen

say = log_to(sys.argv[1])
lengths = mix_lengths("log-normal", VarlenPlan(tokens=16384), seed=0)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
nmax = max(lengths)
q = torch.randn(16384, 16, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
k, v = (torch.randn(16384, 4, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in "kv")
do = torch.randn_like(q)


def per_call(fn, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    issued = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return issued * 1e6, (time.perf_counter() - t0) / n * 1e6


def forward():
    return flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True)


for _ in range(5):
    forward().backward(do)
torch.cuda.synchronize()
for key, p in plans.PLANS.items():
    if p.path == "planned":
        say(f"plan {key[0].fn.__name__}: {p.state}")
# 40 calls: few enough launches that the driver's queue never fills (a full queue makes the host wait for the GPU)
say("forward: issued {:.0f} us, back to back {:.0f} us".format(*per_call(forward, 40)))
step = per_call(lambda: forward().backward(do), 40)
say("forward + backward: issued {:.0f} us, back to back {:.0f} us".format(*step))
o, lse = flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True, return_lse=True)
say(
    "backward alone (varlen_backward): issued {:.0f} us, back to back {:.0f} us".format(
        *per_call(lambda: host_varlen.varlen_backward(do, q, k, v, o, lse, cu, cu, nmax, nmax, True, None, None), 40)
    )
)

# one forward launch, piece by piece
captured = {}


def capture(jit_function, grid, args, kwargs, runtime, outputs):
    captured.setdefault(jit_function, (grid, args, kwargs, runtime, outputs))
    launches.planned_launch(jit_function, grid, args, kwargs, runtime, outputs)


original = varlen._launch
varlen_launch = varlen.launch
forward_args = None


def spy(jit_function, grid, args, kwargs, launcher, kernel):
    original(jit_function, grid, args, kwargs, capture if launcher is not None else None, kernel)


varlen._launch = spy
forward()
varlen._launch = original
grid, args, kwargs, runtime, outputs = captured[varlen.attn_fwd_varlen]
fn = varlen.attn_fwd_varlen
say(f"launch_key: {per_call(lambda: launches.launch_key(fn, args, kwargs, tuple(runtime), 0), 2000)[0]:.1f} us")
say(f"current_stream: {per_call(lambda: current_stream(0), 2000)[0]:.1f} us")
planned = per_call(lambda: launches.planned_launch(fn, grid, args, kwargs, runtime, outputs))
say("planned_launch: issued {:.1f} us, back to back {:.1f} us".format(*planned))
say("JIT launch: issued {:.1f} us, back to back {:.1f} us".format(*per_call(lambda: fn[grid](*args, **kwargs))))
say("torch.empty x5: {:.1f} us".format(per_call(lambda: [torch.empty(1000, device="cuda") for _ in range(5)], 2000)[0]))
