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

from flashlab.bench.varlen import MixedBatch, VarlenPlan, mixed_batch_case
from flashlab.host import plan as plans
from flashlab.kernels.decode import kvcache, split_kv

say = log_to(sys.argv[1])
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
case = mixed_batch_case(VarlenPlan(kv_heads=4), MixedBatch(), "cuda")  # 16 query / 4 K/V heads, D = 128, bf16
one_launch, separate_calls = case.one_launch, case.separate_calls


separate_ms = do_bench(separate_calls, rep=300)
say(f"separate calls: {separate_ms:.3f} ms")
for what, call in case.calls:  # each separate call alone: where the separate calls' time goes
    say(f"  {what}: {do_bench(call, rep=100):.3f} ms")
choose = split_kv.choose_splits
expect = one_launch()
block_m, small = split_kv.packed_block_m, kvcache.SMALL_BLOCK_CONFIG
for splits, tiles in ((None, None), (2, None), (4, None), (8, None), (16, None), (None, (128, 8)), (4, (128, 8))):
    plans.forget()
    if splits is not None:
        split_kv.choose_splits = lambda units, band_keys, sms, programs_per_sm=None, s=splits: s
    if tiles is not None:  # taller row blocks (more warps) for every sequence of the launch
        split_kv.packed_block_m = lambda rows, m=tiles[0]: m
        kvcache.SMALL_BLOCK_CONFIG = (small[0], tiles[1], small[2])
    try:
        out = one_launch()
        err = ((out.float() - expect.float()).abs().max() / expect.float().abs().max()).item()
        ms = do_bench(one_launch, rep=300)
        label = ("the planner's" if splits is None else f"{splits}") + (
            "" if tiles is None else f", {tiles[0]}-row blocks, {tiles[1]} warps"
        )
        say(f"one launch, keys in {label} chunks: {ms:.3f} ms, separate / one {separate_ms / ms:.3f}x, "
            f"max error against the default {err:.1e}")  # fmt: skip
    finally:
        split_kv.choose_splits, split_kv.packed_block_m, kvcache.SMALL_BLOCK_CONFIG = choose, block_m, small
