"""The FP8 forward through rung 4's Gluon kernel (``rung4_overlap.launch_fp8``) under several (consumer
warpgroups, BLOCK_N, STAGES) tilings, beside flashlab's bf16 forward, on the prefill cells (B * N = 16K tokens,
H = 2048 / D, N 4K and 16K, causal and not, D = 64 and 128). 8-bit K and V tiles are half the bytes of 16-bit ones,
so the ring holds more of them in the same shared memory. Each variant's answer is compared with float64 of the
dequantised inputs on a sample of rows first; times by ``do_bench`` (the call's V transpose included).

python lab/probes/fp8_overlap_tiles.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab import dequantize_qkv, flash_attention, quantize_qkv
from flashlab.core.numerics import relative_error
from flashlab.kernels import fp8_forward
from flashlab.kernels.device import kernel_band
from flashlab.kernels.ladder import rung4_overlap
from flashlab.reference.torch_float64 import attention_float64

say = log_to(sys.argv[1])
# spill-free for sm_90 (Triton 3.6) at both head dims; three warpgroups of 128-key tiles spill
VARIANTS = {128: [(2, 128, 2), (2, 128, 3), (2, 128, 4), (3, 64, 2), (3, 64, 3)],
            64: [(2, 128, 2), (2, 128, 3), (3, 64, 2), (3, 64, 3)]}  # fmt: skip
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
default_tiles = rung4_overlap.tiles


def cell(d, n, causal):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    rung4_overlap.tiles = default_tiles
    ms16 = do_bench(lambda: flash_attention(q, k, v, causal=causal), rep=100)
    row = [f"D{d} N{n // 1024}K {'causal' if causal else 'full  '}: bf16 {flops / ms16 / 1e9:4.0f}"]
    rows = torch.arange(0, n, max(1, n // 64), device="cuda")
    ref = attention_float64(*(x[:1] for x in dequantize_qkv(q8, k8, v8, qd, kd, vd)), causal=causal,
                            rows=rows.tolist())[0]  # fmt: skip
    band = kernel_band(n, n, d, causal, None, None)[:4]
    for tiles in [None, *VARIANTS[d]]:
        rung4_overlap.tiles = default_tiles if tiles is None else (lambda *args, tiles=tiles: tiles)

        def run():
            o = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(q.shape[:3], device="cuda")
            rung4_overlap.launch_fp8(q8, k8, fp8_forward.transposed_v(v8), o, lse, qd, kd, vd, band, causal, None)
            return o

        try:
            err = relative_error(run()[:1, :, rows].double(), ref)
            ms = do_bench(run, rep=100)
            row.append(f"{tiles or 'own'} {flops / ms / 1e9:4.0f} x{ms16 / ms:.2f} err {err:.0e}")
        except Exception as e:  # a tiling that does not compile or fit: named, the others still run
            row.append(f"{tiles} failed: {type(e).__name__}: {str(e)[:100]}")
    say(" | ".join(row))


for d in (128, 64):
    for n in (4096, 16384):
        for causal in (False, True):
            cell(d, n, causal)
say("TFLOP/s; xR: bf16 time / FP8 time")
