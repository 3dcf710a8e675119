"""Attention against a serving engine's KV cache: ragged lengths, and keys and values in a pool of paged blocks.

A serving engine keeps every running sequence's keys and values in one pool of fixed-size blocks (PagedAttention,
``flashlab.paged``): ``k_cache`` and ``v_cache`` are ``(num_blocks, block_size, Hk, D)``, and row ``b`` of a block
table lists the physical blocks of sequence ``b`` in logical order. Key ``j`` of sequence ``b`` lives in block
``block_table[b, j // block_size]`` at slot ``j % block_size``. Sequences have their own lengths
(``cache_seqlens``); blocks may sit anywhere in the pool, in any order, and be shared between sequences (a common
prompt prefix).

The kernel is the split-KV partial kernel of ``flashlab.kernels.split_kv`` with two changes:

- each program reads its sequence's length, and masks are aligned to that sequence's own end (query i of Nq sees
  keys up to ``seqlen_b - Nq + i`` when causal);
- each key tile's address goes through the block table: one table entry per tile when a block holds whole tiles,
  one per key otherwise. The cache is never gathered into a contiguous copy.

Its chunks' partial outputs are merged as in split-KV, inside the same launch, by the chunks' last finishers
(``softmax_step.finish_chunk``): as a tree of groups, or, for blocks smaller than ``SMALL_BLOCK_TOKENS`` tokens
and up to ``split_kv.MAX_FOLD_SPLITS`` chunks, folded in one level (fewer registers). When one chunk suffices it
normalises and writes the output itself.
Without a block table the cache is
``(B, Nk_max, Hk, D)``, one slab per sequence, read the same way.

The float64 reference it must equal is ``flashlab.reference.torch_float64.attention_float64`` applied to each
sequence's keys and values, gathered into contiguous tensors (the tests do exactly that).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.core.masking import visible_band
from flashlab.kernels import softmax_step, split_kv
from flashlab.kernels.forward import check_dense, check_scale, launched_q
from flashlab.kernels.runtime import (
    CPU_CONFIG,
    DTYPES,
    HEAD_DIM_MULTIPLE,
    LOG2_E,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    block_d,
    current_device_index,
    current_stream,
    device_index,
    dot_precision,
    dot_upcast,
    interpreted,
    interpreted_language,
    sm_count,
)

# Block sizes must be multiples of this: the smallest key tile, so a tile never straddles a block unevenly.
BLOCK_SIZE_MULTIPLE = 16


# fmt: off
@triton.jit
def _kvcache_partial(
    Q, K, V, BLOCK_TABLE, SEQLENS,  # q; the K/V cache; the block table (unused when PAGE_SIZE == 0); lengths
    O_PART, LSE_PART, O, LSE,  # partial outputs (fp32) and lse (log2) per chunk; the output and its lse
    COUNTERS,  # int32, one per (sequence, K/V head, row block): chunks finished; zero between launches
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1
    stride_kp, stride_ks, stride_kh,  # K over (page, slot in page, head): a block, or a sequence without a table
    stride_vp, stride_vs, stride_vh,
    stride_tb,  # block table row stride
    stride_ob, stride_oh, stride_om,  # the output, written only with DIRECT
    HQ, HK, GROUP, NQ,  # query heads, K/V heads, query heads per K/V head, query length
    NUM_PAGES, CAPACITY,  # blocks in the pool, keys a sequence can hold: a bad table entry or length never faults
    win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    keys_per_split, NUM_SPLITS,  # each chunk's keys: [split * keys_per_split, (split + 1) * keys_per_split)
    qk_scale,  # softmax scale * log2(e)
    TUNE_KEY_N, TUNE_KEY_UNITS,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # packed query rows per program: (query head in the group, query position)
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    PAGE_SIZE: tl.constexpr,  # tokens per cache block; 0: no block table, the page is the whole sequence
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,  # one chunk: normalise and write o and lse here, no partials, no counter
    MERGE_HERE: tl.constexpr,  # several chunks: the last to finish merges them (else split_kv_merge does)
    MERGE_GROUP: tl.constexpr,  # chunks per group of the merge's tree; 0: one level (softmax_step.finish_chunk)
):
    # fmt: on
    pid_s = tl.program_id(0)  # which chunk of keys
    pid_bk = tl.program_id(1)  # which (sequence, K/V head)
    pid_m = tl.program_id(2)  # which block of packed rows
    off_b = pid_bk // HK
    off_hk = pid_bk % HK
    nk = tl.minimum(tl.maximum(tl.load(SEQLENS + off_b), 0), CAPACITY)  # this sequence's length
    offset = nk - NQ  # masks are aligned to the sequence's own end

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * NQ
    qi = rows % NQ  # (BLOCK_M,) query position
    off_h = off_hk * GROUP + rows // NQ  # (BLOCK_M,) query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # -- the packed Q tile, loaded once: every query row that shares this K/V head
    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + off_h[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_ptrs + qi[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    table = BLOCK_TABLE + off_b.to(tl.int64) * stride_tb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- this chunk's keys, cut to the band of the query positions in this block
    r_lo = pid_m * BLOCK_M
    r_hi = tl.minimum(r_lo + BLOCK_M, GROUP * NQ) - 1
    one_head = r_lo // NQ == r_hi // NQ
    qi_lo = tl.where(one_head, r_lo % NQ, 0)
    qi_hi = tl.where(one_head, r_hi % NQ, NQ - 1)
    split_lo = pid_s * keys_per_split
    lo = tl.maximum(split_lo, qi_lo + offset - win_left)
    hi = tl.minimum(tl.minimum(split_lo + keys_per_split, nk), qi_hi + offset + win_right + 1)
    lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    diag = qi + offset

    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) logical key positions in the sequence
        # -- where the tile's keys live: (page, slot) for each key
        if PAGE_SIZE == 0:  # one slab per sequence
            page = off_b.to(tl.int64)
            slot = cols
        elif PAGE_SIZE % BLOCK_N == 0:  # the tile lies inside one block: one table entry
            page = tl.load(table + start_n // PAGE_SIZE).to(tl.int64)
            slot = start_n % PAGE_SIZE + offs_n
        else:  # the tile spans several blocks: one table entry per key
            page = tl.load(table + cols // PAGE_SIZE, mask=cols < hi, other=0).to(tl.int64)
            slot = cols % PAGE_SIZE
        # a table entry outside the pool is never followed (checked on the host unless check_values=False)
        if PAGE_SIZE == 0:
            key_ok = cols < hi
        elif PAGE_SIZE % BLOCK_N == 0:  # one entry for the tile: a bad one hides the whole tile
            key_ok = cols < tl.where((page >= 0) & (page < NUM_PAGES), hi, 0)
        else:
            key_ok = (cols < hi) & (page >= 0) & (page < NUM_PAGES)
        k_off = page * stride_kp + slot * stride_ks  # (BLOCK_N,) or broadcast scalar page
        v_off = page * stride_vp + slot * stride_vs
        # -- K tile: BLOCK_N * D * bytes(dtype), read once for all GROUP query heads
        k = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        visible = softmax_step.band_mask(diag, cols, win_left, win_right, hi) & key_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        # -- V tile: BLOCK_N * D * bytes(dtype)
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        p = p.to(Q.dtype.element_ty)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # -- a sequence of length 0, or a chunk past its end, gives zeros and lse = -inf
    out = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + qi.to(tl.int64) * stride_om
    first = ((off_b * HQ + off_h) * NQ + qi).to(tl.int64) * NUM_SPLITS  # (BLOCK_M,) each row's chunk 0
    block = pid_bk * tl.num_programs(2) + pid_m  # this block of rows' merge counters
    softmax_step.finish_chunk(acc, m_i, l_i, out, LSE + (off_b * HQ + off_h) * NQ + qi, row_ok, offs_d, d_ok, O_PART,
                              LSE_PART, first, COUNTERS, block, pid_s, NUM_SPLITS, HEAD_DIM, BLOCK_M, BLOCK_D, DIRECT,
                              MERGE_HERE, MERGE_GROUP)


# (BLOCK_N, num_warps, num_stages): a subset of split_kv's space (its pruning applies), small enough that a decode
# grid's first calls do not spend a minute compiling; fp32 inputs take split_kv's fp32 configs. Two stages suit
# small blocks (a tile then spans several, each a table lookup away): on the H200, 16-token blocks with 128-key
# tiles and two stages ran within 2-6% of contiguous decode, three stages up to a third behind (docs/kernel-notes.md).
TUNING_SPACE = [(64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3)]
# Blocks smaller than this many tokens (16-bit inputs) take SMALL_BLOCK_CONFIG without autotuning (the best or
# within 3% of it in every cell of the H200's decode sweep, where the autotuner's own pick was up to 15% slower).
# Their kernel merges up to split_kv.MAX_FOLD_SPLITS chunks in one level (split_kv.plan_merge's tree=False, 160
# registers a thread: three programs an SM). Where more chunks would fill three programs an SM, it takes the tree
# instead, which needs 196 registers (two programs an SM), and chunks for SMALL_BLOCK_TREE_PROGRAMS_PER_SM programs
# an SM: one launch, where the fold's chunk limit used to leave a second merge kernel (docs/kernel-notes.md).
SMALL_BLOCK_TOKENS = 128
SMALL_BLOCK_CONFIG = (128, 4, 2)
SMALL_BLOCK_TREE_PROGRAMS_PER_SM = 2

_kvcache_partial_tuned = triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bn, w, st in TUNING_SPACE + split_kv.FP32_TUNING_SPACE + [(32, 4, 1)]
    ],
    key=["TUNE_KEY_N", "TUNE_KEY_UNITS", "HEAD_DIM", "BLOCK_M", "PAGE_SIZE", "DOT_PRECISION", "DIRECT", "MERGE_HERE",
         "MERGE_GROUP"],
    prune_configs_by={"early_config_prune": split_kv.prune_configs},
)(_kvcache_partial)

_BEST_CONFIG: dict = {}  # (device, dtype, tune key, meta) -> the autotuner's pick


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------


def _check_tensor(name, x, ndim):
    check_dense(name, x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims; got shape {tuple(x.shape)}")


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, check_values=True,
                         key=None):  # fmt: skip
    """Validate a ``flash_attention_with_kvcache`` call; returns ``capacity``, the most keys a sequence can hold.
    Every bad argument is a TypeError or ValueError naming it.

    With ``check_values`` the values of ``cache_seqlens`` and of the block table's used entries are checked too (on
    a GPU with one synchronisation), except while a CUDA graph is being captured or torch.compile traces the call,
    where the host cannot read device memory (the compiled operator checks them when it runs).

    Everything else depends only on the shapes, strides, dtypes and devices and on the other arguments, so a call
    signature that passed once is remembered (``call_signature``; ``key`` is its value, when the caller has it)
    and not checked again.
    """
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be True or False; got {check_values!r}")
    compiling = torch.compiler.is_compiling()  # torch.compile traces the checks themselves
    if compiling:
        key = None
    elif key is None:
        key = call_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale)
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:
        checked = _check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale)
        if key is not None:
            if len(_CHECKED) >= MAX_PLANS:
                _CHECKED.clear()
            _CHECKED[key] = checked
    capacity, pages, page_size = checked
    if check_values and not (compiling or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        _check_values(cache_seqlens, block_table, capacity, pages, page_size)
    return capacity


_CHECKED: dict = {}  # call signature -> (capacity, pages, page_size) of a call whose shapes passed


def _check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale):
    _check_tensor("q", q, 4)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    _check_tensor("cache_seqlens", cache_seqlens, 1)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16 and float32")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        dtypes = f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        raise TypeError(f"q, k_cache and v_cache must have the same dtype; got {dtypes}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32; got {cache_seqlens.dtype}")
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)]
    if block_table is not None:
        _check_tensor("block_table", block_table, 2)
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32; got {block_table.dtype}")
        tensors.append(("block_table", block_table))
    for name, x in tensors:
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {x.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"runs on CUDA (compiled) or CPU (interpreted) tensors; got {q.device}")
    if q.numel() == 0:
        raise ValueError(f"q is empty (shape {tuple(q.shape)}); every dim must be at least 1")
    b, hq, nq, d = q.shape
    if k_cache.shape != v_cache.shape:
        shapes = f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        raise ValueError(f"k_cache and v_cache must have the same shape; got {shapes}")
    pages, page_size, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"the cache's head dim ({dk}) must equal q's ({d})")
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"head dim {d} is not supported: it must be a multiple of {HEAD_DIM_MULTIPLE} "
            f"between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}"
        )
    if hk < 1 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's key/value heads ({hk})")
    if cache_seqlens.shape[0] != b:
        got = tuple(cache_seqlens.shape)
        raise ValueError(f"cache_seqlens must have one length per sequence ({b}); got shape {got}")
    if block_table is None:
        if pages != b:
            raise ValueError(
                f"without a block table the cache is (B, Nk_max, Hk, D) with B = {b}; got shape {tuple(k_cache.shape)}"
            )
        capacity = page_size
    else:
        if block_table.shape[0] != b or block_table.shape[1] < 1:
            raise ValueError(f"block_table must be (B={b}, max_blocks >= 1); got shape {tuple(block_table.shape)}")
        if page_size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"the cache's block size ({page_size}) must be a multiple of {BLOCK_SIZE_MULTIPLE}")
        capacity = block_table.shape[1] * page_size
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its head dim (it is never copied); got {x.stride()}")
        if capacity * x.stride(1) >= 2**31 and block_table is None:
            raise ValueError(f"{name} is too long for 32-bit key offsets; use a block table")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    visible_band(nq, capacity, causal, window)  # ValueError for a malformed window
    check_scale(scale)
    return capacity, pages, page_size


def _check_values(cache_seqlens, block_table, capacity, pages, page_size):
    bad_len = (cache_seqlens < 0) | (cache_seqlens > capacity)  # (B,)
    bad_len_any = bad_len.any()
    if block_table is None:
        bad_entry = torch.zeros_like(bad_len_any)
    else:
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < (
            (cache_seqlens.clamp(min=0) + page_size - 1) // page_size
        )[:, None]  # (B, max_blocks): the entries a sequence's keys live in
        bad_entry = (((block_table < 0) | (block_table >= pages)) & used).any()
    flags = torch.stack([bad_len_any, bad_entry]).tolist()  # one synchronisation on a GPU
    if flags[0]:
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(
            f"cache_seqlens[{b}] = {int(cache_seqlens[b])} is outside [0, {capacity}], the keys the cache can hold"
        )
    if flags[1]:
        b, j = (int(x) for x in (((block_table < 0) | (block_table >= pages)) & used).nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a block of the cache (0 <= entry < {pages})"
        )


# ----------------------------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------------------------


# Set by flashlab.kernels.op: the registered operator, called instead of the launch while torch.compile traces.
TRACED_KVCACHE = None


def flash_attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table=None,
    causal=False,
    window=None,
    scale=None,
    return_lse=False,
    *,
    check_values=True,
):
    """Attention of new queries against a KV cache with per-sequence lengths, paged or not.

    q ``(B, Hq, Nq, D)`` (flashlab's layout: the Nq newest positions of each sequence, Nq = 1 for a decode step,
    up to a few hundred for a chunk of prefill). The cache, in the layout serving engines use:

    - with ``block_table`` ``(B, max_blocks)`` int32: ``k_cache``, ``v_cache`` ``(num_blocks, block_size, Hk, D)``;
      key j of sequence b is in block ``block_table[b, j // block_size]``, slot ``j % block_size``. Any block size
      that is a multiple of 16; blocks in any order, shared between sequences; entries past a sequence's last
      block are never read (they may hold anything, e.g. -1).
    - without: ``k_cache``, ``v_cache`` ``(B, Nk_max, Hk, D)``, sequence b in its own slab.

    ``cache_seqlens`` ``(B,)`` int32: the keys each sequence holds (its Nq newest included). ``causal`` and
    ``window`` follow ``flashlab.core.masking``, aligned to each sequence's own end: query i sees key j when
    ``seqlen_b - Nq + i - left <= j <= seqlen_b - Nq + i + right``. A sequence of length 0 gives zeros (lse -inf).
    Returns ``o`` like q, or ``(o, lse)`` with lse ``(B, Hq, Nq)`` float32 natural log-sum-exps.

    ``check_values`` reads the lengths and the block table's entries on the host to check them (a length outside
    ``[0, capacity]`` or an entry outside the pool is a ValueError); on a GPU that costs one synchronisation per
    call, which stalls a decode loop. A loop whose tables are known good passes False: the kernel itself never
    follows an entry outside the pool (those keys are left out) and clamps a length to ``[0, capacity]``.
    """
    args = (q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale)
    if torch.compiler.is_compiling():
        capacity = check_kvcache_inputs(*args, check_values=check_values)
        if TRACED_KVCACHE is not None:  # one opaque operator (flashlab.kernels.op)
            o, lse = TRACED_KVCACHE(*args, check_values)
            return (o, lse) if return_lse else o
        key = None
    else:
        key = call_signature(*args)
        plan = _PLANS.get(key) if key is not None else None
        # a plan exists only for a signature whose shapes passed: then only the values are left to check
        if plan is None or check_values is not False:
            capacity = check_kvcache_inputs(*args, check_values=check_values, key=key)
        if plan is not None:
            o, lse = run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, return_lse)
            return (o, lse) if return_lse else o
    o, lse = kvcache_forward(*args, capacity, need_lse=return_lse, key=key)
    return (o, lse) if return_lse else o


def call_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale):
    """What the checks and the plan of a call depend on (shapes, strides, dtypes, devices, mask, scale), hashable;
    None where it cannot be hashed exactly (then nothing is remembered for the call)."""
    if type(causal) is not bool or not (scale is None or type(scale) is float or type(scale) is int):
        return None
    if window is not None:
        if type(window) not in (tuple, list) or not all(w is None or type(w) is int for w in window):
            return None
        window = tuple(window)
    if not (type(q) is type(k_cache) is type(v_cache) is type(cache_seqlens) is torch.Tensor):
        return None
    if not (q.layout is k_cache.layout is v_cache.layout is cache_seqlens.layout is torch.strided):
        return None  # a sparse tensor has no strides to key on
    key = (causal, window, scale, type(scale), q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
           cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device)  # fmt: skip
    if block_table is None:
        return key
    if type(block_table) is not torch.Tensor or block_table.layout is not torch.strided:
        return None
    return (*key, block_table.shape, block_table.stride(), block_table.dtype, block_table.device)


class KVCachePlan:
    """What ``kvcache_forward`` decides for one call signature, once: the chunks, the grid, the scalar arguments
    and constexprs, the autotuner's pick, and the direct launch (``runtime.FastLaunch``, after one check against
    a JIT launch), as ``flashlab.kernels.split_kv.LaunchPlan`` does for contiguous decode."""

    __slots__ = ("negate", "o_shape", "lse_shape", "o_like_q", "direct", "num_splits", "parts", "d", "rows", "counters")
    __slots__ += ("copy_table", "copy_lengths")
    __slots__ += ("grid", "scalars", "tune", "meta", "fast", "fast_state", "views", "merge_here", "merge_grid")
    __slots__ += ("merge_args", "merge_meta", "merge_fast")

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, capacity, causal, window, scale):
        b, hq, nq, d = q.shape
        hk = k_cache.shape[2]
        group = hq // hk
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        self.negate = scale < 0  # the running max assumes max(s) * scale = max(s * scale): run -q with -scale
        q = launched_q(q, self.negate)  # the strides below are those of the tensor a launch runs on
        # the kernel reads the lengths and a table row at unit stride: other layouts are copied (they are tiny)
        self.copy_lengths = not cache_seqlens.is_contiguous()
        self.copy_table = block_table is not None and not block_table.is_contiguous()
        table = cache_seqlens if block_table is None else block_table  # never read without a block table
        if self.copy_table:
            table = table.contiguous()
        _, left, right = visible_band(nq, capacity, causal, window)
        big = nq + capacity + 1  # "unbounded": wider than any distance in the score matrix
        win_left = big if left == float("inf") else int(left)
        win_right = big if right == float("inf") else int(right)
        qk_scale = abs(float(scale)) * LOG2_E
        rows = group * nq
        block_m = split_kv.packed_block_m(rows)
        row_blocks = cdiv(rows, block_m)
        # Chunks cover the capacity, chosen without reading the lengths (no synchronisation, so a decode step can
        # be captured in a CUDA graph); a chunk past a sequence's end, or outside its window, exits at once.
        sms = sm_count(device_index(q)) if q.is_cuda else split_kv.CPU_SM_COUNT
        page_size = k_cache.shape[1] if block_table is not None else 0
        small_blocks = q.is_cuda and q.element_size() == 2 and 0 < page_size < SMALL_BLOCK_TOKENS
        num_splits = split_kv.choose_splits(b * hk * row_blocks, capacity, sms)
        tree = not small_blocks or num_splits > split_kv.MAX_FOLD_SPLITS
        if small_blocks and tree:  # more chunks than one program folds: the tree, at its registers' occupancy
            per_sm = SMALL_BLOCK_TREE_PROGRAMS_PER_SM
            num_splits = split_kv.choose_splits(b * hk * row_blocks, capacity, sms, programs_per_sm=per_sm)
        keys_per_split, num_splits = split_kv.split_keys(capacity, num_splits)
        self.o_shape, self.lse_shape, self.d = (b, hq, nq, d), (b, hq, nq), d
        self.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
        self.direct, self.num_splits = num_splits == 1, num_splits
        # scratch (split_kv.workspace): partial outputs and lse, an lse nobody asked for, the merge's counters
        self.parts, self.rows = b * hq * nq * num_splits, b * hq * nq
        self.views = None
        strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
        self.scalars = (q.stride(0), q.stride(1), q.stride(2))
        self.scalars += (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        self.scalars += (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        self.scalars += (table.stride(0), *strides_o)
        self.scalars += (hq, hk, group, nq, k_cache.shape[0], capacity, win_left, win_right, keys_per_split)
        self.scalars += (num_splits, qk_scale)
        self.tune = (next_power_of_2(capacity), next_power_of_2(b * hk * row_blocks * num_splits))
        self.meta = dict(
            HEAD_DIM=d,
            BLOCK_D=block_d(d),
            BLOCK_M=block_m,
            PAGE_SIZE=page_size,
            DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
            DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
        )
        if small_blocks:
            bn, warps, stages = SMALL_BLOCK_CONFIG
            self.meta.update(BLOCK_N=bn, num_warps=warps, num_stages=stages)
        split_kv.plan_merge(self, num_splits, b * hk * row_blocks, strides_o, hq, nq, d, tree=tree)
        self.grid = (num_splits, b * hk, row_blocks)
        self.fast, self.fast_state = None, "untried"


_PLANS: dict = {}  # call signature -> KVCachePlan
MAX_PLANS = 4096
PARTIAL_TENSORS = ("Q", "K", "V", "BLOCK_TABLE", "SEQLENS", "O_PART", "LSE_PART", "O", "LSE", "COUNTERS")


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, capacity, need_lse=True,
                    key=None):  # fmt: skip
    """Run the kernel on checked inputs; returns ``(o, lse)`` (lse None when ``need_lse`` is False: the kernel then
    writes it to scratch). Its decisions are planned once per call signature (``KVCachePlan``; ``key`` is
    ``call_signature``'s, when the caller has it), so a decode loop pays little more than its launch."""
    if key is None:
        key = call_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = KVCachePlan(q, k_cache, v_cache, cache_seqlens, block_table, capacity, causal, window, scale)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, need_lse)


