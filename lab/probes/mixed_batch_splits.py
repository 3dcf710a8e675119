"""The mixed serving batch (``python -m flashlab.bench --mode varlen --mixed-batch``'s: 8 prefill chunks and 56
decode rows over a 16-token paged cache, 16 query / 4 K/V heads, D = 128, causal) in one launch with its keys cut
into 1, 2, 4 or 8 chunks, against the separate calls as the planner cuts them.

The one launch's planner counts its grid's programs (every sequence's rows cut for the longest chunk: 28K, of which
~1.9K have rows) and so cuts the keys into one chunk; each program then walks its sequence's whole cache, up to 235
key tiles, and the launch ends on a tail of such programs (docs/decode.md, "The mixed batch"). Cutting the keys
bounds that tail at the cost of the chunks' merge. Each setting's output is checked against the default's first.

python lab/probes/mixed_batch_splits.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab.bench.varlen import MixedBatch, mixed_batch_lengths
from flashlab.host import flash_attention_with_kvcache
from flashlab.host import plan as plans
from flashlab.kernels.decode import split_kv
from flashlab.kernels.decode.kvcache import paged_kv_cache

say = log_to(sys.argv[1])
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
batch = MixedBatch()
rows_of, lengths = mixed_batch_lengths(batch)
hq, hk, d = 16, 4, 128
gen = torch.Generator().manual_seed(0)
b, nmax = len(lengths), max(lengths)
k, v = (torch.randn(b, hk, nmax, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
kc, vc, table, seqlens = paged_kv_cache(k, v, batch.block_size, lengths=lengths)
del k, v
q = torch.randn(sum(rows_of), hq, d, generator=gen).to("cuda", torch.bfloat16)
bounds = [0]
for n in rows_of:
    bounds.append(bounds[-1] + n)
cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
p = batch.prefills
chunks = [q[bounds[i] : bounds[i + 1]].transpose(0, 1).unsqueeze(0).contiguous() for i in range(p)]
q_decode = q[bounds[p] :].unsqueeze(2).contiguous()


def one_launch():
    return flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True, cu_seqlens_q=cu,
                                        max_seqlen_q=max(rows_of), check_values=False)  # fmt: skip


def separate_calls():
    outs = [flash_attention_with_kvcache(c, kc, vc, seqlens[i : i + 1], table[i : i + 1], causal=True,
                                         check_values=False) for i, c in enumerate(chunks)]  # fmt: skip
    outs.append(flash_attention_with_kvcache(q_decode, kc, vc, seqlens[p:], table[p:], causal=True,
                                             check_values=False))  # fmt: skip
    return outs


def fresh_plans():
    plans.PLANS.clear()
    plans.CALLS.clear()
    plans.FAMILIES.clear()


separate_ms = do_bench(separate_calls, rep=300)
say(f"separate calls: {separate_ms:.3f} ms")
choose = split_kv.choose_splits
expect = one_launch()
for splits in (None, 2, 4, 8):
    fresh_plans()
    if splits is not None:
        split_kv.choose_splits = lambda units, band_keys, sms, programs_per_sm=None, s=splits: s
    try:
        out = one_launch()
        err = ((out.float() - expect.float()).abs().max() / expect.float().abs().max()).item()
        ms = do_bench(one_launch, rep=300)
        label = "the planner's" if splits is None else f"{splits}"
        say(f"one launch, keys in {label} chunks: {ms:.3f} ms, separate / one {separate_ms / ms:.3f}x, "
            f"max error against the default {err:.1e}")  # fmt: skip
    finally:
        split_kv.choose_splits = choose
