"""The FP8 forward against flashlab's bf16 forward (the default rung) on the benchmark's prefill cells: B * N = 16K
tokens, H = 2048 / D, causal and not, D = 64 and 128, N = 4K and 16K: the copy-engine kernel (Triton) at its tiles
and rung 4's Gluon kernel with 8-bit operands (``rung4_overlap.launch_fp8``). Each cell's FP8 answer is compared
with float64 of the dequantised inputs on a sample of rows first. (Earlier forms timed the pointer kernel and more
tiles.)

python lab/probes/fp8_forward_speed.py OUT_FILE"""

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


# (kernel, tiles): the tensor-memory-engine kernel at its tiles, rung 4's (fixed tiles)
VARIANTS = {d: [("tma", fp8_forward.TMA_TILES[d]), ("overlap", None)] for d in (64, 128)}
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def cell(d, n, causal):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ms16 = do_bench(lambda: flash_attention(q, k, v, causal=causal), rep=100)
    row = [f"D{d} N{n // 1024}K {'causal' if causal else 'full  '}: bf16 {flops / ms16 / 1e9:5.0f} TFLOP/s"]
    rows = torch.arange(0, n, max(1, n // 64), device="cuda")
    ref = attention_float64(
        *(x[:1] for x in dequantize_qkv(q8, k8, v8, qd, kd, vd)), causal=causal, rows=rows.tolist()
    )[0]
    for kernel, tiles in VARIANTS[d]:

        def run(kernel=kernel, tiles=tiles):
            o = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(q.shape[:3], device="cuda")
            band = kernel_band(n, n, d, causal, None, None)[:4]
            if kernel == "overlap":
                rung4_overlap.launch_fp8(q8, k8, fp8_forward.transposed_v(v8), o, lse, qd, kd, vd, band, causal, None)
            elif kernel == "tma":
                fp8_forward.launch_tma(q8, k8, v8, o, lse, qd, kd, vd, band, causal, None, tiles)
            else:
                fp8_forward.launch(q8, k8, v8, o, lse, qd, kd, vd, band, tiles)
            return o

        try:
            err = relative_error(run()[:1, :, rows].double(), ref)
            ms = do_bench(run, rep=100)
            row.append(f"{kernel} {tiles} {flops / ms / 1e9:5.0f} TFLOP/s x{ms16 / ms:.2f} err {err:.1e}")
        except Exception as e:  # a config that does not fit or compile: named, the others still run
            row.append(f"{kernel} {tiles} failed: {type(e).__name__}: {str(e)[:120]}")
    say(" | ".join(row))


for d in (128, 64):
    for n in (4096, 16384):
        for causal in (False, True):
            cell(d, n, causal)
