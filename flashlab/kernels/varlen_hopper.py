"""Packed variable-length attention on Hopper: the varlen forward with its tiles copied by the tensor-memory
accelerator and its loop warp-specialised, as the ladder's rung 3 (``flashlab.kernels.ladder.rung3_hopper``) does
for one sequence.

It computes what ``flashlab.kernels.varlen``'s kernel computes (the float64 reference of each sequence, the same
layout: q ``(total_q, Hq, D)``, k and v ``(total_k, Hk, D)``, ``cu_seqlens``); what changes is how tiles arrive.

- **Descriptors cut at the sequence's end.** Each program describes q, k, v and o as 2-D tensors of packed rows by
  ``heads * D`` columns, its head's tile at column ``head * D``, and gives each descriptor as many rows as reach
  its own sequence's end (``cu_seqlens[b + 1]``). The copy engine then fills a key tile's rows past the sequence
  with zeros (the next sequence's keys, and whatever their values hold, never enter a product) and drops an output
  tile's rows past it (the next sequence's rows are never written). Nothing is masked by hand but the scores at
  the band's edges, so the loop is one straight-line body that Triton's warp-specialising pass can split into a
  producer of copies and consumers of products.
- **A grid of the tiles that exist.** Instead of every sequence cut for the longest one (most programs of a
  long-tailed batch would find nothing to do), program ``slot`` of a head finds its sequence on the device:
  sequence b's query tiles sit at slots ``cu_seqlens_q[b] // BLOCK_M + b`` onwards, which leaves room for every
  tile and at most one empty slot a sequence, ``cdiv(total_q, BLOCK_M) + B`` slots in all, known on the host
  without reading the lengths.

Where it runs: a Hopper GPU (or the interpreter), 16-bit inputs, head dims 64 and 128 (a tile's columns are one
head's), rows 16-byte aligned and unit stride along D. ``unavailable`` says why not otherwise; the pointer kernel
of ``flashlab.kernels.varlen`` runs everything else.
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
    dot_precision,
    dot_upcast,
    ensure_allocator,
)
from flashlab.kernels.interpreter import interpreted, interpreted_language
from flashlab.kernels.ladder import rung3_hopper

HEAD_DIMS = (64, 128)  # a tile's columns are exactly one head's: the descriptor's column offset is head * D
CU_BLOCK = 256  # boundaries a program reads a step while it finds its sequence
RUNTIME = ("HQ", "GROUP", "TOTAL_Q", "TOTAL_K", "B", "win_left", "win_right")


# fmt: off
@triton.jit(do_not_specialize=RUNTIME, do_not_specialize_on_alignment=RUNTIME)
def _attn_fwd_varlen_hopper(
    Q, K, V, O, LSE,  # q (total_q, Hq, D), k and v (total_k, Hk, D), the output like q, lse (Hq, total_q)
    CU_Q, CU_K,  # int32 (B + 1,): sequence b owns rows CU_Q[b]:CU_Q[b + 1] of q and CU_K[b]:CU_K[b + 1] of k, v
    stride_qm, stride_km, stride_vm, stride_om,  # row strides (elements): heads * D for packed tensors
    HQ, GROUP, TOTAL_Q, TOTAL_K, B,  # query heads, query heads per K/V head, packed rows, sequences
    win_left, win_right,  # the band: query i of a sequence sees keys [i + offset - win_left, i + offset + win_right]
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    REVERSE_M: tl.constexpr,  # causal: the slots from the last (a sequence's last tiles see the most keys)
    MASK_LEFT: tl.constexpr,  # a window's left edge can cut a tile
    WARP_SPECIALIZE: tl.constexpr,
    CU_BLOCK: tl.constexpr,
):
    # fmt: on
    slot = tl.program_id(0)
    if REVERSE_M:
        slot = tl.num_programs(0) - 1 - slot
    off_h = tl.program_id(1)
    off_hk = off_h // GROUP

    # -- which sequence: the last b whose first slot, CU_Q[b] // BLOCK_M + b, is at or before this one (the first
    # slots increase strictly, so counting them finds it)
    found = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, B, CU_BLOCK):
        idx = c0 + tl.arange(0, CU_BLOCK)
        first = tl.load(CU_Q + idx, mask=idx < B, other=0) // BLOCK_M + idx
        found += tl.sum(((first <= slot) & (idx < B)).to(tl.int32), 0)
    off_b = tl.maximum(found - 1, 0)
    q_start = tl.load(CU_Q + off_b)
    q_end = tl.load(CU_Q + off_b + 1)
    k_start = tl.load(CU_K + off_b)
    k_end = tl.load(CU_K + off_b + 1)
    NQ = q_end - q_start
    NK = k_end - k_start
    offset = NK - NQ
    row_lo = (slot - (q_start // BLOCK_M + off_b)) * BLOCK_M  # a slot past the sequence's tiles: row_lo >= NQ

    # -- the descriptors end at this sequence's last row: past it, loads give zeros and stores are dropped (at least
    # one row: a first sequence of no rows ends at row 0, and a descriptor has no empty dimension)
    q_rows = tl.maximum(q_end, 1)
    k_rows = tl.maximum(k_end, 1)
    desc_q = tl.make_tensor_descriptor(Q, [q_rows, HQ * HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K, [k_rows, HQ // GROUP * HEAD_DIM], [stride_km, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [k_rows, HQ // GROUP * HEAD_DIM], [stride_vm, 1], [BLOCK_N, HEAD_DIM])
    desc_o = tl.make_tensor_descriptor(O, [q_rows, HQ * HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM])

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_start + row_lo, off_h * HEAD_DIM])
    if DOT_UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # -- the key tiles the band reaches (none for an empty slot); every tile takes the mask at its edges: the
    # sequence's keys rarely end on a tile boundary
    lo, hi, _ = softmax_step.band_keys(row_lo, BLOCK_M, NQ, NK, offset, win_left, win_right)
    hi = tl.where(row_lo < NQ, hi, lo)
    first_key, last_key = softmax_step.edge_keys(offs_m, offset, win_left, win_right, NK)
    for start_n in tl.range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([k_start + start_n, off_hk * HEAD_DIM])  # (BLOCK_N, D), zeros past the sequence
        if DOT_UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
        visible = softmax_step.edge_visible(start_n + offs_n, first_key, last_key, MASK_LEFT, True)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        p, m_new, alpha, l_i = softmax_step.online_softmax_step(s, m_i, l_i)
        v = desc_v.load([k_start + start_n, off_hk * HEAD_DIM])
        if DOT_UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    o, lse = softmax_step.normalise(acc, m_i, l_i)
    tl.store(LSE + off_h.to(tl.int64) * TOTAL_Q + q_start + offs_m, lse, mask=offs_m < NQ)
    # rows past q_end are dropped; a slot with no rows of its own stores wholly past the descriptor's end
    o_row = tl.where(row_lo < NQ, q_start + row_lo, q_rows)
    desc_o.store([o_row, off_h * HEAD_DIM], o.to(O.dtype.element_ty))


def unavailable(q, k, v, o=None) -> str | None:
    """Why this kernel cannot run packed q ``(total_q, Hq, D)``, k, v ``(total_k, Hk, D)`` (writing ``o``, if
    given) here, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return "it runs 16-bit inputs only (its dots are the tensor cores')"
    if q.shape[-1] not in HEAD_DIMS:
        return f"its tiles are one head wide: head dims {HEAD_DIMS}, not {q.shape[-1]}"
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"Triton {triton.__version__} has no device-side tensor descriptors (needs Triton >= 3.4)"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < TMA_MIN_CAPABILITY:
            return f"it needs a Hopper GPU or newer (compute capability >= {TMA_MIN_CAPABILITY}.0), not {major}.{minor}"
    for name, x in (("q", q), ("k", k), ("v", v), ("o", q if o is None else o)):
        heads_packed = x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) == x.shape[1] * x.shape[2]
        if not heads_packed or x.data_ptr() % TMA_ALIGN_BYTES:
            return f"its copy engine reads {name} as packed rows of heads (contiguous, 16-byte aligned)"
    return None


