"""Rung 2 (``hopper``) of the backward under several (dK/dV, dQ) tile pairs at one head dim, beside rung 1
(``two_pass``) and PyTorch's FLASH and cuDNN backends, on the benchmark's backward cells (B * N = 16K tokens,
H = 2048 / D, bf16, N 1K / 4K / 16K, causal and not). Each variant's gradients are compared with float64 autograd on
the first sequence and head before its backward alone (o and lse given) is timed, in TFLOP/s at 2.5x the
forward's FLOPs. Tile pairs are (BLOCK_M, BLOCK_N, warps, stages) for dK/dV, then for dQ; four-warp configs are
warp-specialised as the rung's own.

python lab/probes/backward_tile_sweep.py OUT_FILE HEAD_DIM"""

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
D = int(sys.argv[2])
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PAIRS = [
    ((64, 128, 4, 2), (128, 64, 4, 2)),  # the rung's own at D <= 128
    ((128, 128, 4, 2), (128, 64, 4, 2)),
    ((64, 128, 4, 3), (128, 64, 4, 3)),
    ((64, 128, 4, 2), (128, 128, 4, 2)),
    ((128, 128, 4, 2), (128, 128, 4, 2)),
    ((128, 64, 4, 2), (64, 128, 4, 2)),
    ((128, 128, 4, 3), (128, 128, 4, 3)),
]


def label(pair):
    return "/".join("x".join(str(x) for x in tiles) for tiles in pair)


def cell(n, causal):
    b, h = 16384 // n, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(n + D)
    q, k, v, do = (torch.randn(b, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * b * h * n * n * D * (0.5 if causal else 1.0)
    ref = attention_float64_grads(q, k, v, do, causal, batch=[0], kv_heads=[0])
    tol = grad_tolerance(torch.bfloat16)
    runs = {"two_pass": lambda: rung1_two_pass.attention_backward(do, q, k, v, o, lse, causal, None, None)}
    for pair in PAIRS:
        config = {"dkdv": dict(zip(FIELDS, pair[0], strict=True)), "dq": dict(zip(FIELDS, pair[1], strict=True))}
        runs[label(pair)] = lambda config=config: rung2_hopper.attention_backward(do, q, k, v, o, lse, causal, None,
                                                                                  None, config=config)  # fmt: skip
    row = [f"D{D} N{n // 1024}K {'causal' if causal else 'full  '}:"]
    for name, run in runs.items():
        try:
            grads = run()
            torch.cuda.synchronize()
            errs = [relative_error(x[:1, :1], r) for x, r in zip(grads, ref, strict=True)]
            if not max(errs) <= tol:
                row.append(f"{name} WRONG (errors {', '.join(f'{e:.1e}' for e in errs)})")
                continue
            row.append(f"{name} {flops / do_bench(run, rep=100) / 1e9:5.0f}")
        except Exception as e:  # a config that does not compile or fit: say so, go on
            row.append(f"{name} FAILED {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    for backend, name in ((SDPBackend.FLASH_ATTENTION, "FA2"), (SDPBackend.CUDNN_ATTENTION, "cuDNN")):
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

        def sdpa_backward(out=out, qs=qs, ks=ks, vs=vs):
            return torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True)

        row.append(f"{name} {flops / do_bench(sdpa_backward, rep=100) / 1e9:5.0f}")
    say(" | ".join(row))


for n in (1024, 4096, 16384):
    for causal in (False, True):
        cell(n, causal)
say("TFLOP/s of the backward alone (2.5x the forward's FLOPs); rung 2's tile pairs as dK/dV / dQ")
