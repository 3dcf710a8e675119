"""The varlen backward at D = 128 two ways in one run, on the bar's D = 128 cells (log-normal batches of 32
documents, 16K and 64K tokens, 16 query over 4 K/V heads, bf16, causal and not): the pointer kernels
(``flashlab.kernels.varlen``'s dK/dV and dQ, the host's tiles) against the copy-engine kernels
(``flashlab.kernels.varlen.hopper``), each given the same forward's o and lse; the gradients compared with each
other before they are timed, beside torch's varlen_attn forward + backward.

python lab/probes/varlen_hopper_backward.py OUT_FILE"""

import functools
import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab import flash_attention_varlen
from flashlab.bench.varlen import VarlenPlan, mix_lengths, torch_varlen_attn
from flashlab.host.varlen import backward_config
from flashlab.kernels import varlen

say = log_to(sys.argv[1])
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
for tokens in (16384, 65536):
    lengths = mix_lengths("log-normal", VarlenPlan(tokens=tokens), seed=0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n = max(lengths)
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v, do = (torch.randn(tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 4, 16))
        o, lse = flash_attention_varlen(q, k, v, cu, cu, n, n, causal=causal, return_lse=True)
        grads, times = {}, {}
        for name, copy_engine in (("pointer", False), ("copy engine", True)):
            config = {"dkdv": backward_config("dkdv", q), "dq": backward_config("dq", q), "copy_engine": copy_engine}

            step = functools.partial(varlen.backward, do, q, k, v, o, lse, cu, cu, n, n, causal, None, None, config)
            grads[name] = step()
            times[name] = do_bench(step, rep=100)
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                  for a, b in zip(grads["copy engine"], grads["pointer"], strict=True))  # fmt: skip
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def torch_step(args=(qg, kg, vg, cu, n, causal), grad=do):
            theirs(*args).backward(grad)

        ms_theirs = do_bench(torch_step, rep=100)
        say(f"{tokens // 1024}K D128 {'causal' if causal else 'full'}: backward pointer {times['pointer']:.3f} ms, "
            f"copy engine {times['copy engine']:.3f} ms ({times['pointer'] / times['copy engine']:.2f}x), "
            f"largest gradient difference {err:.1e}; varlen_attn forward + backward {ms_theirs:.3f} ms")  # fmt: skip