def launch(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, band,
           config=None, launcher=None):  # fmt: skip
    """Run the kernel once on prepared inputs, as ``flashlab.kernels.varlen.launch`` takes them (boundaries
    already checked), writing ``o`` (contiguous, like q) and ``lse (Hq, total_q)``. ``config`` fixes the tiles
    (BLOCK_M, BLOCK_N, num_warps, num_stages; four warps mean warp-specialised); None: rung 3's tuned table's for
    the longest sequence. ``launcher`` as ``flashlab.kernels.varlen.launch`` takes it (the host engine's planned
    launches, which hand the descriptors their global scratch). CPU tensors run the interpreter."""
    why = unavailable(q, k, v, o)
    if why is not None:
        raise RuntimeError(f"the Hopper varlen kernel cannot run these inputs: {why}")
    total_q, hq, d = q.shape
    hk = k.shape[1]
    b = cu_seqlens_q.shape[0] - 1
    if max_seqlen_q == 0 or b == 0 or total_q == 0:
        return
    win_left, win_right, qk_scale = band
    args = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, q.stride(0), k.stride(0), v.stride(0), o.stride(0))
    args += (hq, hq // hk, total_q, k.shape[0], b, win_left, win_right, qk_scale)
    meta = dict(HEAD_DIM=d, DOT_PRECISION=dot_precision(q.dtype, q.is_cuda), DOT_UPCAST=dot_upcast(q.dtype, q.is_cuda),
                REVERSE_M=bool(causal), MASK_LEFT=win_left < max_seqlen_k, CU_BLOCK=CU_BLOCK)  # fmt: skip
    if not q.is_cuda:
        bm = CPU_CONFIG["BLOCK_M"]
        with interpreted_language(softmax_step):
            interpreted(_attn_fwd_varlen_hopper)[(cdiv(total_q, bm) + b, hq)](
                *args, **meta, BLOCK_M=bm, BLOCK_N=CPU_CONFIG["BLOCK_N"], WARP_SPECIALIZE=False)  # fmt: skip
        return
    if config is None:
        mask = "window" if window is not None else "causal" if causal else "none"
        config = configs.pick("hopper", device=q.device, dtype=q.dtype, head_dim=d, mask=mask, group=hq // hk,
                              nq=max(max_seqlen_q, 1), nk=max(max_seqlen_k, 1))  # fmt: skip
    config = dict(config)
    config.setdefault("WARP_SPECIALIZE", config["num_warps"] == rung3_hopper.WARP_SPECIALIZED_WARPS)
    grid = (cdiv(total_q, config["BLOCK_M"]) + b, hq)
    ensure_allocator()
    with torch.cuda.device(q.device):
        if launcher is None:
            _attn_fwd_varlen_hopper[grid](*args, **meta, **config)
        else:
            launcher(_attn_fwd_varlen_hopper, grid, args, {**meta, **config}, PLANNED_RUNTIME, ("O", "LSE"))


# the scalars a planned launch passes per call: what changes between calls of one binary
PLANNED_RUNTIME = ("TOTAL_Q", "TOTAL_K", "B", "win_left", "win_right", "qk_scale")


# Where the benchmark measured it faster than the pointer kernel (one H100, bf16, the varlen bar's cells,
# docs/forward-ladder.md): head dim 128, by 1.21-1.28x; at 64 the pointer kernel was as fast or faster.
PREFERRED_HEAD_DIM = 128


def preferred(q, k, v, o) -> bool:
    """Whether ``flashlab.kernels.varlen.launch`` runs this kernel for packed q, k, v (into o) by default."""
    return q.is_cuda and q.shape[-1] == PREFERRED_HEAD_DIM and unavailable(q, k, v, o) is None

__all__ = ["HEAD_DIMS", "PREFERRED_HEAD_DIM", "launch", "preferred", "unavailable"]
