"""Rung 3 of the kernel ladder, "Hopper": the band's key tiles in one loop, fed by the tensor-memory accelerator,
with the loads handed to warps of their own.

It computes what rung 2 (``rung2_skip_split``) computes: one program per tile of ``BLOCK_M`` query rows
of one head, only the key tiles inside the mask band visited, the online softmax in registers. What it changes is
how the tiles arrive and who waits for them:

- **TMA tensor descriptors, made on the device.** Q, K, V and O are each described as one 2-D tensor, the rows of
  all heads one after another, with ``tl.make_tensor_descriptor``; one instruction then copies a whole tile into
  shared memory, rows past the end of the tensor and columns past D arriving as zeros. No address arithmetic per
  element, no load masks, no registers spent on pointers.
- **A warp-specialised loop** (``tl.range(..., warp_specialize=True)``). With four-warp programs, Triton's Hopper
  pass splits the loop into a producer warpgroup that only issues the copies for the tiles ahead and two consumer
  warpgroups, 64 query rows each, that run the matrix products and the softmax; tiles are handed over through
  shared-memory buffers and barriers, and registers are moved from the producer to the consumers (``setmaxnreg``).

What that costs. The pass takes one loop with no branch in it, so rung 2's three stages (masked edge, unmasked
middle, masked edge) cannot stay: when the band has an edge at all (``MASK_LEFT``, ``MASK_RIGHT``), every tile gets
the element mask, two compares and a select per score. And a hidden key whose V row holds inf or NaN would reach its
whole tile through the plain ``P V`` (0 * inf is NaN), where rung 2 guards its edge tiles. Here the epilogue marks
every row whose output came out non-finite with a NaN lse (on finite inputs, none), and a second, short launch
(``_repair_flagged``) redoes the marked query tiles with the guard -- and, with nothing marked, only reads the lse and
returns.

The scale is folded into ``exp2`` (scores in log2 units), causal query tiles start with the longest
(``REVERSE_M``), GQA reads K/V head ``h // group`` without copying, as in rung 2.

Where it runs: compiled on a CUDA GPU with compute capability >= 9 (Hopper), 16-bit inputs whose heads are stacked
row after row (contiguous, 16-byte aligned rows: ``unavailable`` says why not otherwise). ``preferred`` says where
``flash_attention`` picks it by default: where it measured faster than rung 2. On CPU tensors the same source runs
through Triton's interpreter, descriptors and all (warp specialisation is a compiler schedule: the interpreter runs
the loop as written). What the compiler accepted and what it did not is in ``docs/forward-ladder.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import configs, softmax_step
from flashlab.kernels.device import (
    CPU_CONFIG,
    TMA_ALIGN_BYTES,
    TMA_MIN_CAPABILITY,
    block_d,
    device_index,
    dot_precision,
    dot_upcast,
    ensure_allocator,
    fits_smem,
    hidden_sides,
    rows_stacked,
    smem_limit,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language
from flashlab.kernels.ladder.rung2_skip_split import tune_key

NAME = "hopper"  # the rung's name in flashlab.kernels.ladder
MIN_CAPABILITY = TMA_MIN_CAPABILITY  # TMA and warp specialisation: Hopper (sm_90) or newer

# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


# Lengths and the band are runtime values (no binary per length); the strides stay specialised.
RUNTIME_LENGTHS = ("HQ", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "TUNE_KEY_N", "TUNE_KEY_ROWS",
                   "TUNE_KEY_BAND")  # fmt: skip
REPAIR_RUNTIME_LENGTHS = ("HQ", "GROUP", "NQ", "NK", "offset", "win_left", "win_right", "NUM_TILES", "M_TILES")


# fmt: off
@triton.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=RUNTIME_LENGTHS)
def _attn_fwd_hopper(
    Q, K, V, O, LSE,  # tensors: q, k, v, the output, the log-sum-exp
    stride_qb, stride_qh, stride_qm,  # strides (elements) of q over batch, head, row; D has stride 1
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HQ, GROUP, NQ, NK,  # query heads, query heads per K/V head, query and key lengths
    offset, win_left, win_right,  # the band: query i sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    TUNE_KEY_N, TUNE_KEY_ROWS, TUNE_KEY_BAND,  # only read by the autotuner (its cache key)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (the tile's width)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" on the interpreter; "tf32" (ignored for 16-bit inputs) on a GPU
    DOT_UPCAST: tl.constexpr,  # interpreter: feed 16-bit tiles to the dots as fp32 (NumPy has no bf16 matmul)
    REVERSE_M: tl.constexpr,  # causal: start the query tiles with the most work first
    MASK_LEFT: tl.constexpr,  # the window's left edge can cut a tile: mask keys before it
    MASK_RIGHT: tl.constexpr,  # the diagonal, the window's right edge or the end of the keys can cut a tile
    FLAG_NONFINITE: tl.constexpr,  # some tile holds keys a row must ignore: flag rows that came out non-finite
    EVEN_M: tl.constexpr,  # NQ is a multiple of every BLOCK_M: O goes out through the copy engine
    WARP_SPECIALIZE: tl.constexpr,  # the loads in warps of their own
):
    # fmt: on
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)  # (batch, query head); GQA: it reads K/V head (batch, h // GROUP), never copied

    # -- Q, K, V, O as 2-D tensors, the rows of every head one after another (``unavailable`` checks that the
    # strides allow it), which the copy engine reads and writes a tile at a time. Rows past the last head arrive as
    # zeros; a tile that runs past its own head reads the next head's first rows, which the mask hides (keys) or
    # nobody writes (queries). Built from each program's own head instead, or as 3-D/4-D tensors, the
    # warp-specialised loop failed to compile or came out wrong on Triton 3.6 (docs/forward-ladder.md).
    q_row0 = pid_bh * NQ  # this head's first row
    kv_row0 = (pid_bh // GROUP) * NK  # = (batch * HK + off_hk) * NK
    desc_q = tl.make_tensor_descriptor(Q, [tl.num_programs(1) * NQ, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D])
    desc_k = tl.make_tensor_descriptor(K, [tl.num_programs(1) // GROUP * NK, HEAD_DIM], [stride_kn, 1],
                                       [BLOCK_N, BLOCK_D])  # fmt: skip
    desc_v = tl.make_tensor_descriptor(V, [tl.num_programs(1) // GROUP * NK, HEAD_DIM], [stride_vn, 1],
                                       [BLOCK_N, BLOCK_D])  # fmt: skip
    desc_o = tl.make_tensor_descriptor(O, [tl.num_programs(1) * NQ, HEAD_DIM], [stride_om, 1], [BLOCK_M, BLOCK_D])

    row_lo = pid_m * BLOCK_M
    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)

    q = desc_q.load([q_row0 + row_lo, 0])  # kept for the whole loop
    if DOT_UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- the key tiles any row of this tile sees, from the band; tiles outside it are never loaded
    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    # each row's first and last visible key: the element mask is two compares against them
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)

    # One loop, with no branch in it: the warp-specialising compiler pass takes a single loop whose body is
    # straight-line code, so the edge tiles' mask is applied arithmetically, on every tile when the mask has an
    # edge at all (a tile every row sees passes it unchanged).
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([kv_row0 + start_n, 0])  # (BLOCK_N, BLOCK_D)
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASK_LEFT or MASK_RIGHT:
            visible = softmax_step.edge_visible(start_n + offs_n, first_key, last_key, MASK_LEFT, MASK_RIGHT)
            s = tl.where(visible, s * qk_scale, float("-inf"))
            p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([kv_row0 + start_n, 0])
        if DOT_UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # -- epilogue: normalise, write O (the copy engine drops the columns past D) and the lse
    o, lse = softmax_step.normalise(acc, m_i, l_i)
    if FLAG_NONFINITE:
        # A hidden key's inf or NaN in V reaches its whole tile through the plain P V (0 * inf is NaN). Such a
        # row is marked with a NaN lse; ``launch`` then has the repair pass redo its tile with the guard.
        row_bad = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), 1)
        lse = tl.where(row_bad > 0, float("nan"), lse)
    tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, lse, mask=offs_m < NQ)
    if EVEN_M:  # every tile lies inside its head: the copy engine writes it
        desc_o.store([q_row0 + row_lo, 0], o.to(O.dtype.element_ty))
    else:  # the last tile would spill into the next head's rows: masked stores
        offs_d = tl.arange(0, BLOCK_D)
        o_ptrs = O + (q_row0 + offs_m).to(tl.int64)[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_m < NQ)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=REPAIR_RUNTIME_LENGTHS, do_not_specialize_on_alignment=REPAIR_RUNTIME_LENGTHS)
def _repair_flagged(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    HQ, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
    NUM_TILES, M_TILES,  # query tiles of BLOCK_M rows in all, and per head
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,  # query tiles one program checks with one load
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """The repair pass: redo, with the guarded ``P V`` of the masked tiles, every query tile that has a row with a
    NaN lse (the main kernel's mark for a row that came out non-finite). Each program reads the lse of
    ``TILES_PER_PROGRAM`` query tiles at once and returns when none is marked -- the whole pass, on finite
    inputs. The marked tiles are redone key tile by key tile inside the band, each with the element mask."""
    pid = tl.program_id(0)
    tiles = pid * TILES_PER_PROGRAM + tl.arange(0, TILES_PER_PROGRAM)  # (T,)
    bh = tiles // M_TILES
    rows = (tiles % M_TILES)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # (T, BLOCK_M)
    ok = (tiles[:, None] < NUM_TILES) & (rows < NQ)
    marks = tl.load(LSE + bh[:, None].to(tl.int64) * NQ + rows, mask=ok, other=0.0)
    marked = tl.max(tl.where(marks != marks, 1, 0), 1)  # (T,) 1 where a row of the tile is marked
    if tl.max(marked, 0) == 0:
        return
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for i in range(TILES_PER_PROGRAM):
        tile = pid * TILES_PER_PROGRAM + i
        if (tl.sum(tl.where(tl.arange(0, TILES_PER_PROGRAM) == i, marked, 0), 0) > 0) & (tile < NUM_TILES):
            pid_bh = tile // M_TILES
            off_b = pid_bh // HQ
            off_h = pid_bh % HQ
            off_hk = off_h // GROUP
            q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
            v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
            o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
            row_lo = (tile % M_TILES) * BLOCK_M
            offs_m = row_lo + tl.arange(0, BLOCK_M)
            row_ok = offs_m < NQ
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0)  # fmt: skip
            if DOT_UPCAST:
                q = q.to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
            diag = offs_m + offset
            for start_n in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
                cols = start_n + offs_n
                kv_ok = (cols[:, None] < NK) & d_ok[None, :]
                k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
                v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
                if DOT_UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
                visible = softmax_step.band_mask(diag, cols, win_left, win_right, NK)
                s = tl.where(visible, s * qk_scale, float("-inf"))
                p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
                acc = softmax_step.accumulate_pv(acc * alpha[:, None], p.to(v.dtype), v, DOT_PRECISION)
                m_i = m_new
            o, lse = softmax_step.normalise(acc, m_i, l_i)
            tl.store(LSE + pid_bh.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)
            tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


# The repair pass's tiles: small, since it only runs for inputs with inf or NaN in hidden V rows.
REPAIR_CONFIG = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
REPAIR_TILES_PER_PROGRAM = 64  # query tiles whose marks one program reads in one load


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class, measured on the H200 (docs/forward-ladder.md).
# Four warps mean warp-specialised: the compiler adds a producer warpgroup for the loads and splits the 128 rows
# between two consumer warpgroups of 64 (384 threads in all), so the K/V ring needs only two stages: with three it
# ran at a fraction of the speed on Triton 3.6 (and came out NaN in an earlier version), so none has three. Eight
# warps are the same loop without the specialisation (Triton's Hopper pass takes four-warp programs only).
TUNING_SPACE = {
    "d<=64": [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3)],
    "d=128": [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3)],
    "d=256": [(64, 64, 4, 2), (64, 64, 8, 2)],
}
FALLBACK_SPACE = [(64, 64, 4, 2), (64, 32, 4, 2)]  # for GPUs with less shared memory, when no config above fits


def tuning_class(block_d: int) -> str:
    return "d<=64" if block_d <= 64 else ("d=128" if block_d == 128 else "d=256")


def _config(bm, bn, warps, stages):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": warps == WARP_SPECIALIZED_WARPS},
        num_warps=warps,
        num_stages=stages,
    )


WARP_SPECIALIZED_WARPS = configs.HOPPER_WARP_SPECIALIZED_WARPS  # the num_warps of a warp-specialised config


def prune_configs(configs, named_args, **kwargs):
    """Keep this head dim's configs whose Q tile plus pipelined K/V tiles fit the chip's shared memory."""
    bd = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs["BLOCK_D"]
    q = named_args["Q"]
    limit = smem_limit(device_index(q))

    def fits(bm, bn, warps, stages):
        # warp-specialised, the output tile is staged in shared memory too (measured: 197 KB at D = 128, 128 x 128)
        resident = 2 * bm if warps == WARP_SPECIALIZED_WARPS else bm
        return fits_smem(resident, 2 * bn, stages, bd, q.element_size(), limit)

    wanted = set(TUNING_SPACE[tuning_class(bd)])
    kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    kept = [c for c in kept if fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)]
    if not kept:
        small = [c for c in FALLBACK_SPACE if fits(*c)] or FALLBACK_SPACE[-1:]
        kept = [_config(*c) for c in small]
    return kept


hopper_fwd_tuned = triton.autotune(
    configs=[_config(*c) for c in sorted({c for configs in TUNING_SPACE.values() for c in configs})],
    key=["TUNE_KEY_N", "TUNE_KEY_ROWS", "TUNE_KEY_BAND", "HEAD_DIM", "MASK_LEFT", "MASK_RIGHT"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_attn_fwd_hopper)


# ----------------------------------------------------------------------------------------------------------------
# Where it runs, and the launch
# ----------------------------------------------------------------------------------------------------------------


def unavailable(q, k, v, causal, window) -> str | None:
    """Why this rung cannot run these inputs here, or None."""
    if q.dtype == torch.float32:
        return "it runs 16-bit inputs only (its dots are the tensor cores'); float32 goes to skip_split"
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"Triton {triton.__version__} has no device-side tensor descriptors (needs Triton >= 3.4)"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < MIN_CAPABILITY:
            return f"it needs a Hopper GPU or newer (compute capability >= {MIN_CAPABILITY}.0), not {major}.{minor}"
    if not all(rows_stacked(x) for x in (q, k, v)):  # the interpreter reads the same descriptors
        return "its copy engine reads q, k, v as rows of heads one after another (contiguous, 16-byte aligned)"
    return None


# Where the benchmark measured this rung faster than skip-and-split (H200, bf16, docs/forward-ladder.md): head dims
# 65-128 from 1K keys up. At D <= 64 and D = 256 skip-and-split was faster; below 1K the launch, not the loop, costs.
PREFERRED_BLOCK_D = 128
PREFERRED_MIN_KEYS = 1024


def preferred(q, k, v, causal, window) -> bool:
    """Whether ``flash_attention`` picks this rung by default for these inputs (see ``PREFERRED_BLOCK_D``)."""
    return (q.is_cuda and block_d(q.shape[-1]) == PREFERRED_BLOCK_D and k.shape[2] >= PREFERRED_MIN_KEYS
            and q.shape[2] >= PREFERRED_MIN_KEYS)  # fmt: skip


# Keys (query rows) per tile in every config (TUNING_SPACE): a key count that is a multiple of MAX_BLOCK_N needs no
# tail mask, a query count that is a multiple of MAX_BLOCK_M no masked store.
MAX_BLOCK_N = MAX_BLOCK_M = 128


def launch(q, k, v, o, lse, causal, window, band, config=None, warp_specialize=None):
    """Run the kernel once on prepared inputs, writing ``o (B, Hq, Nq, D)`` and ``lse (B, Hq, Nq)``.

    Inputs as ``rung2_skip_split.launch`` takes them (the host engine checks and prepares them). ``config``
    (a dict of BLOCK_M, BLOCK_N, num_warps, num_stages) fixes the tiles (None: the tuned table's,
    ``flashlab.kernels.configs.pick``, or with ``FLASHLAB_AUTOTUNE=1`` the autotuner's); ``warp_specialize`` (None:
    the config's, else on with four warps) turns the loop's warp specialisation on or off. CPU tensors run the
    interpreter with ``CPU_CONFIG``.

    Where some tile holds keys a row must ignore (the mask hides real keys, or the last key tile runs into the
    next head's rows), a second launch follows: the repair pass, which redoes only the query tiles this kernel
    marked (a row whose output came out inf or NaN, which on finite inputs none does) and otherwise returns at once.
    """
    why = unavailable(q, k, v, causal, window)
    if why is not None:
        raise RuntimeError(f"the hopper rung cannot run these inputs: {why}")
    if not rows_stacked(o):
        raise RuntimeError("the hopper rung writes o as rows of heads one after another: o must be contiguous")
    b, hq, nq, _ = q.shape
    scalars, tune, meta = arguments(q, k, v, o.stride()[:3], causal, window, band, q.is_cuda)
    args = (q, k, v, o, lse, *scalars, *tune)
    if not q.is_cuda:
        grid = (cdiv(nq, CPU_CONFIG["BLOCK_M"]), b * hq)
        with interpreted_language(softmax_step):  # no warps to specialise on the interpreter
            interpreted(_attn_fwd_hopper)[grid](*args, **meta, **CPU_CONFIG, WARP_SPECIALIZE=False)
    else:

        def grid(meta):
            return (cdiv(nq, meta["BLOCK_M"]), b * hq)

        ensure_allocator()
        if config is None and not configs.autotune_enabled():  # the tuned table's (flashlab.kernels.configs)
            config = configs.pick("hopper", **configs.launch_fields(q, k.shape[1], k.shape[2], *band[:3]))
        with torch.cuda.device(q.device):
            if config is None:
                hopper_fwd_tuned[grid](*args, **meta)
            else:
                if warp_specialize is None:
                    warp_specialize = config.get("WARP_SPECIALIZE", config["num_warps"] == WARP_SPECIALIZED_WARPS)
                config = {**config, "WARP_SPECIALIZE": bool(warp_specialize)}
                _attn_fwd_hopper[grid](*args, **meta, **config)
    if meta["FLAG_NONFINITE"]:  # redo the tiles with a row marked non-finite (none, on finite inputs)
        repair(args[:-3], q, meta)


def arguments(q, k, v, strides_o, causal, window, band, is_cuda):
    """The kernel's arguments after its five tensors: ``(scalars, tune, meta)`` -- the strides (o's are
    ``strides_o``), sizes and band, the autotuner's key, and the constexprs."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    left, right = hidden_sides(nq, nk, band)
    scalars = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    scalars += (v.stride(0), v.stride(1), v.stride(2), *strides_o)
    scalars += (hq, hq // hk, nq, nk, offset, win_left, win_right, qk_scale)
    tile_n = MAX_BLOCK_N if is_cuda else CPU_CONFIG["BLOCK_N"]
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d(d),
        DOT_PRECISION=dot_precision(q.dtype, is_cuda),
        DOT_UPCAST=dot_upcast(q.dtype, is_cuda),
        REVERSE_M=bool(causal),
        MASK_LEFT=left,
        MASK_RIGHT=right or nk % tile_n != 0,  # the last tile's keys past the end of K are masked too
        # the keys a row must ignore: those the band hides, and past the end of K the next head's first rows
        FLAG_NONFINITE=left or right or nk % tile_n != 0,
        EVEN_M=nq % MAX_BLOCK_M == 0,
    )
    return scalars, tune_key(b, hq, nq, nk, causal, window), meta


def repair_shape(q, meta, is_cuda):
    """The repair pass's ``(extra arguments, grid, meta)``: its query tiles (all, and per head), one program per
    ``REPAIR_TILES_PER_PROGRAM`` of them, and the main kernel's constexprs it shares."""
    b, hq, nq, _ = q.shape
    config = REPAIR_CONFIG if is_cuda else CPU_CONFIG
    m_tiles = cdiv(nq, config["BLOCK_M"])
    num_tiles = b * hq * m_tiles
    rmeta = {key: meta[key] for key in ("HEAD_DIM", "BLOCK_D", "DOT_PRECISION", "DOT_UPCAST")}
    rmeta |= dict(TILES_PER_PROGRAM=REPAIR_TILES_PER_PROGRAM, **config)
    return (num_tiles, m_tiles), (cdiv(num_tiles, REPAIR_TILES_PER_PROGRAM),), rmeta


TENSOR_NAMES = ("Q", "K", "V", "O", "LSE")  # the kernels' five tensor parameters, as FastLaunch names them


def aligned(x: torch.Tensor) -> bool:
    """Whether ``x`` starts where the copy engine can read it (a call signature does not include addresses)."""
    return x.data_ptr() % TMA_ALIGN_BYTES == 0


def repair(args, q, meta) -> None:
    """Launch the repair pass (``_repair_flagged``) over the output of a main launch with ``args``."""
    tiles, grid, rmeta = repair_shape(q, meta, q.is_cuda)
    if not q.is_cuda:
        with interpreted_language(softmax_step):
            interpreted(_repair_flagged)[grid](*args, *tiles, **rmeta)
        return
    with torch.cuda.device(q.device):
        _repair_flagged[grid](*args, *tiles, **rmeta)


def repair_parts(q, k, v, strides_o, causal, window, band, strides=None):
    """The repair pass over another kernel's output ``o`` (strides ``strides_o``) and lse, for one call signature:
    ``(kernel, grid, arguments after the five tensors, constexprs)``. How rung 4, whose programs cannot redo a
    tile, gets its non-finite rows redone. ``strides``: q's, k's and v's ``stride()``, where the caller has them.

    Chunked prefill plans this for new lengths on every call, so it is worked out from integers here: the same
    arguments as ``arguments`` and ``repair_shape`` give (a test checks they agree), the constexprs kept per head
    dim and dtype."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    qs, ks, vs = strides or (q.stride(), k.stride(), v.stride())
    scalars = (*qs[:3], *ks[:3], *vs[:3], *strides_o, hq, hq // hk, nq, nk, *band)
    m_tiles = cdiv(nq, REPAIR_CONFIG["BLOCK_M"])
    num_tiles = b * hq * m_tiles
    rmeta = _REPAIR_METAS.get((d, q.dtype))
    if rmeta is None:
        rmeta = _REPAIR_METAS[(d, q.dtype)] = repair_shape(q, arguments(q, k, v, strides_o, causal, window, band,
                                                                        is_cuda=True)[2], True)[2]  # fmt: skip
    return _repair_flagged, (cdiv(num_tiles, REPAIR_TILES_PER_PROGRAM),), (*scalars, num_tiles, m_tiles), rmeta


_REPAIR_METAS = {}  # (head dim, dtype) -> the repair pass's constexprs on a GPU (repair_shape's)



hopper_fwd = _attn_fwd_hopper
repair_flagged = _repair_flagged

__all__ = [
    "FALLBACK_SPACE",
    "MIN_CAPABILITY",
    "NAME",
    "REPAIR_RUNTIME_LENGTHS",
    "RUNTIME_LENGTHS",
    "TUNING_SPACE",
    "hopper_fwd",
    "hopper_fwd_tuned",
    "aligned",
    "arguments",
    "ensure_allocator",
    "launch",
    "prune_configs",
    "repair",
    "repair_shape",
    "repair_flagged",
    "repair_parts",
    "TENSOR_NAMES",
    "tuning_class",
    "preferred",
    "unavailable",
]
