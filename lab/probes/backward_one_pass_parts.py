"""Where the Gluon backward's loop (``rung5_one_pass``) spends its time: the rung (``DQ_WORK`` 2: every step's five
products and dQ's atomic adds), without the adds (1: the dQ product, its shared-memory dS and the two warpgroups'
meeting for it, but nothing leaves the program), and without dQ at all (0: rung 2's dK/dV loop, four products), beside
rung 6 (the same adds taking turns), rung 2 (``hopper``: the dK/dV loop and a dQ pass, seven products) and cuDNN;
and the step's variants (``rung5_one_pass.STATS_SMEM``, ``DQ_BULK``, ``DQ_OWN_KEYS``, ``DP_LATE_WAIT``):
``+stats`` (lse and delta staged in shared memory by the loader), ``+bulk`` (dQ by the copy engine's bulk add),
``+both``, ``+own`` (the statistics staged and each warpgroup adding dQ over its own keys: no meeting), ``+late``
(``+both`` with the wait for dPᵀ below Sᵀ's exponentials), and rung 6 ``+stats``. Every run that does all of dQ's
work is checked against float64 autograd on the first sequence and head before it is timed.
TFLOP/s at 2.5x the forward's FLOPs (B * N = 16K tokens, H = 2048 / D, bf16).

python lab/probes/backward_one_pass_parts.py OUT_FILE [HEAD_DIMS, default 128,64]"""

import sys
import time

import torch
import torch.nn.functional as F
from probe_log import log_to
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashlab import flash_attention
from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.kernels.backward import rung2_hopper, rung5_one_pass
from flashlab.reference.torch_float64 import attention_float64_grads

say = log_to(sys.argv[1])
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
rung_constexprs = rung5_one_pass.constexprs


def with_dq_work(work):
    """``rung5_one_pass.constexprs`` with ``DQ_WORK`` set (the module's function is swapped for the call)."""

    def constexprs(*args):
        return {**rung_constexprs(*args), "DQ_WORK": work}

    return constexprs


def cell(d, n, causal):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ref = attention_float64_grads(q, k, v, do, causal, batch=[0], kv_heads=[0])
    args = (do, q, k, v, o, lse, causal, None, None)
    one_pass = rung5_one_pass.run_backward
    runs = {
        "hopper": (None, lambda: rung2_hopper.attention_backward(*args)),
        "one_pass_atomic": (2, lambda: one_pass(*args)),
        "no_adds": (1, lambda: one_pass(*args)),
        "no_dq": (0, lambda: one_pass(*args)),
        "+stats": (2, lambda: one_pass(*args, stats_smem=True, dq_bulk=False)),
        "+bulk": (2, lambda: one_pass(*args, stats_smem=False, dq_bulk=True)),
        "+both": (2, lambda: one_pass(*args, stats_smem=True, dq_bulk=True)),
        "+own": (2, lambda: one_pass(*args, stats_smem=True, dq_own_keys=True)),
        "+late": (2, lambda: one_pass(*args, stats_smem=True, dq_bulk=True, dp_late_wait=True)),
        "one_pass": (2, lambda: one_pass(*args, ordered=True)),
        "one_pass+stats": (2, lambda: one_pass(*args, ordered=True, stats_smem=True)),
    }
    row = [f"D{d} N{n // 1024}K {'causal' if causal else 'full  '}:"]
    for name, (work, run) in runs.items():
        rung5_one_pass.constexprs = with_dq_work(2 if work is None else work)
        try:
            grads = run()
            torch.cuda.synchronize()
            if work == 2 or work is None:
                errs = [relative_error(x[:1, :1], r) for x, r in zip(grads, ref, strict=True)]
                if not max(errs) <= grad_tolerance(torch.bfloat16):
                    row.append(f"{name} WRONG (errors {', '.join(f'{e:.1e}' for e in errs)})")
                    continue
            row.append(f"{name} {flops / do_bench(run, rep=100) / 1e9:5.0f}")
        except Exception as e:  # say so, go on
            row.append(f"{name} FAILED {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        finally:
            rung5_one_pass.constexprs = rung_constexprs
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    seconds = do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True), rep=100) / 1e3
    row.append(f"cuDNN {flops / seconds / 1e12:5.0f}")
    say(" | ".join(row))


for d in (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "128,64").split(",")):
    for n in (1024, 4096, 16384):
        for causal in (False, True):
            cell(d, n, causal)
