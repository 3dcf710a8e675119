"""Rung 3's dQ adds (``atomic_dq``: dS K added into a float32 buffer from the dK/dV loop) as one copy-engine
reduction a tile (``DQ_BULK``: ``cp.reduce.async.bulk.tensor`` through a tensor descriptor's ``atomic_add``)
instead of one atomic instruction per four floats, beside rungs 1 and 2, rung 3 as it is, and PyTorch's FLASH and
cuDNN backends, on the benchmark's backward cells (B * N = 16K tokens, H = 2048 / D, bf16). Every variant's
gradients are compared with float64 autograd on the first sequence and head first; then the backward alone (o and
lse given) is timed, in TFLOP/s at 2.5x the forward's FLOPs.

python lab/probes/backward_bulk_dq.py OUT_FILE"""

import sys
import time

import torch
import torch.nn.functional as F
from probe_log import log_to
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashlab import flash_attention
from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.kernels.backward import rung1_two_pass, rung2_hopper
from flashlab.reference.torch_float64 import attention_float64_grads

say = log_to(sys.argv[1])
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def dkdv(bm, bn, warps):
    return {"dkdv": dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=2)}


# name -> (run_backward's keywords, config); None: the rung's own tiles (rung2_hopper.ATOMIC_TILES for rung 3)
VARIANTS = {
    "hopper": ({}, None),
    "atomic_dq": ({"dq_atomic": True}, None),
    "bulk_dq": ({"dq_atomic": True, "dq_bulk": True}, None),
    "bulk_dq 64x128": ({"dq_atomic": True, "dq_bulk": True}, dkdv(64, 128, 8)),
    "bulk_dq 64x64": ({"dq_atomic": True, "dq_bulk": True}, dkdv(64, 64, 8)),
    "bulk_dq 64x64 4w": ({"dq_atomic": True, "dq_bulk": True}, dkdv(64, 64, 4)),
}


def cell(d, n, causal):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ref = attention_float64_grads(q, k, v, do, causal, batch=[0], kv_heads=[0])
    tol = grad_tolerance(torch.bfloat16)
    runs = {"two_pass": lambda: rung1_two_pass.attention_backward(do, q, k, v, o, lse, causal, None, None)}
    for name, (flags, config) in VARIANTS.items():
        runs[name] = lambda flags=flags, config=config: rung2_hopper.run_backward(do, q, k, v, o, lse, causal, None,
                                                                                  None, config, **flags)  # fmt: skip
    row = [f"D{d} N{n // 1024}K {'causal' if causal else 'full  '}:"]
    for name, run in runs.items():
        try:
            grads = run()
            torch.cuda.synchronize()
            errs = [relative_error(x[:1, :1], r) for x, r in zip(grads, ref, strict=True)]
            if not max(errs) <= tol:
                row.append(f"{name} WRONG (errors {', '.join(f'{e:.1e}' for e in errs)})")
                continue
            ms = do_bench(run, rep=100)
            row.append(f"{name} {flops / ms / 1e9:5.0f}")
        except Exception as e:  # a config that does not compile or fit: say so, go on
            row.append(f"{name} FAILED {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    for backend, label in ((SDPBackend.FLASH_ATTENTION, "FA2"), (SDPBackend.CUDNN_ATTENTION, "cuDNN")):
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

        def sdpa_backward(out=out, qs=qs, ks=ks, vs=vs):
            return torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True)

        row.append(f"{label} {flops / do_bench(sdpa_backward, rep=100) / 1e9:5.0f}")
    say(" | ".join(row))


for d in (128, 64):
    for n in (1024, 4096, 16384):
        for causal in (False, True):
            cell(d, n, causal)
say("TFLOP/s of the backward alone (2.5x the forward's FLOPs)")
