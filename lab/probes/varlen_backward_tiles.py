"""The packed varlen forward + backward on the varlen bar's cells (log-normal batches of 32 documents, H = 16 over
4 K/V heads, bf16) under several dK/dV and dQ tile configs, beside torch's varlen_attn: a training step's
attention, timed as the bench times it (forward, then backward of a fixed upstream gradient). Each config's
gradients are compared with varlen_attn's first.

python lab/probes/varlen_backward_tiles.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench
from varlen_batch import lognormal_batch

from flashlab import flash_attention_varlen
from flashlab.bench.varlen import torch_varlen_attn
from flashlab.host import varlen as host_varlen

say = log_to(sys.argv[1])


def cfg(t):
    return {"BLOCK_M": t[0], "BLOCK_N": t[1], "num_warps": t[2], "num_stages": t[3]}


CANDIDATES = {
    64: [((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 64, 4, 3), (128, 64, 8, 3)), ((32, 64, 4, 3), (128, 64, 8, 3)),
         ((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 3), (64, 64, 4, 3))],
    128: [((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 128, 8, 2), (128, 64, 8, 2)), ((64, 64, 4, 3), (128, 64, 8, 2)),
          ((32, 64, 4, 2), (64, 64, 8, 3))],
}  # fmt: skip
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def run_cell(tokens, d, causal):
    q, k, v, do, cu, nmax = lognormal_batch(tokens, d)

    def step_theirs():
        theirs(q, k, v, cu, nmax, causal).backward(do)

    def step():
        flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=causal).backward(do)

    step_theirs()
    ref = [x.grad.clone() for x in (q, k, v)]
    ms_ref = do_bench(step_theirs, rep=200, grad_to_none=[q, k, v])
    row = [f"{tokens // 1024}K D{d} {'causal' if causal else 'full'}: varlen_attn {ms_ref * 1e3:7.0f}"]
    for dkdv, dq in CANDIDATES[d]:
        host_varlen.backward_config = lambda kernel, q_, a=dkdv, b=dq: cfg(a if kernel == "dkdv" else b)
        for x in (q, k, v):
            x.grad = None
        step()
        err = max(((x.grad.float() - r.float()).abs().max() / r.float().abs().max()).item()
                  for x, r in zip((q, k, v), ref, strict=True))  # fmt: skip
        ms = do_bench(step, rep=200, grad_to_none=[q, k, v])
        row.append(f"dkdv {dkdv} dq {dq}: {ms * 1e3:7.0f} us x{ms_ref / ms:.2f} err {err:.0e}")
    say(" | ".join(row))


for tokens, d in ((16384, 64), (16384, 128), (65536, 64), (65536, 128)):
    for causal in (False, True):
        run_cell(tokens, d, causal)
