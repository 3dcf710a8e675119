"""The backward's rung 5, "one_pass_atomic": dK, dV and dQ in one loop of five matrix products, written in Gluon so that
the loop keeps its warpgroups and its adds.

Rungs 1 and 2 spend seven matrix products a (query tile, key tile) pair: dQ has a pass of its own, which computes S
and dP a second time, because a query row's dQ sums over key tiles that different programs own. Rung 3 folded dQ
into the dK/dV loop with atomic adds (five products), but Triton 3.6's warp-specialising pass refuses or deletes
the adds, so rung 3 ran eight plain warps and lost more than the two products it saved (``docs/backward.md``).
Gluon states the warpgroups itself, as the forward's rung 4 does, so nothing can drop them. Per program (one key
tile of ``BLOCK_N`` = 128 keys and one K/V head), for each query tile of ``BLOCK_M`` rows of each query head of its
GQA group, each of two consumer warpgroups (64 keys each) runs:

    Sᵀ  = K Qᵀ,  dPᵀ = V dOᵀ                      both issued, then waited for in turn
    Pᵀ  = exp2(Sᵀ · scale − lse),  dSᵀ = Pᵀ ∘ (dPᵀ − δ)   under the mask, where the tile crosses the band's edge
    dV += Pᵀ dO,  dK += dSᵀ Q                      Pᵀ and dSᵀ from registers
    dSᵀ -> shared memory; once both warpgroups' halves are there:
    dQ[:, half] = dS K[:, half]                   each warpgroup half of dQ's columns, over all 128 keys

and adds its half of dQ into a float32 buffer with atomic adds, four floats an instruction; a last elementwise
step scales it and rounds it to q's dtype, as rung 3's does. One loader warp copies K and V once, then Q and dO
tile by tile into a ring of ``STAGES`` buffers, with the tensor-memory accelerator; mbarriers say when a tile has
arrived and when both warpgroups are done with it. Rows past a head's end come in as zeros; their lse (padded
+inf) makes P = 0 there, and keys past the end are masked.

The adds land in whatever order the programs reach them, so dQ's last bits can change run to run (dK and dV
stay bit-identical): the rung is not deterministic and runs only when named
(``backward_rung="one_pass_atomic"``). ``run_backward(..., ordered=True)`` is rung 6 (``rung6_one_pass_ordered``):
the same loop, the adds taking turns, deterministic.

Where it runs: a Hopper GPU (Gluon compiles for a GPU only: no interpreter), 16-bit inputs, D = 64 or 128, K, V,
Q and dO describable by the copy engine (``gluon_hopper.not_describable``). ``unavailable`` says which fails.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashlab.core.integers import cdiv
from flashlab.kernels import gluon_hopper
from flashlab.kernels.backward import rung1_two_pass as two_pass
from flashlab.kernels.backward import rung2_hopper
from flashlab.kernels.device import device_index, kernel_band, sm_count
from flashlab.kernels.gluon_hopper import GLUON_ERROR, not_describable

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

NAME = "one_pass_atomic"
HEAD_DIMS = (64, 128)
WG_KEYS = 64  # keys per consumer warpgroup: one wgmma M
NUM_WG = 2
BLOCK_N = NUM_WG * WG_KEYS  # keys per program
BLOCK_M = 64  # query rows per loop step
STAGES = 2  # Q/dO buffers in the ring
CONSUMER_REGS = 240
LOADER_REGS = 24
# four variants of the step, to be measured against the rung as it stands (lab/probes/backward_one_pass_parts.py):
# the loader stages each step's lse and delta in shared memory (the consumers' read of them from L2 otherwise waits
# in every step); dQ's halves leave by the copy engine's bulk add (one instruction a warpgroup and step) instead of
# the threads' atomic adds; each warpgroup adds dQ over its own keys, all columns (no meeting, twice the bytes); the
# wait for dPᵀ kept below Sᵀ's exponentials (ptxas otherwise moves it up beside the wait for Sᵀ)
STATS_SMEM = False
DQ_BULK = False
DQ_OWN_KEYS = False
DP_LATE_WAIT = False
RUNTIME = ("HQ", "GROUP", "NQ", "NK", "ROWS", "offset", "win_left", "win_right", "ROTATE")

if GLUON_ERROR is None:
    _tma_load = gluon_hopper.tma_load
    _tma_reduce_add = gluon_hopper.tma_reduce_add
    _mma_layout = gluon_hopper.mma_layout
    # the barrier among a partition's warps: thread_barrier in Triton 3.6, barrier from 3.7 on
    _warps_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _WG_KEYS = gl.constexpr(WG_KEYS)

    @gluon.jit
    def _query_tiles(col_lo, NQ, NK, offset, win_left, win_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """The query tiles that see any key of ``[col_lo, col_lo + BLOCK_N)``: ``(first tile, count)``. Key j is
        seen by rows ``[j - offset - win_right, j - offset + win_left]``."""
        col_hi = gl.minimum(col_lo + BLOCK_N, NK) - 1
        lo = gl.maximum(col_lo - offset - win_right, 0)
        hi = gl.maximum(gl.minimum(col_hi - offset + win_left + 1, NQ), lo)
        t_lo = lo // BLOCK_M
        return t_lo, (hi + BLOCK_M - 1) // BLOCK_M - t_lo

    @gluon.jit
    def _key_tile(ORDERED: gl.constexpr):
        """This program's key tile. Ordered, the grid runs them last first: a key tile waits only for the turns of
        key tiles launched before it (``_turn``)."""
        if ORDERED:
            return gl.num_programs(0) - 1 - gl.program_id(0)
        else:
            return gl.program_id(0)

    @gluon.jit
    def _step_tile(step, n, t_lo, n_tiles, GROUP, ROTATE):
        """Step ``step``'s (query head of the group, first row) for key tile ``n``, as ``(g, query tile)``: the
        group's heads one after another, each through its tiles from ``t_lo``. With ``ROTATE`` (every key tile sees
        every query tile), key tile ``n`` starts its walk ``n / NT`` of the way along the list of ``GROUP *
        n_tiles`` pairs and goes round, so that the key tiles reach a query tile one after another, not all at
        once."""
        items = GROUP * n_tiles
        v = step
        if ROTATE != 0:
            v = (step + n * items // gl.num_programs(0)) % items
        g = v // n_tiles
        return g, t_lo + v - g * n_tiles

    @gluon.jit
    def _turn(n, g, m, n_tiles, GROUP, NQ, NK, offset, win_left, win_right, ROTATE, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):  # fmt: skip
        """``(turn, adders)``: key tile ``n``'s place among the key tiles that add into query tile ``m``'s dQ (of
        the group's head ``g``), and how many they are. From the highest key tile down, which under a band reaches
        the query tile a step or two before the one below it; with ``ROTATE``, round from the key tile whose walk
        starts nearest before it (``_step_tile``), which reaches it first."""
        if ROTATE != 0:
            nt = gl.num_programs(0)
            items = GROUP * n_tiles
            v = g * n_tiles + m
            first = ((v + 1) * nt + items - 1) // items - 1  # the last key tile whose walk starts at or before v
            return (first - n + nt) % nt, nt
        else:  # the band's general form (a causal band is a window with no left edge)
            j0, j1 = gluon_hopper.key_range(m * BLOCK_M, NQ, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, False,
                                            True)  # fmt: skip
            return j1 - 1 - n, j1 - j0

    @gluon.jit
    def _loader(desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, q_ready,
                do_ready, stats_ready, qdo_empty, kv_ready, LSE2, DELTA, HQ, GROUP, NQ, NK, ROWS, offset, win_left,
                win_right, ROTATE, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                ORDERED: gl.constexpr, STATS_SMEM: gl.constexpr):  # fmt: skip
        """The loader warp: the program's K and V once, then Q and dO of every step into the ring, each buffer
        once both consumers have released it; with ``STATS_SMEM``, the step's lse and delta beside them (read from
        L2 here, so that the consumers find them in shared memory)."""
        stats_rows = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
        n = _key_tile(ORDERED)
        pid_bk = gl.program_id(1)
        hk = HQ // GROUP
        b = pid_bk // hk
        h_kv = pid_bk % hk
        col_lo = n * BLOCK_N
        mbarrier.expect(kv_ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        _tma_load(desc_k, [b, h_kv, col_lo, 0], kv_ready, k_smem)
        _tma_load(desc_v, [b, h_kv, col_lo, 0], kv_ready, v_smem)
        t_lo, n_tiles = _query_tiles(col_lo, NQ, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N)
        for step in range(GROUP * n_tiles):
            g, m = _step_tile(step, n, t_lo, n_tiles, GROUP, ROTATE)
            stage = step % STAGES
            mbarrier.wait(qdo_empty.index(stage), ((step // STAGES) & 1) ^ 1)  # the first pass waits for nothing
            mbarrier.expect(q_ready.index(stage), desc_q.block_type.nbytes)
            _tma_load(desc_q, [b, h_kv * GROUP + g, m * BLOCK_M, 0], q_ready.index(stage), q_smem.index(stage))
            mbarrier.expect(do_ready.index(stage), desc_do.block_type.nbytes)
            _tma_load(desc_do, [b, h_kv * GROUP + g, m * BLOCK_M, 0], do_ready.index(stage), do_smem.index(stage))
            if STATS_SMEM:
                stats = (pid_bk * GROUP + g) * ROWS + m * BLOCK_M + stats_rows  # +inf and 0 past NQ
                lse_smem.index(stage).store(gl.load(LSE2 + stats))
                delta_smem.index(stage).store(gl.load(DELTA + stats))
                _warps_barrier()  # every lane's stores are in before the arrive publishes them
                mbarrier.arrive(stats_ready.index(stage))

    @gluon.jit
    def _add_dq(dq, DQ_ACC, DQ, LOCKS, head, m, rows0, cols, turn, adders, NQ, ROWS, dq_scale, WG: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ORDERED: gl.constexpr):  # fmt: skip
        """Add this warpgroup's half of a query tile's dQ. Unordered: float32 atomic adds into ``DQ_ACC`` (zeros
        first). Ordered: wait for this key tile's turn on the tile's counter, then the first turn stores its part,
        the next ones load, add and store, and the last writes dQ itself, scaled and rounded; pass the turn on."""
        rows = head * ROWS + m * BLOCK_M + rows0  # rows past NQ land in the padding
        acc_ptrs = DQ_ACC + rows[:, None] * HEAD_DIM + cols[None, :]
        if ORDERED:
            lock = LOCKS + (head * (ROWS // BLOCK_M) + m) * 2 + WG
            seen = gl.atomic_add(lock, 0, sem="acquire")
            while seen != turn:
                seen = gl.atomic_add(lock, 0, sem="acquire")
            if turn > 0:  # past the L1 cache, which another program's stores never reach
                dq += gl.load(acc_ptrs, cache_modifier=".cg")
            if turn == adders - 1:
                out_rows = m * BLOCK_M + rows0
                out = (head * NQ + out_rows)[:, None] * HEAD_DIM + cols[None, :]
                gl.store(DQ + out, (dq * dq_scale).to(DQ.dtype.element_ty), mask=(out_rows < NQ)[:, None])
            else:
                gl.store(acc_ptrs, dq)
            _warps_barrier()  # every thread's stores are in before the turn passes on
            gl.atomic_xchg(lock, turn + 1, sem="release")
        else:
            gl.atomic_add(acc_ptrs, dq, sem="relaxed")

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, q_ready, do_ready,
                  stats_ready, qdo_empty, kv_ready, ds_ready, ds_free, desc_dq_acc, LSE2, DELTA, DQ_ACC, DQ, LOCKS,
                  DK, DV, HQ, GROUP, NQ, NK, ROWS, offset, win_left, win_right, ROTATE, qk_scale, dk_scale,
                  dq_scale, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, MASKED: gl.constexpr, ORDERED: gl.constexpr, STATS_SMEM: gl.constexpr,
                  DQ_BULK: gl.constexpr, DQ_OWN_KEYS: gl.constexpr, DP_LATE_WAIT: gl.constexpr,
                  DQ_WORK: gl.constexpr):  # fmt: skip
        """One consumer warpgroup: keys ``[WG * 64, WG * 64 + 64)`` of the program's tile through every query tile
        that sees them (the module docstring's step), then its rows of dK and dV."""
        dtype: gl.constexpr = q_smem.dtype
        WGK: gl.constexpr = _WG_KEYS
        HALF_D: gl.constexpr = HEAD_DIM // 2
        s_layout: gl.constexpr = _mma_layout(BLOCK_M)  # Sᵀ, dPᵀ: (64 keys, BLOCK_M queries)
        kv_layout: gl.constexpr = _mma_layout(HEAD_DIM)  # dK, dV: (64 keys, D)
        dq_layout: gl.constexpr = _mma_layout(HALF_D)  # this warpgroup's half of dQ: (BLOCK_M queries, D / 2)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        # dQ's adds in a layout of four consecutive floats a thread: one vector instruction per four
        add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (HALF_D // 4), HALF_D // 4], [4, 1], [1, 0])
        n = _key_tile(ORDERED)
        pid_bk = gl.program_id(1)
        col_lo = n * BLOCK_N
        key0 = col_lo + WG * WGK
        keys = key0 + gl.arange(0, WGK, layout=gl.SliceLayout(1, s_layout))
        first_row = keys - offset - win_right  # each key's first and last query row (the band from the keys' side)
        last_row = keys - offset + win_left
        cols0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        k_w = k_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * WGK, WGK, 0)  # (64 keys, D)
        v_w = v_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * WGK, WGK, 0)
        k_half = k_smem.reshape([BLOCK_N, HEAD_DIM]).slice(WG * HALF_D, HALF_D, 1)  # (all keys, D / 2)
        ds_w = ds_smem.slice(WG * WGK, WGK, 0)  # this warpgroup's rows of dSᵀ (keys, queries)
        zero_s = gl.zeros([WGK, BLOCK_M], gl.float32, s_layout)
        zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout)
        zero_dq_own = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, kv_layout)  # DQ_OWN_KEYS: (BLOCK_M, D)
        dk = gl.zeros([WGK, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([WGK, HEAD_DIM], gl.float32, kv_layout)
        dq_rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_layout))
        dq_cols = WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, add_layout))

        t_lo, n_tiles = _query_tiles(col_lo, NQ, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N)
        key_tail = key0 + WGK > NK  # some of this warpgroup's keys lie past the last one
        mbarrier.wait(kv_ready, 0)
        for step in range(GROUP * n_tiles):
            g, m = _step_tile(step, n, t_lo, n_tiles, GROUP, ROTATE)
            start_m = m * BLOCK_M
            head = pid_bk * GROUP + g  # (batch, query head), flattened
            stage = step % STAGES
            phase = (step // STAGES) & 1
            cols = start_m + cols0
            if not STATS_SMEM:
                lse2 = gl.load(LSE2 + head * ROWS + cols)  # +inf past NQ: P = 0 on those rows
                delta = gl.load(DELTA + head * ROWS + cols)

            mbarrier.wait(q_ready.index(stage), phase)
            q_s = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
            s = warpgroup_mma(k_w, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(stage), phase)
            do_s = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
            dp = warpgroup_mma(v_w, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if STATS_SMEM:
                mbarrier.wait(stats_ready.index(stage), phase)
                lse2 = lse_smem.index(stage).load(gl.SliceLayout(0, s_layout))  # +inf past NQ: P = 0 there
                delta = delta_smem.index(stage).load(gl.SliceLayout(0, s_layout))
            s = warpgroup_mma_wait(1, deps=(s,))
            s = s * qk_scale - lse2[None, :]
            if MASKED:  # the band's edges, where this tile crosses one
                if (start_m < key0 + WGK - 1 - offset - win_right) or (start_m + BLOCK_M - 1 > key0 - offset +
                                                                       win_left) or key_tail:  # fmt: skip
                    seen = (cols[None, :] >= first_row[:, None]) & (cols[None, :] <= last_row[:, None])
                    s = gl.where(seen & (keys < NK)[:, None], s, float("-inf"))
            elif key_tail:
                s = gl.where((keys < NK)[:, None], s, float("-inf"))
            p = gl.exp2(s)
            if DP_LATE_WAIT:  # the wait for dPᵀ in a block of its own (NQ > 0 always holds), so that ptxas keeps it
                dp_token = dp  # below the exponentials, which then run under the dPᵀ product; written
                dp = zero_s  # differently on the side never taken, so that the two sides cannot be merged
                if NQ > 0:
                    dp = warpgroup_mma_wait(0, deps=(dp_token,))
                else:
                    _warps_barrier()
                    dp = warpgroup_mma_wait(0, deps=(dp_token,))
                    _warps_barrier()
            else:
                dp = warpgroup_mma_wait(0, deps=(dp,))
            ds = p * (dp - delta[None, :])
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            if DQ_OWN_KEYS and DQ_WORK > 0:
                # dQ over this warpgroup's own 64 keys, all D columns: dSᵀ goes to its own rows of shared memory
                # (the last step's dQ product, waited for, has read them), no meeting with the other warpgroup
                ds_w.store(ds.to(dtype))
                fence_async_shared()
                _warps_barrier()  # every thread's part of dSᵀ is in before the product reads it
                dq = warpgroup_mma(ds_w.permute((1, 0)), k_w, zero_dq_own, use_acc=False, is_async=True)
                dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op, ds_op))
                mbarrier.arrive(qdo_empty.index(stage))
                if DQ_WORK > 1:  # both warpgroups add a whole (BLOCK_M, D) part: the copy engine sums them
                    dq_buf = dq_smem.index(WG)
                    tma.store_wait(0)  # the last step's add has read the buffer
                    dq_buf.reshape([BLOCK_M, HEAD_DIM]).store(dq)
                    fence_async_shared()
                    _tma_reduce_add(desc_dq_acc, [head, start_m, 0], dq_buf)
            elif DQ_WORK > 0:
                # dSᵀ into shared memory, once both warpgroups' products of the last step have read it
                mbarrier.wait(ds_free, (step & 1) ^ 1)
                ds_w.store(ds.to(dtype))
                fence_async_shared()
                mbarrier.arrive(ds_ready)
                mbarrier.wait(ds_ready, step & 1)
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_half, zero_dq, use_acc=False, is_async=True)
                dv, dk, dq, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_op, ds_op))
                mbarrier.arrive(qdo_empty.index(stage))
                mbarrier.arrive(ds_free)
                if DQ_WORK > 1:
                    if DQ_BULK:  # one bulk add by the copy engine, which reads the tile while the loop goes on
                        dq_buf = dq_smem.index(WG)
                        tma.store_wait(0)  # the last step's add has read the buffer
                        dq_buf.reshape([BLOCK_M, HALF_D]).store(dq)
                        fence_async_shared()
                        _tma_reduce_add(desc_dq_acc, [head, start_m, WG * HALF_D], dq_buf)
                    else:
                        turn, adders = 0, 1
                        if ORDERED:
                            turn, adders = _turn(n, g, m, n_tiles, GROUP, NQ, NK, offset, win_left, win_right,
                                                 ROTATE, BLOCK_M, BLOCK_N)  # fmt: skip
                        _add_dq(gl.convert_layout(dq, add_layout), DQ_ACC, DQ, LOCKS, head, m, dq_rows0, dq_cols,
                                turn, adders, NQ, ROWS, dq_scale, WG, HEAD_DIM, BLOCK_M, ORDERED)  # fmt: skip
            else:
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
                mbarrier.arrive(qdo_empty.index(stage))

        if DQ_BULK:
            tma.store_wait(0)  # the last add has read its buffer before the program ends
        out_keys = key0 + gl.arange(0, WGK, layout=gl.SliceLayout(1, kv_layout))
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        out = (pid_bk * NK + out_keys)[:, None] * HEAD_DIM + out_cols[None, :]
        ok = (out_keys < NK)[:, None]
        gl.store(DK + out, (dk * dk_scale).to(DK.dtype.element_ty), mask=ok)
        gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)

    @gluon.jit(do_not_specialize=RUNTIME, do_not_specialize_on_alignment=RUNTIME)
    def _bwd_one_pass(desc_q, desc_do, desc_k, desc_v, desc_dq_acc, LSE2, DELTA, DQ_ACC, DQ, LOCKS, DK, DV, HQ,
                      GROUP, NQ, NK, ROWS, offset, win_left, win_right, ROTATE, qk_scale, dk_scale, dq_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      MASKED: gl.constexpr, ORDERED: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, STATS_SMEM: gl.constexpr = False, DQ_BULK: gl.constexpr = False,
                      DQ_OWN_KEYS: gl.constexpr = False, DP_LATE_WAIT: gl.constexpr = False,
                      DQ_WORK: gl.constexpr = 2):  # fmt: skip
        """One program per (key tile, batch and K/V head): a loader warp and two consumer warpgroups.
        ``STATS_SMEM``: the loader stages each step's lse and delta in shared memory. ``DQ_BULK`` (unordered only):
        dQ's halves leave by the copy engine's bulk add (``desc_dq_acc``) instead of the threads' atomic adds.
        ``DQ_OWN_KEYS`` (with ``DQ_BULK``): each warpgroup forms dQ over its own 64 keys, all D columns, and adds
        that; the warpgroups never meet, at twice the bytes added. ``DP_LATE_WAIT``: Sᵀ's exponentials run under
        the dPᵀ product (the wait for it kept below them in the machine code).
        ``DQ_WORK`` is for measuring where the loop's time goes (``lab/probes/backward_one_pass_parts.py``): 2, the
        rung, all of dQ's work; 1, dQ's product but not its adds; 0, neither -- dQ is then wrong."""
        dtype: gl.constexpr = desc_q.dtype
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], desc_q.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], desc_do.layout)
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], desc_k.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], desc_v.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
        stats_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if DQ_OWN_KEYS:  # each warpgroup's whole part of dQ on its way to the copy engine's bulk add
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, HEAD_DIM], desc_dq_acc.layout)
        elif DQ_BULK:  # each warpgroup's half of dQ on its way to the copy engine's bulk add
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, HEAD_DIM // 2], desc_dq_acc.layout)
        else:
            dq_smem = ds_smem  # never used
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(stats_ready.index(i), count=1)  # the loader has stored the step's lse and delta
            mbarrier.init(qdo_empty.index(i), count=2)  # both consumer warpgroups release each buffer
        mbarrier.init(kv_ready, count=1)
        mbarrier.init(ds_ready, count=2)  # both halves of dSᵀ are in shared memory
        mbarrier.init(ds_free, count=2)  # both warpgroups' dQ products have read it
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, q_ready, do_ready,
                         stats_ready, qdo_empty, kv_ready, ds_ready, ds_free, desc_dq_acc, LSE2, DELTA, DQ_ACC, DQ,
                         LOCKS, DK, DV, HQ, GROUP, NQ, NK, ROWS, offset, win_left, win_right, ROTATE, qk_scale,
                         dk_scale, dq_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASKED, ORDERED, STATS_SMEM,
                         DQ_BULK, DQ_OWN_KEYS, DP_LATE_WAIT, DQ_WORK)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, dq_smem, q_ready, do_ready,
                         stats_ready, qdo_empty, kv_ready, ds_ready, ds_free, desc_dq_acc, LSE2, DELTA, DQ_ACC, DQ,
                         LOCKS, DK, DV, HQ, GROUP, NQ, NK, ROWS, offset, win_left, win_right, ROTATE, qk_scale,
                         dk_scale, dq_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASKED, ORDERED, STATS_SMEM,
                         DQ_BULK, DQ_OWN_KEYS, DP_LATE_WAIT, DQ_WORK)),
            (_loader, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                       q_ready, do_ready, stats_ready, qdo_empty, kv_ready, LSE2, DELTA, HQ, GROUP, NQ, NK, ROWS,
                       offset, win_left, win_right, ROTATE, BLOCK_M, BLOCK_N, STAGES, ORDERED, STATS_SMEM)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])  # fmt: skip