def run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, need_lse):
    """``kvcache_forward`` for checked tensors of a planned signature: allocate the outputs and launch."""
    q = launched_q(q, plan.negate)
    if plan.copy_lengths:
        cache_seqlens = cache_seqlens.contiguous()
    table = cache_seqlens if block_table is None else block_table  # never read without a block table
    if plan.copy_table:
        table = table.contiguous()
    o = torch.empty_like(q) if plan.o_like_q else torch.empty(plan.o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    if not q.is_cuda:
        o_part, lse_part, spare, counters = split_kv.workspace(plan, q.device, 0)
        tensors = (q, k_cache, v_cache, table, cache_seqlens, o_part, lse_part, o, spare if lse is None else lse)
        with interpreted_language(softmax_step):
            args = (*tensors, counters, *plan.scalars, *plan.tune)
            interpreted(_kvcache_partial)[plan.grid](*args, **plan.meta, BLOCK_N=CPU_CONFIG["BLOCK_N"])
        if plan.merge_grid is not None:
            split_kv.merge(plan, o_part, lse_part, o, tensors[8])
        return o, lse
    if q.get_device() != current_device_index():
        with torch.cuda.device(q.device):
            _launch_cuda(plan, q, k_cache, v_cache, table, cache_seqlens, o, lse)
    else:
        _launch_cuda(plan, q, k_cache, v_cache, table, cache_seqlens, o, lse)
    return o, lse


def _launch_cuda(plan, q, k_cache, v_cache, table, cache_seqlens, o, lse):
    stream = current_stream(q.get_device())
    o_part, lse_part, spare, counters = split_kv.workspace(plan, q.device, stream)
    tensors = (q, k_cache, v_cache, table, cache_seqlens, o_part, lse_part, o, spare if lse is None else lse, counters)
    if plan.fast_state == "checked":  # the launchers directly: no binding, no specialisation, no cache lookup
        split_kv.launch_fast(plan, stream, tensors, 7)
        return
    args = (*tensors, *plan.scalars, *plan.tune)
    kernel = None
    if "num_warps" in plan.meta:
        kernel = _kvcache_partial[plan.grid](*args, **plan.meta)
    else:
        key = (o.device, o.dtype, plan.tune, *plan.meta.values())
        if key not in _BEST_CONFIG:
            _kvcache_partial_tuned[plan.grid](*args, **plan.meta)
            _BEST_CONFIG[key] = _kvcache_partial_tuned.best_config.all_kwargs()
        else:
            kernel = _kvcache_partial[plan.grid](*args, **plan.meta, **_BEST_CONFIG[key])
        plan.meta = {**plan.meta, **_BEST_CONFIG[key]}
    split_kv.after_jit_launch(plan, _kvcache_partial, kernel, args, stream, tensors, 7, PARTIAL_TENSORS)


def paged_kv_cache(k, v, block_size: int, lengths=None, seed: int = 0):
    """The keys and values of contiguous ``k``, ``v`` ``(B, Hk, N, D)`` copied into a paged pool, blocks shuffled:
    ``(k_cache, v_cache, block_table, cache_seqlens)`` with the pool ``(B * ceil(N / block_size), block_size, Hk,
    D)``, the block table ``(B, ceil(N / block_size))`` int32 (a random permutation of the pool's blocks) and the
    lengths ``(B,)`` int32 (``lengths``, default N for every sequence). For benchmarks and demonstrations; a
    serving engine writes its pool one token at a time instead."""
    b, hk, n, d = k.shape
    max_blocks = cdiv(n, block_size)
    perm = torch.randperm(b * max_blocks, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = perm.view(b, max_blocks).to(torch.int32)

    def pool(x):  # block i of sequence b goes to pool[table[b, i]]
        x = torch.nn.functional.pad(x, (0, 0, 0, max_blocks * block_size - n))  # (B, Hk, max_blocks * bs, D)
        x = x.permute(0, 2, 1, 3).reshape(b * max_blocks, block_size, hk, d)
        out = torch.empty_like(x)
        out[perm] = x
        return out

    lengths = [n] * b if lengths is None else list(lengths)
    return pool(k), pool(v), table, torch.tensor(lengths, dtype=torch.int32, device=k.device)


__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "SMALL_BLOCK_CONFIG",
    "SMALL_BLOCK_TOKENS",
    "TUNING_SPACE",
    "check_kvcache_inputs",
    "flash_attention_with_kvcache",
    "KVCachePlan",
    "call_signature",
    "kvcache_forward",
    "paged_kv_cache",
]
