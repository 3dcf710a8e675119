"""The backward's rungs 2 (``hopper``), 3 (``atomic_dq``) and 4 (``ordered_dq``) against rung 1 (``two_pass``),
PyTorch's FLASH and cuDNN backends, on the benchmark's backward cells: B * N = 16K tokens, H = 2048 / D, bf16,
causal and not, D = 64 and 128, N = 1K, 4K, 16K; rungs 2 and 3 under several tile configs. Every variant's
gradients are compared with float64 autograd on the first sequence and head first; then the backward alone (o and
lse given) is timed, in TFLOP/s at 2.5x the forward's FLOPs.

python lab/probes/backward_hopper_tiles.py OUT_FILE [--quick]"""

import sys
import time

import torch
import torch.nn.functional as F
from probe_log import log_to
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashlab import flash_attention
from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.kernels.backward import rung1_two_pass, rung2_hopper, rung3_atomic_dq, rung4_ordered_dq
from flashlab.reference.torch_float64 import attention_float64_grads

say = log_to(sys.argv[1])
QUICK = "--quick" in sys.argv


def tiles(kv, q):
    """A rung 2 config: (BLOCK_M, BLOCK_N, warps, stages) for dK/dV and for dQ."""
    return {"dkdv": dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), kv, strict=True)),
            "dq": dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), q, strict=True))}  # fmt: skip


# name -> config (None: the rung's own). Compiled for sm_90 (Triton 3.6) at D = 128: 8 warps unspecialised, no
# spills; 3 stages specialised, 4 bytes; dQ 128 x 128 specialised, 128 bytes (dK/dV 128 x 128: 1.2 KB, left out).
VARIANTS = {
    "hopper": None,
    "hopper 8w": tiles((64, 128, 8, 2), (128, 64, 8, 2)),
    "hopper 3 stages": tiles((64, 128, 4, 3), (128, 64, 4, 3)),
    "hopper q128x128": tiles((64, 128, 4, 2), (128, 128, 4, 2)),
}
# rung 3 (dQ by atomic adds in the dK/dV loop, eight plain warps): its own tiles, and 64-key tiles (spill-free too)
ATOMIC_VARIANTS = {
    "atomic_dq": None,
    "atomic_dq 64x64": {"dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)},
}
ORDERED_VARIANTS = {"ordered_dq": None}  # rung 4: rung 3's adds taking turns (deterministic)
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def cell(d, n, causal):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ref = attention_float64_grads(q, k, v, do, causal, batch=[0], kv_heads=[0])
    tol = grad_tolerance(torch.bfloat16)
    runs = {"two_pass": lambda: rung1_two_pass.attention_backward(do, q, k, v, o, lse, causal, None, None)}
    for name, config in VARIANTS.items():
        runs[name] = lambda config=config: rung2_hopper.attention_backward(do, q, k, v, o, lse, causal, None, None,
                                                                           config=config)  # fmt: skip
    for name, config in ATOMIC_VARIANTS.items():
        runs[name] = lambda config=config: rung3_atomic_dq.attention_backward(do, q, k, v, o, lse, causal, None,
                                                                              None, config=config)  # fmt: skip
    for name, config in ORDERED_VARIANTS.items():
        runs[name] = lambda config=config: rung4_ordered_dq.attention_backward(do, q, k, v, o, lse, causal, None,
                                                                               None, config=config)  # fmt: skip
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
    for n in (4096,) if QUICK else (1024, 4096, 16384):
        for causal in (False, True):
            cell(d, n, causal)
say("TFLOP/s of the backward alone (2.5x the forward's FLOPs); rung 2 variants after two_pass")
