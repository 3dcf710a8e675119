"""Split-KV attention (Flash-Decoding): the decode-time path of ``flashlab.flash_attention``, in one Triton kernel
launch.

At decode a sequence offers one query row (or a few) per head. The prefill kernel (``ladder.rung2_skip_split``)
gives each program a tile of query rows, so decode would leave it ``B * Hq`` programs that each walk the whole KV
cache alone: too few to fill a GPU's 132 SMs, and with grouped-query attention every K/V head is read once per query
head that shares it. ``_split_kv_partial`` fixes both:

1. One program per (key chunk, batch entry, K/V head). Its query tile packs every query row of the query heads
   that share that K/V head (``GROUP * Nq`` rows), so each K/V tile is read from memory once, and the keys are cut
   into ``num_splits`` chunks that run side by side. Each program runs the same online softmax as the prefill
   kernel over its chunk and writes a partial output and its log-sum-exp.
2. The merge: the chunks' partial outputs are combined, weighted by ``exp(lse_chunk - lse_total)`` -- the
   log-sum-exp merge of ``flashlab.reference.merge_partials``, which is the float64 reference for this step
   (notebook 06 does it by hand). No second kernel does it: every program counts itself finished on a counter
   of its group of ``TREE_GROUP`` chunks (an atomic add); the last of a group to finish merges the group
   (``softmax_step.merge_chunks``), and the last group to finish merges the groups. So a decode step is one
   launch, whose host time is most of a short step's time.

Bytes: each K/V element is read once (plus a partial output of ``GROUP * Nq * D`` floats per chunk, written and
read back once), so decode runs at the speed the KV cache can be streamed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv, next_power_of_2
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.device import (
    CPU_CONFIG,
    block_d,
    device_index,
    dot_precision,
    dot_upcast,
    fits_smem,
    sm_count,
    smem_limit,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language

# The split path is taken automatically when a sequence has at most this many query rows (decode, speculative
# decoding's few draft tokens); longer queries give the prefill kernel enough programs on their own.
MAX_SPLIT_QUERY_ROWS = 16
# A chunk never holds fewer keys than this (a multiple of every BLOCK_N below, one tile of the largest), so its
# fixed cost (loading the query tile, writing a partial output) stays small next to streaming its keys.
MIN_KEYS_PER_SPLIT = 128
# Largest number of chunks (the merge kernel holds one log-sum-exp per chunk in a single tile).
MAX_SPLITS = 256
# The chunks are merged in the partial kernel's own launch (softmax_step.finish_chunk), as a two-level tree of
# groups of TREE_GROUP chunks: on the H200 at 128K keys and B = 1 (49 chunks) one launch with the tree took 141-143
# us where a second merge kernel's launch made it 145, and a one-level fold of all 49 in one program 148.
TREE_GROUP = 8
# A kernel whose registers the tree would push past PROGRAMS_PER_SM programs an SM (the paged kernel with 16-token
# blocks: 196 registers against 160) folds its chunks in one level instead, up to this many (one program merging
# more waits on too many loads in a row); a plan with more takes the tree at the occupancy its registers allow
# (kvcache.SMALL_BLOCK_TREE_PROGRAMS_PER_SM).
MAX_FOLD_SPLITS = 16
# Programs one SM holds at once with the decode configs (a 64-key tile, two stages: ~70 KB of shared memory of
# 228 KB). The chunks are chosen so the grid fills these slots once and evenly: on the H200 a grid one program
# per SM short of a multiple of them lost up to 10% against one that filled them (docs/decode.md).
PROGRAMS_PER_SM = 3
CPU_SM_COUNT = 4  # what the CPU path pretends to have: long caches still get several chunks, so they are tested


# Lengths, the band and the chunking are runtime values: a new cache length never compiles another binary (Triton
# would otherwise specialise an integer that is 1 or divisible by 16; some Tritons tie the second to the alignment
# flag, so both are set). The strides stay specialised: whether each is divisible by 16 (aligned vector loads) is
# part of the host engine's plan key. The lse pointers and the counters
# are read and written one element a row, so their alignment is not specialised either.
RUNTIME_LENGTHS = ("HQ", "HK", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "keys_per_split", "NUM_SPLITS",
                   "TUNE_KEY_N", "TUNE_KEY_UNITS")  # fmt: skip
UNALIGNED_POINTERS = ("LSE_PART", "LSE", "COUNTERS")


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=RUNTIME_LENGTHS + UNALIGNED_POINTERS)
def _split_kv_partial(
    Q, K, V, O_PART, LSE_PART,  # q, k, v; the partial outputs (fp32) and log-sum-exps (log2 units) per chunk
    O, LSE,  # the output and its lse: written by the one chunk (DIRECT) or by the last chunk to finish
    COUNTERS,  # int32, one per (batch entry, K/V head, row block): chunks finished; zero between launches
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HQ, HK, GROUP, NQ, NK,  # query heads, K/V heads, query heads per K/V head, query and key lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    keys_per_split, NUM_SPLITS,  # each chunk's keys: [split * keys_per_split, (split + 1) * keys_per_split)
    qk_scale,  # softmax scale * log2(e)
    TUNE_KEY_N, TUNE_KEY_UNITS,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two
    BLOCK_M: tl.constexpr,  # packed query rows per program: (query head in the group, query position)
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    DOT_UPCAST: tl.constexpr,  # interpreter: feed 16-bit tiles to the dots as fp32
    DIRECT: tl.constexpr,  # one chunk: normalise and write O and LSE, no partials, no counter
    MERGE_HERE: tl.constexpr,  # several chunks: the last to finish merges them
    MERGE_GROUP: tl.constexpr,  # chunks per group of the merge's tree; 0: one level (softmax_step.finish_chunk)
):
    # fmt: on
    pid_s = tl.program_id(0)  # which chunk of keys
    pid_bk = tl.program_id(1)  # which (batch entry, K/V head)
    pid_m = tl.program_id(2)  # which block of packed rows (only > 0 when GROUP * NQ > BLOCK_M)
    off_b = pid_bk // HK
    off_hk = pid_bk % HK

    # -- packed rows: row r is query position r % NQ of query head off_hk * GROUP + r // NQ
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * NQ
    qi = rows % NQ  # (BLOCK_M,) query position
    off_h = off_hk * GROUP + rows // NQ  # (BLOCK_M,) query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # -- load the packed Q tile once: GROUP * NQ * D * bytes(dtype), every query that shares this K/V head
    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + off_h[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_ptrs + qi[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running output

    # -- this chunk's keys, cut down to the band of the query positions in this block (tiles outside: not loaded)
    r_lo = pid_m * BLOCK_M
    r_hi = tl.minimum(r_lo + BLOCK_M, GROUP * NQ) - 1
    one_head = r_lo // NQ == r_hi // NQ  # the block holds one query head: positions r_lo % NQ .. r_hi % NQ
    qi_lo = tl.where(one_head, r_lo % NQ, 0)
    qi_hi = tl.where(one_head, r_hi % NQ, NQ - 1)
    split_lo = pid_s * keys_per_split  # a multiple of BLOCK_N
    lo = tl.maximum(split_lo, qi_lo + offset - win_left)
    hi = tl.minimum(tl.minimum(split_lo + keys_per_split, NK), qi_hi + offset + win_right + 1)
    lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    diag = qi + offset  # (BLOCK_M,) key on each row's diagonal
    # keys every row of the block sees: a tile inside [full_lo, full_hi) hides no key from any row, so its P V is a
    # plain dot; only the band's edge tiles pay for ignoring non-finite V rows that a row cannot see
    full_lo = qi_hi + offset - win_left
    full_hi = tl.minimum(qi_lo + offset + win_right + 1, hi)

    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # -- K tile: BLOCK_N * D * bytes(dtype), read once for all GROUP query heads
        k = tl.load(
            k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None] & (cols[None, :] < hi), other=0.0
        )  # (BLOCK_D, BLOCK_N)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        visible = softmax_step.band_mask(diag, cols, win_left, win_right, hi)  # (BLOCK_M, BLOCK_N)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        # -- V tile: BLOCK_N * D * bytes(dtype)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=(cols[:, None] < hi) & d_ok[None, :], other=0.0
        )  # (BLOCK_N, BLOCK_D)
        if DOT_UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        p = p.to(Q.dtype.element_ty)  # P enters the second dot in the input dtype, as in the prefill kernel
        if (start_n >= full_lo) & (start_n + BLOCK_N <= full_hi):
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            acc = softmax_step.accumulate_pv(acc, p.to(v.dtype), v, DOT_PRECISION)  # hidden keys add nothing
        m_i = m_new

    # -- the answer (one chunk), or this chunk's partial result, merged by the chunks' last finishers
    out = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + qi.to(tl.int64) * stride_om
    first = ((off_b * HQ + off_h) * NQ + qi).to(tl.int64) * NUM_SPLITS  # (BLOCK_M,) each row's chunk 0
    block = pid_bk * tl.num_programs(2) + pid_m  # this block of rows' merge counters
    softmax_step.finish_chunk(acc, m_i, l_i, out, LSE + (off_b * HQ + off_h) * NQ + qi, row_ok, offs_d, d_ok, O_PART,
                              LSE_PART, first, COUNTERS, block, pid_s, NUM_SPLITS, HEAD_DIM, BLOCK_M, BLOCK_D, DIRECT,
                              MERGE_HERE, MERGE_GROUP)


# ----------------------------------------------------------------------------------------------------------------
# Configs and the choice of chunks
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages): decode streams K/V, so what matters is keeping enough loads in flight.
TUNING_SPACE = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3)]
FP32_TUNING_SPACE = [(32, 4, 2), (64, 4, 2)]
# Chunks start at multiples of the largest BLOCK_N, so no key tile straddles two chunks.
KEY_ALIGN = max(bn for bn, _, _ in TUNING_SPACE + FP32_TUNING_SPACE)


def _config(bn, warps, stages):
    return triton.Config({"BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def prune_configs(configs, named_args, **kwargs):
    """This dtype's configs whose Q tile and pipelined K/V tiles fit the chip's shared memory."""
    meta = {**named_args, **kwargs}
    q, bm, bd = meta["Q"], meta["BLOCK_M"], meta["BLOCK_D"]
    limit = smem_limit(device_index(q))
    space = set(FP32_TUNING_SPACE if q.element_size() == 4 else TUNING_SPACE)
    kept = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in space]
    fits = [c for c in kept if fits_smem(bm, 2 * c.kwargs["BLOCK_N"], c.num_stages, bd, q.element_size(), limit)]
    return fits or [_config(32, 4, 1)]


def tuning_configs():
    """Every config a split-KV partial kernel is autotuned over (``prune_configs`` keeps those for the dtype)."""
    return [_config(*c) for c in sorted(set(TUNING_SPACE) | set(FP32_TUNING_SPACE) | {(32, 4, 1)})]


split_kv_partial_tuned = triton.autotune(
    configs=tuning_configs(),
    key=["TUNE_KEY_N", "TUNE_KEY_UNITS", "HEAD_DIM", "BLOCK_M", "DOT_PRECISION", "DIRECT", "MERGE_HERE", "MERGE_GROUP"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_split_kv_partial)


def choose_splits(units: int, band_keys: int, sm_count: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """How many key chunks to cut a decode step into.

    ``units``: programs the grid has without splitting (batch entries x K/V heads x packed-row blocks);
    ``band_keys``: how many keys the queries can see at most. As many chunks as fit ``programs_per_sm`` programs
    per SM in one wave (rounded down: a wave that spills over leaves most SMs idle at its end), but none shorter
    than ``MIN_KEYS_PER_SPLIT`` keys, at least one and at most ``MAX_SPLITS``.
    """
    if units < 1 or band_keys < 1 or sm_count < 1 or programs_per_sm < 1:
        raise ValueError(
            f"units, band_keys, sm_count and programs_per_sm must be >= 1; got {units}, {band_keys}, {sm_count}, "
            f"{programs_per_sm}"
        )
    wanted = programs_per_sm * sm_count // units
    most = cdiv(band_keys, MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, most, MAX_SPLITS))


def packed_block_m(rows: int) -> int:
    """Packed query rows per program for ``rows = GROUP * Nq`` packed rows: a power of two in [16, 64]."""
    return min(64, max(16, next_power_of_2(rows)))


def split_keys(nk: int, num_splits: int) -> tuple[int, int]:
    """``(keys_per_split, num_splits)``: chunks of ``nk`` keys starting at multiples of ``KEY_ALIGN``, with the
    chunks that would start past the last key dropped."""
    keys_per_split = cdiv(cdiv(nk, num_splits), KEY_ALIGN) * KEY_ALIGN
    return keys_per_split, cdiv(nk, keys_per_split)


class Merge(NamedTuple):
    """How the chunks of one launch are merged: the constexprs the partial kernel takes for it and the int32
    counters it needs in scratch (zero between launches)."""

    constexprs: dict  # DIRECT, MERGE_HERE, MERGE_GROUP
    counters: int


def merge_arguments(num_splits: int, blocks: int, tree: bool = True) -> Merge:
    """The merge of ``num_splits`` chunks for ``blocks`` blocks of rows: none (``DIRECT``, one chunk), else in the
    kernel (``MERGE_HERE``) by the chunks' last finishers, as a tree of ``TREE_GROUP``-chunk groups or, with
    ``tree`` False, folded in one level (at most ``MAX_FOLD_SPLITS`` chunks: a plan with more takes the tree)."""
    if not tree and num_splits > MAX_FOLD_SPLITS:
        raise ValueError(f"a one-level fold merges at most {MAX_FOLD_SPLITS} chunks; got {num_splits}")
    group = TREE_GROUP if tree else 0
    direct = num_splits == 1
    constexprs = dict(DIRECT=direct, MERGE_HERE=not direct, MERGE_GROUP=group)
    return Merge(constexprs, blocks * softmax_step.merge_counters(num_splits, group))


def unwindowed_chunks(nk: int, wanted: int) -> tuple[int, int]:
    """``(num_splits, keys_per_split)`` that ``SplitArguments`` chooses for ``nk`` keys under no window (causal or
    not), ``wanted`` the most chunks the chip wants for the launch (``SplitArguments.fixed[1]``): every key is then
    visible to some query, so the chunking reads ``nk`` alone. A growing cache's step works it out from two
    integers (tests check it against ``SplitArguments``)."""
    num_splits = (nk + MIN_KEYS_PER_SPLIT - 1) // MIN_KEYS_PER_SPLIT
    if num_splits > wanted:
        num_splits = wanted if wanted > 1 else 1
    keys_per_split = ((nk + num_splits - 1) // num_splits + KEY_ALIGN - 1) // KEY_ALIGN * KEY_ALIGN
    return (nk + keys_per_split - 1) // keys_per_split, keys_per_split


class SplitArguments:
    """The arguments of one split-KV launch, from a call's shapes, strides and band: the chunks, the grid, the
    scalar arguments after the tensors (``scalars``, then the autotuner's key ``tune``), the constexprs
    (``meta``) and the scratch it takes (``parts`` partial rows of ``d`` floats and their lse, ``rows`` spare lse
    floats for an lse nobody asked for, ``counters`` int32 merge counters).

    ``relength`` gives the arguments of the same launch over another number of keys (a decode step against a cache
    one token longer) from integers alone: what depends on q, the heads and the dtype is worked out once."""

    __slots__ = ("num_splits", "direct", "parts", "d", "rows", "counters", "grid", "scalars", "tune", "meta",
                 "fixed", "metas")  # fmt: skip

    def __init__(self, q, k, v, o, offset, win_left, win_right, qk_scale, num_splits):
        b, hq, nq, d = q.shape
        hk = k.shape[1]
        group = hq // hk
        rows = group * nq
        block_m = packed_block_m(rows)
        sms = sm_count(device_index(q)) if q.is_cuda else CPU_SM_COUNT
        self.d = d
        # what no length changes: the programs without splitting and the most chunks the chip wants for them
        # (choose_splits), the rows, the grid's other dims, q's strides, o's strides and the heads, nq
        row_blocks = cdiv(rows, block_m)
        units = b * hk * row_blocks
        self.fixed = (units, min(PROGRAMS_PER_SM * sms // units, MAX_SPLITS), b * hq * nq, (b * hk, row_blocks),
                      (*q.stride()[:3],), (*o.stride()[:3], hq, hk, group, nq), nq)  # fmt: skip
        self.metas = {}  # chunks -> (the whole meta dict, with the merge's constexprs; the merge's counters)
        precision, upcast = dot_precision(q.dtype, q.is_cuda), dot_upcast(q.dtype, q.is_cuda)
        self.meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=block_m, DOT_PRECISION=precision, DOT_UPCAST=upcast)
        self._lengths(k.stride(), v.stride(), k.shape[2], offset, win_left, win_right, qk_scale, num_splits)

    def relength(self, k_strides, v_strides, nk, offset, win_left, win_right, qk_scale, num_splits):
        """These arguments for k and v of ``nk`` keys with strides ``k_strides``, ``v_strides`` (``x.stride()``),
        the band and scale as ``kernel_band`` gives them for ``nk``: a new object; q, o, the heads, the dtype and
        the device are this one's."""
        new = SplitArguments.__new__(SplitArguments)
        new.d, new.fixed, new.metas = self.d, self.fixed, self.metas
        new.meta = self.meta
        new._lengths(k_strides, v_strides, nk, offset, win_left, win_right, qk_scale, num_splits)
        return new

    def _lengths(self, k_strides, v_strides, nk, offset, win_left, win_right, qk_scale, num_splits):
        # choose_splits, split_keys and merge_arguments, worked out inline: this runs on every decode step of a
        # growing cache, where each Python call costs a share of a launch (tests check they agree)
        units, wanted, rows, grid_tail, q_strides, o_and_heads, nq = self.fixed
        # keys any query can see: the band of query 0's left edge to query nq-1's right edge, within [0, nk)
        band_keys = min(nk, nq + offset + win_right) - max(0, offset - win_left)
        if num_splits is None:
            num_splits = min(wanted, (band_keys + MIN_KEYS_PER_SPLIT - 1) // MIN_KEYS_PER_SPLIT) if band_keys > 0 else 1
            if num_splits < 1:
                num_splits = 1
        # split_keys: chunks of whole KEY_ALIGN groups; those that would start past the last key dropped
        keys_per_split = ((nk + num_splits - 1) // num_splits + KEY_ALIGN - 1) // KEY_ALIGN * KEY_ALIGN
        num_splits = (nk + keys_per_split - 1) // keys_per_split
        self.num_splits, self.direct = num_splits, num_splits == 1
        # scratch: partial outputs (b, hq, nq, num_splits, d), their log-sum-exps, then room for an lse the caller
        # did not ask for; the merge's counters for every block of rows
        self.parts, self.rows = rows * num_splits, rows
        self.grid = (num_splits, *grid_tail)
        self.scalars = (*q_strides, k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1],
                        v_strides[2], *o_and_heads, nk, offset, win_left, win_right, keys_per_split, num_splits,
                        qk_scale)  # fmt: skip
        self.tune = (1 << (nk - 1).bit_length(), 1 << (units * num_splits - 1).bit_length())  # next powers of two
        merged = self.metas.get(num_splits)
        if merged is None:
            merge = merge_arguments(num_splits, units)
            merged = self.metas[num_splits] = ({**self.meta, **merge.constexprs}, merge.counters)
        self.meta, self.counters = merged


def fresh_workspace(args, device):
    """``(o_part, lse_part, spare_lse, counters)`` for one launch with ``args`` (``SplitArguments`` or the KV-cache
    kernel's), newly allocated: what a plain launch uses (a planned one takes the stream's kept scratch)."""
    work = torch.empty(args.parts * (args.d + 1) + args.rows, dtype=torch.float32, device=device)
    end = args.parts * args.d
    counters = torch.zeros(args.counters, dtype=torch.int32, device=device)
    return work[:end], work[end : end + args.parts], work[end + args.parts :], counters


PARTIAL_TENSORS = ("Q", "K", "V", "O_PART", "LSE_PART", "O", "LSE", "COUNTERS")  # the kernel's tensor parameters


def launch(q, k, v, o, lse, offset, win_left, win_right, qk_scale, num_splits=None) -> int:
    """Run the split-KV kernel once on prepared inputs (unit stride along D, q negated for a negative scale, the
    band and ``qk_scale`` as ``flashlab.kernels.device.kernel_band`` gives them): writes ``o`` and ``lse``; returns
    the number of chunks. ``num_splits=None`` picks it with ``choose_splits``. With one chunk the kernel writes
    ``o`` and ``lse`` itself; with more, the chunks' last finishers merge them in the same launch. On a GPU the
    tiles come from ``flashlab.kernels.configs.pick`` (``FLASHLAB_AUTOTUNE=1``: the autotuner's pick)."""
    args = SplitArguments(q, k, v, o, offset, win_left, win_right, qk_scale, num_splits)
    o_part, lse_part, _, counters = fresh_workspace(args, q.device)
    tensors = (q, k, v, o_part, lse_part, o, lse, counters)
    if not q.is_cuda:
        with interpreted_language(softmax_step):
            interpreted(_split_kv_partial)[args.grid](*tensors, *args.scalars, *args.tune, **args.meta,
                                                      BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip
    else:
        with torch.cuda.device(q.device):
            if configs.autotune_enabled():
                split_kv_partial_tuned[args.grid](*tensors, *args.scalars, *args.tune, **args.meta)
            else:  # the tuned table's config for this bucket (flashlab.kernels.configs)
                fields = configs.launch_fields(q, k.shape[1], k.shape[2], offset, win_left, win_right)
                config = configs.pick("split_kv", **fields)
                _split_kv_partial[args.grid](*tensors, *args.scalars, *args.tune, **args.meta, **config)
    return args.num_splits


split_kv_partial = _split_kv_partial
# every scalar parameter after the tensors, in order: what SplitArguments.scalars + tune passes
_NAMES = split_kv_partial.arg_names
SCALAR_PARAMETERS = tuple(_NAMES[len(PARTIAL_TENSORS) : _NAMES.index("HEAD_DIM")])

__all__ = [
    "CPU_SM_COUNT",
    "RUNTIME_LENGTHS",
    "SCALAR_PARAMETERS",
    "UNALIGNED_POINTERS",
    "KEY_ALIGN",
    "MAX_FOLD_SPLITS",
    "MAX_SPLITS",
    "MAX_SPLIT_QUERY_ROWS",
    "MIN_KEYS_PER_SPLIT",
    "Merge",
    "PARTIAL_TENSORS",
    "PROGRAMS_PER_SM",
    "SplitArguments",
    "TREE_GROUP",
    "choose_splits",
    "fresh_workspace",
    "launch",
    "merge_arguments",
    "packed_block_m",
    "prune_configs",
    "split_keys",
    "split_kv_partial",
    "split_kv_partial_tuned",
    "tuning_configs",
]
