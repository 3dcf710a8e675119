"""Host time of the packed varlen call's launches, piece by piece (16K-token log-normal batch, D = 64, causal):
the plans' states after a few calls, then the time to issue a forward, a forward + backward, and each piece of one
planned launch (its key, the stream, the direct launch) against a launch through Triton's JIT.

python lab/probes/varlen_launch_timing.py OUT_FILE"""

import sys

import torch
from probe_log import log_to
from varlen_batch import issue_and_finish, lognormal_batch

from flashlab import flash_attention_varlen
from flashlab.host import launches
from flashlab.host import plan as plans
from flashlab.host import varlen as host_varlen
from flashlab.host.launcher import current_stream
from flashlab.kernels import varlen

say = log_to(sys.argv[1])
q, k, v, do, cu, nmax = lognormal_batch(16384, 64)


def forward():
    return flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True)


for _ in range(5):
    forward().backward(do)
torch.cuda.synchronize()
for key, p in plans.PLANS.items():
    if p.path == "planned":
        say(f"plan {key[0].fn.__name__}: {p.state}")
# 40 calls: few enough launches that the driver's queue never fills (a full queue makes the host wait for the GPU)
o, lse = flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=True, return_lse=True)
calls = {
    "forward": forward,
    "forward + backward": lambda: forward().backward(do),
    "backward alone (varlen_backward)": lambda: host_varlen.varlen_backward(do, q, k, v, o, lse, cu, cu, nmax, nmax,
                                                                            True, None, None),
}  # fmt: skip
for label, call in calls.items():
    say("{}: issued {:.0f} us, back to back {:.0f} us".format(label, *issue_and_finish(call, 40)))

# one forward launch, piece by piece
captured = {}


def capture(jit_function, grid, args, kwargs, runtime, outputs):
    captured.setdefault(jit_function, (grid, args, kwargs, runtime, outputs))
    launches.planned_launch(jit_function, grid, args, kwargs, runtime, outputs)


original = varlen._launch


def spy(jit_function, grid, args, kwargs, launcher, kernel):
    original(jit_function, grid, args, kwargs, capture if launcher is not None else None, kernel)


varlen._launch = spy
forward()
varlen._launch = original
grid, args, kwargs, runtime, outputs = captured[varlen.attn_fwd_varlen]
fn = varlen.attn_fwd_varlen
pieces = {  # (the call, how many, whether it launches: its back-to-back time printed too)
    "launch_key": (lambda: launches.launch_key(fn, args, kwargs, tuple(runtime), 0), 2000, False),
    "current_stream": (lambda: current_stream(0), 2000, False),
    "planned_launch": (lambda: launches.planned_launch(fn, grid, args, kwargs, runtime, outputs), 200, True),
    "JIT launch": (lambda: fn[grid](*args, **kwargs), 200, True),
    "torch.empty x5": (lambda: [torch.empty(1000, device="cuda") for _ in range(5)], 2000, False),
}
for label, (call, n, launches_a_kernel) in pieces.items():
    issued, done = issue_and_finish(call, n)
    say(f"{label}: issued {issued:.1f} us" + (f", back to back {done:.1f} us" if launches_a_kernel else ""))
