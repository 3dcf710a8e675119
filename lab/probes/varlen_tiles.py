"""The packed varlen forward on the bar's cells (log-normal batches of 32 documents, 16K and 64K tokens, H = 16,
4 K/V heads, D = 64 and 128, bf16, causal and not) under several tile configs, each in the batch's own order and
with the documents sorted longest first (the same lengths, packed in another order: does the order the programs
start in matter?), beside torch's varlen_attn. Every output is compared with varlen_attn's first.

python lab/probes/varlen_tiles.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab.bench.varlen import VarlenPlan, mix_lengths, torch_varlen_attn
from flashlab.kernels import varlen
from flashlab.kernels.device import kernel_band

say = log_to(sys.argv[1])


CONFIGS = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)],
}
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
for tokens in (16384, 65536):
    base = mix_lengths("log-normal", VarlenPlan(tokens=tokens), seed=0)
    for d in (64, 128):
        for causal in (False, True):
            for order in ("given", "longest first"):
                lengths = base if order == "given" else sorted(base, reverse=True)
                cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                nmax = max(lengths)
                g = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(tokens, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
                k, v = (torch.randn(tokens, 4, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
                ref = theirs(q, k, v, cu, nmax, causal)
                ms_ref = do_bench(lambda q=q, k=k, v=v, cu=cu, n=nmax, c=causal: theirs(q, k, v, cu, n, c), rep=100)
                band = kernel_band(nmax, nmax, d, causal, None, None)[1:4]
                row = [
                    f"{tokens // 1024}K D{d} {'causal' if causal else 'full'} {order}: varlen_attn {ms_ref * 1e3:7.1f}"
                ]
                for bm, bn, w, s in CONFIGS[d]:
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                    o = torch.empty_like(q)
                    lse = torch.empty(16, tokens, device="cuda")

                    def run(q=q, k=k, v=v, o=o, lse=lse, cu=cu, n=nmax, c=causal, b=band, cfg=cfg):
                        varlen.launch(q, k, v, o, lse, cu, cu, n, n, c, None, b, config=cfg)

                    try:
                        run()
                        err = (o.float() - ref.float()).abs().max().item()
                        ms = do_bench(run, rep=100)
                        row.append(f"({bm},{bn},{w},{s}) {ms * 1e3:7.1f} us x{ms_ref / ms:.2f} err {err:.0e}")
                    except Exception as e:  # a config that does not fit: named, the others still run
                        row.append(f"({bm},{bn},{w},{s}) failed: {type(e).__name__}")
                say(" | ".join(row))