@triton.jit(do_not_specialize=("NQ", "ROWS"))
def _finish_dq(DQ_ACC, DQ, NQ, ROWS, scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dQ from its float32 sums: the real rows of each head, times the (signed) scale, in q's dtype; one pass."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    acc = tl.load(DQ_ACC + (head.to(tl.int64) * ROWS + rows)[:, None] * HEAD_DIM + cols[None, :])
    out = (head.to(tl.int64) * NQ + rows)[:, None] * HEAD_DIM + cols[None, :]
    tl.store(DQ + out, (acc * scale).to(DQ.dtype.element_ty), mask=(rows < NQ)[:, None])


FINISH_ROWS = 64  # rows of dQ per program of ``_finish_dq`` (ROW_ALIGN is a multiple)


def unavailable(q, k, v, do) -> str | None:
    """Why this rung cannot run the backward of these inputs here, or None."""
    why = gluon_hopper.not_here(q)
    if why is not None:
        return why
    if q.dtype == torch.float32:
        return "it runs 16-bit inputs only (its products are the tensor cores'); float32 goes to two_pass"
    if q.shape[3] not in HEAD_DIMS:
        return f"its tiles are built for head dims {', '.join(map(str, HEAD_DIMS))}, not {q.shape[3]}"
    return gluon_hopper.first_not_describable(q=q, k=k, v=v, do=do)


def constexprs(d, causal, window, ordered, stats_smem=None, dq_bulk=None, dq_own_keys=None, dp_late_wait=None) -> dict:
    """The kernel's constexprs and launch options for head dim ``d``, a mask kind and the way dQ is summed
    (``stats_smem``, ``dq_bulk``, ``dq_own_keys``, ``dp_late_wait``: the step's variants, by default the module's;
    the bulk adds are unordered only, and ``dq_own_keys`` takes the bulk add)."""
    masked = bool(causal) or window is not None
    stats_smem = STATS_SMEM if stats_smem is None else stats_smem
    dq_own_keys = (DQ_OWN_KEYS if dq_own_keys is None else dq_own_keys) and not ordered
    dq_bulk = ((DQ_BULK if dq_bulk is None else dq_bulk) or dq_own_keys) and not ordered
    dp_late_wait = DP_LATE_WAIT if dp_late_wait is None else dp_late_wait
    return dict(HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, MASKED=masked, ORDERED=ordered,
                CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, STATS_SMEM=stats_smem, DQ_BULK=dq_bulk,
                DQ_OWN_KEYS=dq_own_keys, DP_LATE_WAIT=dp_late_wait, num_warps=4)  # fmt: skip


def dq_descriptor(dq_acc, own_keys=False):
    """The copy engine's descriptor of dQ's float32 sums ``(B * Hq, ROWS, D)``, added to in tiles of ``BLOCK_M``
    rows and half the columns (one consumer warpgroup's part), or all of them (``own_keys``)."""
    return gluon_hopper.tile_descriptor(dq_acc, [1, BLOCK_M, dq_acc.shape[2] // (1 if own_keys else NUM_WG)])


def rotates(nk, masked, ordered, programs_at_once) -> bool:
    """Whether the key tiles walk their query tiles from staggered starts (``_step_tile``): where every key tile
    sees every query tile (no mask). Ordered, a key tile may then wait for a key tile launched after it (the one
    whose walk starts nearest before), which is safe only where all of a head's key tiles run at once."""
    if masked:
        return False
    return not ordered or cdiv(nk, BLOCK_N) <= programs_at_once


def attention_backward(do, q, k, v, o, lse, causal, window, scale, config=None):
    """Gradients ``(dq, dk, dv)`` as ``two_pass.attention_backward`` returns them, from one loop of five products,
    dQ summed by atomic adds (its last bits may differ run to run). Its tiles are fixed: a ``config`` is refused."""
    return run_backward(do, q, k, v, o, lse, causal, window, scale, config, ordered=False)


def run_backward(do, q, k, v, o, lse, causal, window, scale, config=None, ordered=False, stats_smem=None,
                 dq_bulk=None, dq_own_keys=None, dp_late_wait=None):  # fmt: skip
    """``attention_backward``'s work; ``ordered``: the key tiles add into each query tile's dQ in a fixed order,
    taking turns on a counter per (head, query tile, warpgroup) -- the first stores, the last writes dQ itself --
    so the gradients are bit-identical run to run (``rung6_one_pass_ordered``). ``stats_smem``, ``dq_bulk``,
    ``dq_own_keys``, ``dp_late_wait``: the step's variants (``constexprs``)."""
    two_pass.check_backward_inputs(do, q, k, v, o, lse)
    if config is not None:
        raise ValueError("the one_pass backward's tiles are fixed; it takes no config")
    do = do if not_describable(do) is None else do.contiguous()
    why = unavailable(q, k, v, do)
    if why is not None:
        raise RuntimeError(f"the one_pass backward cannot run these inputs: {why}")
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    signed_scale = 1.0 / d**0.5 if scale is None else float(scale)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, nk, d, causal, window, scale)
    q_run = -q if negate else q  # as rung 1: the running max's positive scale, dQ by the signed one
    rows = cdiv(nq, rung2_hopper.ROW_ALIGN) * rung2_hopper.ROW_ALIGN
    delta = torch.empty((b * hq, rows), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    meta = constexprs(d, causal, window, ordered, stats_smem, dq_bulk, dq_own_keys, dp_late_wait)
    rotate = rotates(nk, meta["MASKED"], ordered, sm_count(device_index(q)))
    if ordered:  # every tile's first turn stores; rows no key tile sees (under a band) stay zero
        dq_acc = torch.empty((b * hq, rows, d), dtype=torch.float32, device=q.device)
        locks = torch.zeros((b * hq, rows // BLOCK_M, NUM_WG), dtype=torch.int32, device=q.device)
        dq = (torch.zeros if meta["MASKED"] else torch.empty)((b, hq, nq, d), dtype=q.dtype, device=q.device)
    else:
        dq_acc = torch.zeros((b * hq, rows, d), dtype=torch.float32, device=q.device)
        locks = delta  # never read
        dq = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hk, nk, d), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    o = o if o.stride(-1) == 1 else o.contiguous()
    pre_args = (o, do, lse, delta, lse2, *o.stride()[:3], *do.stride()[:3], *lse.stride(), hq, nq, rows)
    with torch.cuda.device(q.device):
        pre_m = two_pass.PREPROCESS_BLOCK_M
        two_pass.bwd_preprocess[(cdiv(rows, pre_m), b * hq)](*pre_args, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=pre_m)
        descs = (gluon_hopper.descriptor(q_run, BLOCK_M), gluon_hopper.descriptor(do, BLOCK_M),
                 gluon_hopper.descriptor(k, BLOCK_N), gluon_hopper.descriptor(v, BLOCK_N))  # fmt: skip
        bulk = dq_descriptor(dq_acc, meta["DQ_OWN_KEYS"]) if meta["DQ_BULK"] else descs[0]  # or unused
        descs = (*descs, bulk)
        sizes = (hq, hq // hk, nq, nk, rows, offset, win_left, win_right, int(rotate))
        _bwd_one_pass[(cdiv(nk, BLOCK_N), b * hk)](*descs, lse2, delta, dq_acc, dq, locks, dk, dv, *sizes, qk_scale,
                                                  abs(signed_scale), signed_scale, **meta)  # fmt: skip
        if not ordered:
            _finish_dq[(rows // FINISH_ROWS, b * hq)](dq_acc, dq, nq, rows, signed_scale, HEAD_DIM=d,
                                                      BLOCK=FINISH_ROWS)  # fmt: skip
    return dq, dk, dv


bwd_one_pass = _bwd_one_pass if GLUON_ERROR is None else None

__all__ = [
    "HEAD_DIMS",
    "NAME",
    "attention_backward",
    "bwd_one_pass",
    "constexprs",
    "rotates",
    "run_backward",
    "unavailable",
]
