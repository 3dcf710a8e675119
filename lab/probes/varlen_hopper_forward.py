"""The Hopper varlen forward (``flashlab.kernels.varlen.hopper``: descriptors cut at each sequence's end, the grid
of the tiles that exist, a warp-specialised loop) beside the pointer kernel it would replace
(``flashlab.kernels.varlen``, its tuned config) and torch's varlen_attn, on the bar's cells: log-normal batches of
32 documents, 16K and 64K tokens, H = 16 over 4 K/V heads, D = 64 and 128, bf16, causal and not. Each output is
compared with varlen_attn's before it is timed; each config of the Hopper kernel is timed (four warps:
warp-specialised).

python lab/probes/varlen_hopper_forward.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab.bench.varlen import VarlenPlan, mix_lengths, torch_varlen_attn
from flashlab.kernels import varlen
from flashlab.kernels.device import kernel_band
from flashlab.kernels.varlen import hopper as varlen_hopper

say = log_to(sys.argv[1])
CONFIGS = [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2)]
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
best = {}
for tokens in (16384, 65536):
    lengths = mix_lengths("log-normal", VarlenPlan(tokens=tokens), seed=0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    nmax = max(lengths)
    for d in (64, 128):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(tokens, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(tokens, 4, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
            ref = theirs(q, k, v, cu, nmax, causal)
            ms_ref = do_bench(lambda q=q, k=k, v=v, cu=cu, n=nmax, c=causal: theirs(q, k, v, cu, n, c), rep=100)
            band = kernel_band(nmax, nmax, d, causal, None, None)[1:4]
            o = torch.empty_like(q)
            lse = torch.empty(16, tokens, device="cuda")
            cell = f"{tokens // 1024}K D{d} {'causal' if causal else 'full'}"
            row = [f"{cell}: varlen_attn {ms_ref * 1e3:7.1f} us"]

            def pointer(q=q, k=k, v=v, o=o, lse=lse, cu=cu, n=nmax, c=causal, b=band):
                varlen.launch(q, k, v, o, lse, cu, cu, n, n, c, None, b)

            pointer()
            err = (o.float() - ref.float()).abs().max().item()
            ms = do_bench(pointer, rep=100)
            row.append(f"pointer {ms * 1e3:7.1f} us x{ms_ref / ms:.2f} err {err:.0e}")
            times = {"pointer": ms}
            for bm, bn, w, s in CONFIGS:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                o.fill_(float("nan"))

                def hopper(q=q, k=k, v=v, o=o, lse=lse, cu=cu, n=nmax, c=causal, b=band, cfg=cfg):
                    varlen_hopper.launch(q, k, v, o, lse, cu, cu, n, n, c, None, b, config=cfg)

                try:
                    hopper()
                    err = (o.float() - ref.float()).abs().max().item()
                    ms = do_bench(hopper, rep=100)
                    times[(bm, bn, w, s)] = ms
                    row.append(f"({bm},{bn},{w},{s}) {ms * 1e3:7.1f} us x{ms_ref / ms:.2f} err {err:.0e}")
                except Exception as e:  # a config that does not build: named, the others still run
                    row.append(f"({bm},{bn},{w},{s}) failed: {type(e).__name__}: {str(e)[:80]}")
            say(" | ".join(row))
            fastest = min(times, key=times.get)
            best[cell] = (fastest, ms_ref / times[fastest], ms_ref / times["pointer"])
for cell, (cfg, x, x_pointer) in best.items():
    say(f"{cell}: fastest {cfg} x{x:.2f} varlen_attn (pointer kernel x{x_pointer:.2f})")
