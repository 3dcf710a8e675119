"""The KV-cache kernel's row blocks for sequences with many query rows, timed where they matter: the mixed serving
batch of ``python -m flashlab.bench --mode varlen --mixed-batch`` (one launch, and its separate calls, each alone),
a chunked prefill against a paged cache, and plain decode steps (which must not lose).

Run once with the tree under test and once with the tree before the change first on ``PYTHONPATH`` (same machine,
same call), each labelled; with a tree that has ``kvcache.TALL_CONFIG`` the tall blocks' tile variants are timed
too, each output checked against the default's first.

python lab/probes/kvcache_tall_tiles.py OUT_FILE LABEL [--no-variants]"""

import sys
import time

import torch
from probe_log import log_to
from triton.testing import do_bench

from flashlab import flash_attention_with_kvcache
from flashlab.bench.varlen import MixedBatch, VarlenPlan, mixed_batch_case
from flashlab.host import plan as plans
from flashlab.kernels.decode import kvcache

say = log_to(sys.argv[1])
label = sys.argv[2]
say(f"{label}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
    f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, kvcache from {kvcache.__file__}")  # fmt: skip
case = mixed_batch_case(VarlenPlan(kv_heads=4), MixedBatch(), "cuda")  # 16 query / 4 K/V heads, D = 128, bf16


def relative_error(out, expect):
    return ((out.float() - expect.float()).abs().max() / expect.float().abs().max()).item()


def chunked_prefill(rows, keys, block_size, b=1, hq=16, hk=4, d=128, seed=0):
    """A call of ``rows`` new query rows a sequence against caches of ``keys`` keys (causal), paged in shuffled
    ``block_size``-token blocks, bf16: ``(call, useful TFLOP)``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(b, hk, keys, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    kc, vc, table, seqlens = kvcache.paged_kv_cache(k, v, block_size)
    q = torch.randn(b, hq, rows, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    flops = b * hq * 4 * d * sum(keys - rows + j + 1 for j in range(rows))
    return (lambda: flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True, check_values=False)), flops


def timed(what, call, expect=None, flops=None):
    plans.forget()
    out = call()
    ms = do_bench(call, rep=200)
    err = "" if expect is None else f", max error against the default {relative_error(out, expect):.1e}"
    rate = "" if flops is None else f", {flops / ms / 1e9:.0f} TFLOP/s"
    say(f"{what}: {ms:.3f} ms{rate}{err}")
    return ms, out


def cut_for(rows):
    """The mixed batch's one launch with its grid cut for ``rows`` query rows a sequence (``max_seqlen_q``): more
    row blocks that exit at once, what each such program costs."""
    seqlens = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
    cu = torch.tensor(case.bounds, dtype=torch.int32, device="cuda")
    return lambda: flash_attention_with_kvcache(case.q, case.kc, case.vc, seqlens, case.table, causal=True,
                                                cu_seqlens_q=cu, max_seqlen_q=rows, check_values=False)  # fmt: skip


def run_set(tag):
    one_ms, one_out = timed(f"[{tag}] mixed batch, one launch", case.one_launch)
    timed(f"[{tag}] mixed batch, one launch cut for 4x the longest chunk's rows", cut_for(4 * max(case.rows_of)))
    separate_ms, _ = timed(f"[{tag}] mixed batch, separate calls", case.separate_calls)
    say(f"[{tag}] mixed batch: separate / one {separate_ms / one_ms:.3f}x")
    for what, call in case.calls:
        timed(f"[{tag}]   {what}", call)
    for rows, keys, bs in ((1024, 16384, 16), (1024, 16384, 256), (300, 4096, 16)):
        call, flops = chunked_prefill(rows, keys, bs)
        timed(f"[{tag}] chunked prefill, {rows} rows over {keys} keys, {bs}-token blocks", call, flops=flops)
    return one_out


def decode_cells(tag):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for b, keys in ((1, 32768), (8, 32768), (8, 4096)):
        k, v = (torch.randn(b, 8, keys, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(b, 64, 1, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        for bs in (16, 256):
            paged = kvcache.paged_kv_cache(k, v, bs)  # (k_cache, v_cache, block_table, cache_seqlens)
            timed(f"[{tag}] decode B = {b}, {keys} keys, {bs}-token blocks", decode_step(q, *paged))


def decode_step(q, kc, vc, table, seqlens):
    return lambda: flash_attention_with_kvcache(q, kc, vc, seqlens, table, check_values=False)


expect = run_set("default")
decode_cells("default")


def report_binaries():
    """Registers, spills and shared memory of every KV-cache binary compiled so far (Triton's JIT cache)."""
    for device_cache in getattr(kvcache.kvcache_partial, "device_caches", {}).values():
        kernels = device_cache[0] if isinstance(device_cache, tuple) else device_cache
        for kernel in kernels.values():
            try:
                kernel._init_handles()
            except Exception:  # noqa: BLE001 - older Tritons load on first launch
                pass
            say(
                f"binary {kernel.metadata.name}: {kernel.n_regs} registers, {kernel.n_spills} spilled, "
                f"{kernel.metadata.shared} bytes of shared memory, {kernel.metadata.num_warps} warps"
            )


report_binaries()
VARIANTS = (  # (tag, overrides of kvcache's constants)
    ("no short blocks", {"SHORT_BLOCK_M": 10**6}),
    ("tall (64, 8, 2), 2 an SM", {"TALL_CONFIG": (64, 8, 2), "TALL_PROGRAMS_PER_SM": 2}),
)
if "--no-variants" not in sys.argv:
    for tag, overrides in VARIANTS:
        if not all(hasattr(kvcache, name) for name in overrides):
            continue
        saved = {name: getattr(kvcache, name) for name in overrides}
        for name, value in overrides.items():
            setattr(kvcache, name, value)
        try:
            ms, out = timed(f"[{tag}] mixed batch, one launch", case.one_launch, expect)
            separate_ms, _ = timed(f"[{tag}] mixed batch, separate calls", case.separate_calls)
            say(f"[{tag}] mixed batch: separate / one {separate_ms / ms:.3f}x")
            call, flops = chunked_prefill(1024, 16384, 16)
            timed(f"[{tag}] chunked prefill, 1024 rows over 16384 keys, 16-token blocks", call, flops=flops)
        finally:
            for name, value in saved.items():
                setattr(kvcache, name, value)
