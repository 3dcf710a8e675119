"""Rung 4 of the kernel ladder, "overlap": the softmax of one key tile runs while the tensor cores multiply the
previous tile's probabilities by V. Written in Gluon, Triton's lower-level language, because ``tl`` cannot say it.

Rung 3 (``rung3_hopper``) already hands the copies to warps of their own and gives each of two consumer
warpgroups 64 query rows. But inside a warpgroup every step still waits for the one before: the scores
``S = Q Kᵀ`` are computed, *then* the softmax turns them into ``P``, *then* ``P V`` is multiplied -- compiled for
sm_90, its loop issues the score product, waits for it, runs the exponentials, issues ``P V`` and waits again. While
the exponentials run, that warpgroup's tensor-core work is stopped. (Software-pipelining the loop in ``tl`` does not
help: the compiler still waits for each product right after issuing it, or its warp-specialising pass rejects
the loop; ``docs/forward-ladder.md``.)

Here the schedule is written out, per consumer warpgroup and key tile ``j``:

    wait for K_j;    issue S_j = Q K_jᵀ          (asynchronous)
    wait for V_j-1;  issue O += P_j-1 V_j-1       (asynchronous, P from registers)
    wait until only the newest product is in flight: S_j is done, P_j-1 V_j-1 may still run
    release K_j;     softmax of S_j -> P_j, running max and sum      <- under P_j-1 V_j-1
    wait for P_j-1 V_j-1;  release V_j-1;  rescale O by exp2(m_j-1 - m_j)

so the exponentials of tile ``j`` can overlap the matrix product of tile ``j - 1`` (FlashAttention-3's
"intra-warpgroup overlap"). That is the order of the PTX. ptxas (CUDA 12.8, the one Triton 3.6 ships) schedules
within a basic block, and there it moves the wait for ``P_j-1 V_j-1`` up to the block's start, after the first
instructions of the row max and before the exponentials (``docs/forward-ladder.md``). At D = 128
(``LATE_WAIT_HEAD_DIMS``) the wait starts a block of its own (``_pv_done``), so the machine code keeps the written
order and the exponentials run under the warpgroup's own ``P V``; at D = 64 the early wait measured faster. With
``PINGPONG`` the warpgroups of a program take turns issuing their products -- each waits until the other has issued
its pair -- so the tensor cores run one warpgroup's products while the other runs its softmax (FlashAttention-3's
"ping-pong" scheduling between warpgroups).

Around it: one loader warp copies Q and K, V tiles into a ring of ``STAGES`` shared-memory buffers with the
tensor-memory accelerator, mbarriers telling the consumers a tile has arrived and the loader that both have
finished with it; the scale folded into ``exp2``; GQA reads K/V head ``h // group``. Under a causal mask only the
tiles that cross some row's diagonal are masked (a branch, which Gluon keeps as written).

The grid is persistent: one program per multiprocessor (three where a program has one consumer warpgroup), each taking
(query tile, head) pairs in turn, head by head, so a program's next Q and first K, V tiles are copied while it finishes
the last one (its last ``P V``, the division by the sum, O's store through shared memory), where one program per tile
would pay that start and end on every tile with the multiprocessor idle between. Under a causal mask query tile ``m``
reads ``m + 1`` key tiles, so the tiles are unequal work: each program walks its own list from a table planned on the
host (``tile_schedule``) -- a head's ``r``-th longest tile paired with its ``r``-th shortest, the pairs dealt round
robin head by head but one round short, and the tiles left over handed out longest first, each to the program with the
least work so far, so that the programs end together. The copy engine's tensor descriptors are built on the host and
passed with the launch; a planned call (``flashlab.host.launches``) has flashlab's launcher encode them from the
tensors' addresses instead.

Where it runs: a Hopper GPU (sm_90: ``wgmma`` is Hopper's instruction), 16-bit inputs, D = 64, 128 or 256,
any lengths (the copy engine fills rows past a head's end with zeros and does not write them back; keys past the end
are masked), Nq <= Nk under a causal mask, a sliding window that leaves every query row some key (a query tile
reads only the key tiles its rows' bands reach, and masks those that cross a band's edge), and any layout the copy
engine can describe -- unit stride along D, every other stride and the start at multiples of 16 bytes, so heads
interleaved with the rows (a (B, N, H, D) projection viewed as (B, H, N, D)) run without a copy. It has no
interpreter path: Gluon compiles for a GPU only. ``unavailable`` says which of these fails; the ladder then runs
the fastest rung that can. A key whose V row holds inf or NaN behind the mask marks its rows with a NaN lse, and
rung 3's repair pass redoes those query tiles with the guard, as it does for rung 3.

Tiles per head dim (``TILES``, ``tiles``): how many consumer warpgroups share a program -- two, three (192 query
rows, FlashAttention-3's choice at D = 64, used there for long calls without a mask; with 64-key tiles, so that
three warpgroups' registers fit), or one (D = 64, causal, at most 1K rows: 64 query rows and 64-key tiles, three
programs on each multiprocessor, ``PROGRAMS_PER_SM``, so that one program's start and end run while the others'
loops feed the tensor cores; no ping-pong then) -- the key tile, and the ring's depth. At D = 256 O leaves through
Q's shared memory (``O_THROUGH_Q``): the loader then copies a tile's first K and V before its Q, whose buffer comes
back only once O's store has read it.
"""

from __future__ import annotations

import torch
import triton

from flashlab.core.integers import cdiv
from flashlab.core.masking import visible_band
from flashlab.kernels import gluon_hopper
from flashlab.kernels.device import device_index, sm_count, stream_capturing
from flashlab.kernels.gluon_hopper import CAPABILITY, GLUON_ERROR, not_describable
from flashlab.kernels.ladder import rung3_hopper as hopper
from flashlab.kernels.ladder import tile_schedule
from flashlab.kernels.softmax_step import LN_2

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

NAME = "overlap"  # the rung's name in flashlab.kernels.ladder
WG_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
HEAD_DIMS = (64, 128, 256)
# (consumer warpgroups, BLOCK_N, STAGES) per head dim; a program's query tile is 64 rows per consumer warpgroup.
# Two warpgroups and 128-key tiles won the first H200 sweep at both head dims (against 64-key tiles, 2 or 3 stages).
# At D = 256 64-key tiles and two stages, and O leaves through Q's buffer: 64 KB of Q and 128 KB of K/V ring leave
# no room for a separate O buffer.
TILES = {64: (2, 128, 2), 128: (2, 128, 2), 256: (2, 64, 2)}
# ... and where another shape measured faster: head dim -> (from this many query rows, without a mask or window,
# these tiles). At D = 64 three warpgroups (192 rows, 64-key tiles) ran 2-5 % faster from 2K rows, 7 % slower at
# 1K (where 192-row tiles leave 11 % of the last one empty) and 10-23 % slower under a causal mask (H200, GPU time).
UNMASKED_LONG_TILES = {64: (2048, (3, 64, 2))}
# ... and short causal calls: head dim -> (up to this many query and key rows, causal, no window, these tiles). At
# D = 64 one consumer warpgroup a program (64 query rows, 64-key tiles), three programs on each multiprocessor
# (``PROGRAMS_PER_SM``): 4-6 % faster at 1K (do_bench), 3-11 % slower at 2K and 4K and without a mask (H200).
SHORT_CAUSAL_TILES = {64: (1024, (1, 64, 2))}
O_THROUGH_Q = (256,)  # head dims whose O is stored through Q's shared memory
LOADER_REGS = 24  # the loader warp only issues copies
# programs sharing a multiprocessor, by consumer warpgroups; where more than one, the registers per thread each
# launch asks for: three programs of 256 threads (Triton pads the loader warp to a warpgroup) at 80 take 61,440 of
# the 65,536-register file. At 104 (four programs) ptxas spills and waits for each product as it is issued.
PROGRAMS_PER_SM = {1: 3, 2: 1, 3: 1}
LAUNCH_REGS = {1: 80}
# registers per thread of a consumer warpgroup (setmaxnreg), by how many there are; the first gets what is left.
# With one, that is all of its program's: the launch's two warpgroups' worth, less the loader's.
CONSUMER_REGS = {1: 2 * LAUNCH_REGS[1] - LOADER_REGS, 2: 240, 3: 160}
# Head dims whose causal grid is persistent, each program walking its own list of tiles from a table planned on the
# host (``tile_schedule``: pairs of equal work dealt round robin one round short, the tiles left over
# handed out longest first to the least-loaded program); elsewhere one program per query tile. At D = 256 a
# persistent causal walk spilled registers (192 bytes of stack compiled for sm_90, measured with the paired walk
# that came before the table; none with one program per tile).
SCHEDULED_HEAD_DIMS = (64, 128)
PINGPONG = True  # the consumer warpgroups take turns issuing their products (FlashAttention-3's ping-pong)
# Head dims whose wait for P V is kept after the softmax in the machine code (``_pv_done``): at D = 128 it measured
# 0-4 % faster than the wait ptxas moves up (H200, the benchmark's timing), at D = 64 2-4 % slower -- there the
# softmax, not the products, bounds each warpgroup; D = 256 was not timed with it.
LATE_WAIT_HEAD_DIMS = (128,)
# With FP8 inputs P enters the second product as e4m3 times 2^FP8_P_SHIFT, the shift added inside the exponent (no
# multiply): its values in [0, 256] keep e4m3's three bits down to weights of 2^-14. The running sum carries the
# same factor, so O = acc / l needs no undoing; the lse subtracts it.
FP8_P_SHIFT = 8.0

# Lengths, the band and the head count are runtime values (no binary per length). The tensor maps' shapes come in
# with each launch's descriptors.
RUNTIME_LENGTHS = ("HQ", "NQ", "NK", "GROUP", "offset", "win_left", "win_right", "n_bh")

if GLUON_ERROR is None:
    _tma_load = gluon_hopper.tma_load
    _tma_store = gluon_hopper.tma_store
    _mma_layout = gluon_hopper.mma_layout
    _key_range = gluon_hopper.key_range
    _WG = gl.constexpr(WG_ROWS)  # the module's constants, as Gluon code reads them
    _LOADER_REGS = gl.constexpr(LOADER_REGS)
    _P_SHIFT = gl.constexpr(FP8_P_SHIFT)

    @gluon.jit
    def _walk(SCHED, n_m, n_bh, SCHEDULED: gl.constexpr):
        """This program's walk over the tiles: ``(first, end, step)``. Scheduled, its own slice of the host's table
        (``tile_schedule``: where each program's list starts, then the tiles); otherwise tile
        ``pid``, ``pid + programs``, ... of all of them."""
        if SCHEDULED:
            pid = gl.program_id(0)
            return gl.load(SCHED + pid), gl.load(SCHED + pid + 1), 1
        else:
            return gl.program_id(0), n_m * n_bh, gl.num_programs(0)

    @gluon.jit
    def _code_at(t, SCHED, SCHEDULED: gl.constexpr):
        """Tile ``t`` of the walk as ``head * n_m + query tile`` (scheduled: read from the table, which holds one
        spare entry past its last tile, so a program may read one tile ahead of its last)."""
        if SCHEDULED:
            return gl.load(SCHED + gl.num_programs(0) + 1 + t)
        else:
            return t

    @gluon.jit
    def _tile_of(code, n_m, CAUSAL: gl.constexpr, SCHEDULED: gl.constexpr):
        """The (query tile, head) of a tile's code. Tiles run head by head, so the programs running at once share
        a few heads' K/V in L2. Causal and not scheduled (one program per tile), each head's longest query tiles
        first."""
        if CAUSAL and not SCHEDULED:
            return n_m - 1 - code % n_m, code // n_m
        else:
            return code % n_m, code // n_m

    @gluon.jit
    def _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, count, b, h_kv, j,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
        """Copy key tile ``j``'s K and V into the ring's buffer ``count % STAGES``, each once every consumer has
        released it. With ``FP8`` V comes transposed, ``(D, keys)``: its tile is ``BLOCK_N`` columns."""
        stage = count % STAGES
        phase = (count // STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)  # the first pass through the ring waits for nothing
        mbarrier.expect(k_ready.index(stage), desc_k.block_type.nbytes)
        _tma_load(desc_k, [b, h_kv, j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        if FP8:
            _tma_load(desc_v, [b, h_kv, 0, j * BLOCK_N], v_ready.index(stage), v_smem.index(stage))
        else:
            _tma_load(desc_v, [b, h_kv, j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _load_q(desc_q, q_smem, q_ready, q_empty, done, b, h, row_lo, NUM_WG: gl.constexpr):
        """Copy each warpgroup's 64 query rows, once that warpgroup has released its buffer."""
        for w in gl.static_range(NUM_WG):
            mbarrier.wait(q_empty.index(w), (done & 1) ^ 1)  # the first tile waits for nothing
            mbarrier.expect(q_ready.index(w), desc_q.block_type.nbytes)
            _tma_load(desc_q, [b, h, row_lo + w * _WG, 0], q_ready.index(w), q_smem.index(w))

    @gluon.jit
    def _loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                v_empty, HQ, NQ, NK, GROUP, offset, win_left, win_right, n_m, n_bh, SCHED, NUM_WG: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                O_IN_Q: gl.constexpr, SCHEDULED: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
        """The loader warp: for each tile of the program, each warpgroup's Q once it has finished with the last
        one, then K and V tile by tile into the ring, each copy waiting until every consumer has released the
        buffer it overwrites. The ring's count runs on across the program's tiles. Rows past a head's end come in
        as zeros (the descriptors know each head's length). With ``O_IN_Q`` (O leaves through Q's buffer, which
        is then released only after O's store) the first K and V go before Q, so they are not held up behind it."""
        count = 0  # K/V tiles copied so far: the ring's position and phase
        done = 0  # query tiles started
        first, end, step = _walk(SCHED, n_m, n_bh, SCHEDULED)
        code = _code_at(first, SCHED, SCHEDULED)
        for t in range(first, end, step):
            code_next = _code_at(t + step, SCHED, SCHEDULED)  # read ahead: off this tile's critical path
            m, bh = _tile_of(code, n_m, CAUSAL, SCHEDULED)
            b = bh // HQ
            h_kv = bh % HQ // GROUP
            row_lo = m * (NUM_WG * _WG)
            j0, j1 = _key_range(row_lo, NQ, NK, offset, win_left, win_right, NUM_WG * _WG, BLOCK_N, CAUSAL, WINDOW)
            if O_IN_Q:
                _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, count, b, h_kv, j0,
                         BLOCK_N, STAGES, FP8)  # fmt: skip
                count += 1
                _load_q(desc_q, q_smem, q_ready, q_empty, done, b, bh % HQ, row_lo, NUM_WG)
                j0 += 1
            else:
                _load_q(desc_q, q_smem, q_ready, q_empty, done, b, bh % HQ, row_lo, NUM_WG)
            for j in range(j0, j1):
                _load_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, count, b, h_kv, j,
                         BLOCK_N, STAGES, FP8)  # fmt: skip
                count += 1
            done += 1
            code = code_next

    @gluon.jit
    def _scores(s, j, rows, first_visible_edge, cols0, NK, win_left, win_right, CAUSAL: gl.constexpr,
                KEY_TAIL: gl.constexpr, WINDOW: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Tile ``j``'s scores, masked where the tile crosses a row's diagonal (causal: row ``i`` sees keys up to
        ``i + offset``; ``rows`` holds ``i + offset``) or runs past the last key. Not yet scaled: the running max is
        taken of the raw scores, and the scale goes into the exponent's one multiply-add (``_exp2_scaled``). With a
        window ``rows`` holds each row's diagonal ``i + offset`` and the band is ``[diag - win_left, diag +
        win_right]``; ``first_visible_edge`` is still the first row's diagonal."""
        if WINDOW:
            last_left = first_visible_edge + (_WG - 1) - win_left  # the last row's first key
            first_right = first_visible_edge + win_right  # the first row's last key
            if j * BLOCK_N < last_left or (j + 1) * BLOCK_N - 1 > first_right or (j + 1) * BLOCK_N > NK:
                cols = j * BLOCK_N + cols0
                seen = (cols[None, :] >= rows[:, None] - win_left) & (cols[None, :] <= rows[:, None] + win_right)
                s = gl.where(seen & (cols[None, :] < NK), s, float("-inf"))
        elif CAUSAL:  # keys past the end lie past every real row's diagonal too
            if (j + 1) * BLOCK_N > first_visible_edge + 1:  # some key of the tile lies past some row's last key
                cols = j * BLOCK_N + cols0
                s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        elif KEY_TAIL:  # the key length is no multiple of the tile
            if (j + 1) * BLOCK_N > NK:  # the last tile, partly past the last key
                cols = j * BLOCK_N + cols0
                s = gl.where(cols[None, :] < NK, s, float("-inf"))
        return s

    @gluon.jit
    def _exp2_scaled(s, m, qk_scale, FP8: gl.constexpr):
        """``exp2(s * qk_scale - m * qk_scale)`` row by row: one fused multiply-add and one exponential per score
        (a max taken of scaled scores would cost a multiply more). With ``FP8``, times ``2^FP8_P_SHIFT``, the shift
        taken off the row's term."""
        if FP8:
            return gl.exp2(s * qk_scale - (m * qk_scale - _P_SHIFT)[:, None])
        else:
            return gl.exp2(s * qk_scale - (m * qk_scale)[:, None])

    @gluon.jit
    def _v_operand(v_smem, stage, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
        """V's tile in the ring as ``P V``'s second operand, ``(BLOCK_N, HEAD_DIM)``. 8-bit products take it with
        the keys (their inner dimension) contiguous: V^T's tile, viewed transposed."""
        if FP8:
            return v_smem.index(stage).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
        else:
            return v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])

    @gluon.jit
    def _p_operand(p, p_buf, p_layout: gl.constexpr, dtype: gl.constexpr, FP8: gl.constexpr):
        """P as ``P V``'s first operand: in registers; with ``FP8`` stored in e4m3 to this warpgroup's shared buffer
        (Triton 3.6 cannot wait on a product whose register operand is 8-bit), which the product then reads. The
        buffer is rewritten only after the product that read it last has been waited for."""
        if FP8:
            p_buf.store(p.to(dtype))
            fence_async_shared()
            return p_buf
        else:
            return gl.convert_layout(p.to(dtype), p_layout)

    @triton.constexpr_function
    def _p_smem_layout(block_n):
        """P's e4m3 tile in shared memory, ``(64, block_n)``, swizzled as a wgmma operand reads it."""
        return gl.NVMMASharedLayout(swizzle_byte_width=min(block_n, 128), element_bitwidth=8, rank=2)

    @triton.constexpr_function
    def _operand_width(bits):
        """Consecutive elements of P a thread holds along the product's inner dimension: 32 bits' worth."""
        return 32 // bits

    @gluon.jit
    def _finite(m, WINDOW: gl.constexpr):
        """The running max to subtract: with a window a row may have seen only hidden keys so far (max -inf); it
        is taken about 0 then, so its p and rescale come out 0 rather than NaN from (-inf) - (-inf)."""
        if WINDOW:
            m = gl.where(m == float("-inf"), 0.0, m)
        return m

    @gluon.jit
    def _take_turn(turn, n, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the warpgroup before this one has issued its products (warpgroup 0 goes first,
        then 1, ..., round and round)."""
        if PINGPONG:
            if WG == 0:
                mbarrier.wait(turn.index(WG), (n & 1) ^ 1)
            else:
                mbarrier.wait(turn.index(WG), n & 1)

    @gluon.jit
    def _give_turn(turn, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: this warpgroup's products are issued; the next one may issue its own."""
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG))

    @gluon.jit
    def _pv_done(acc_next, p_op, scale, v_empty, prev, NQ, LATE_WAIT: gl.constexpr, FP8: gl.constexpr):
        """Wait for tile j-1's ``P V``, release its V buffer and rescale O by ``scale``. ptxas (CUDA 12.8) schedules
        within a basic block and moves such a wait up to the block's start, above the softmax written before it,
        so the warpgroup's exponentials cannot run under its own ``P V``. With ``LATE_WAIT`` the wait starts a
        block of its own: a branch on ``NQ > 0``, always taken (a launch has query rows; should the compiler ever
        fold the test, the early wait comes back, which is only slower). Its other side begins and ends
        differently -- a wait for O's bulk stores first, the release last -- so that the compiler cannot merge the
        two sides back into the block before them. With ``FP8`` P came from shared memory (``p_op`` is unused)."""
        if FP8:
            acc = warpgroup_mma_wait(0, deps=(acc_next,))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * scale
        elif not LATE_WAIT or NQ > 0:  # without LATE_WAIT a constant: no branch
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_next, p_op))  # p_op's registers stay read until here
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * scale
        else:
            tma.store_wait(0)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_next, p_op))
            acc = acc * scale
            mbarrier.arrive(v_empty.index(prev))
        return acc

    @gluon.jit
    def _consumer(desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                  turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh, SCHED, qk_scale,
                  WG: gl.constexpr, NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, WINDOW: gl.constexpr,
                  PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr, SCHEDULED: gl.constexpr, LATE_WAIT: gl.constexpr,
                  FP8: gl.constexpr):  # fmt: skip
        """One consumer warpgroup: for each tile of the program, 64 query rows through every key tile, the softmax
        of tile j under the P V product of tile j-1 (the module docstring's schedule), then O and the lse. O
        leaves through its own shared memory while the next tile starts; the copy engine drops rows past the
        head's end, and the lse stores are masked there. With ``FP8`` the products run on e4m3 operands and each
        head's descales (``DESCALE``: q's, k's, v's for every (batch, query head), one row each) scale the scores
        and O; a bad descale gives its head NaN rows."""
        dtype: gl.constexpr = v_smem.dtype  # P enters the second product in V's dtype
        s_layout: gl.constexpr = _mma_layout(BLOCK_N, dtype.primitive_bitwidth)
        o_layout: gl.constexpr = _mma_layout(HEAD_DIM, dtype.primitive_bitwidth)
        p_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=o_layout, k_width=_operand_width(dtype.primitive_bitwidth)
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        BLOCK_M: gl.constexpr = NUM_WG * _WG
        cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([_WG, BLOCK_N], gl.float32, s_layout)
        q = q_smem.index(WG).reshape([_WG, HEAD_DIM])
        o_buf = o_smem.index(WG)
        p_buf = p_smem.index(WG)  # FP8 only (else a placeholder, never touched)

        count = 0  # K/V tiles consumed so far (the loader's count)
        turns = 0  # products issued in turn (ping-pong)
        done = 0  # query tiles finished
        first, end, step = _walk(SCHED, n_m, n_bh, SCHEDULED)
        code = _code_at(first, SCHED, SCHEDULED)
        for t in range(first, end, step):
            code_next = _code_at(t + step, SCHED, SCHEDULED)  # read ahead: off this tile's critical path
            m, bh = _tile_of(code, n_m, CAUSAL, SCHEDULED)
            row_lo = m * BLOCK_M
            j0, j1 = _key_range(row_lo, NQ, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
            n_tiles = j1 - j0  # at least 1: ``unavailable`` refuses a band that leaves a row with no key
            edge = row_lo + offset + WG * _WG  # this warpgroup's first row's diagonal (causal: its last key)
            rows = edge + gl.arange(0, _WG, layout=row_layout)  # each row's diagonal
            acc = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)
            score_scale = qk_scale
            if FP8:  # this head's descales: q's and k's join the softmax scale, v's O's
                q_descale = gl.load(DESCALE + bh)
                k_descale = gl.load(DESCALE + n_bh + bh)
                v_descale = gl.load(DESCALE + 2 * n_bh + bh)
                score_scale = qk_scale * q_descale * k_descale
            mbarrier.wait(q_ready.index(WG), done & 1)

            # the first key tile: its scores and softmax (nothing to overlap yet)
            stage = count % STAGES
            mbarrier.wait(k_ready.index(stage), (count // STAGES) & 1)
            _take_turn(turn, turns, WG, PINGPONG)
            k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            s = warpgroup_mma(q, k_t, zero_s, use_acc=False, is_async=True)
            _give_turn(turn, WG, NUM_WG, PINGPONG)
            turns += 1
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))
            s = _scores(s, j0, rows, edge, cols0, NK, win_left, win_right, CAUSAL, KEY_TAIL, WINDOW, BLOCK_N)
            m_i = gl.max(s, 1)  # the raw scores' running max; without a window key 0 is in every real row's view
            p = _exp2_scaled(s, _finite(m_i, WINDOW), score_scale, FP8)
            l_i = gl.sum(p, 1)

            for i in range(1, n_tiles):
                j = j0 + i
                prev = (count + i - 1) % STAGES
                stage = (count + i) % STAGES
                mbarrier.wait(k_ready.index(stage), ((count + i) // STAGES) & 1)
                _take_turn(turn, turns, WG, PINGPONG)
                k_t = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                s_next = warpgroup_mma(q, k_t, zero_s, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((count + i - 1) // STAGES) & 1)
                p_op = _p_operand(p, p_buf, p_layout, dtype, FP8)
                v_t = _v_operand(v_smem, prev, HEAD_DIM, BLOCK_N, FP8)
                acc_next = warpgroup_mma(p_op, v_t, acc, is_async=True)
                _give_turn(turn, WG, NUM_WG, PINGPONG)
                turns += 1
                s = warpgroup_mma_wait(1, deps=(s_next,))  # the scores are done; P V of tile j-1 may still run
                mbarrier.arrive(k_empty.index(stage))
                s = _scores(s, j, rows, edge, cols0, NK, win_left, win_right, CAUSAL, KEY_TAIL, WINDOW, BLOCK_N)
                m_new = gl.maximum(m_i, gl.max(s, 1))
                m_use = _finite(m_new, WINDOW)
                alpha = gl.exp2((m_i - m_use) * score_scale)
                p = _exp2_scaled(s, m_use, score_scale, FP8)
                l_i = l_i * alpha + gl.sum(p, 1)
                m_i = m_new
                scale = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                acc = _pv_done(acc_next, p_op, scale, v_empty, prev, NQ, LATE_WAIT, FP8)
            if not O_IN_Q:
                mbarrier.arrive(q_empty.index(WG))  # every product reading Q is done: the loader may fetch the next

            last = (count + n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((count + n_tiles - 1) // STAGES) & 1)
            v_t = _v_operand(v_smem, last, HEAD_DIM, BLOCK_N, FP8)
            acc = warpgroup_mma(_p_operand(p, p_buf, p_layout, dtype, FP8), v_t, acc)
            mbarrier.arrive(v_empty.index(last))
            count += n_tiles

            # epilogue: O through shared memory and a bulk copy, the lse with stores
            o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
            if FP8:  # O times v's descale; a bad descale (not finite and > 0) makes the head's rows NaN
                ok = (q_descale > 0) & (q_descale < float("inf")) & (k_descale > 0) & (k_descale < float("inf"))
                ok = ok & (v_descale > 0) & (v_descale < float("inf"))
                o = gl.where(ok, o * v_descale, float("nan"))
                lse = gl.where(ok, (m_i * score_scale + gl.log2(l_i) - _P_SHIFT) * LN_2, float("nan"))
            else:
                lse = (m_i * score_scale + gl.log2(l_i)) * LN_2
            if (CAUSAL or WINDOW) and not FP8:  # a hidden key's inf or NaN in V reaches its tile through P V: mark it
                bad = gl.max(gl.where(gl.abs(acc) < float("inf"), 0, 1), 1)
                lse = gl.where(gl.convert_layout(bad, row_layout) > 0, float("nan"), lse)
            row0 = row_lo + WG * _WG
            if not O_IN_Q:
                tma.store_wait(0)  # the previous tile's O has left the buffer
            o_buf.reshape([_WG, HEAD_DIM]).store(o.to(desc_o.dtype))
            fence_async_shared()
            _tma_store(desc_o, [bh // HQ, bh % HQ, row0, 0], o_buf)
            if O_IN_Q:  # O left through Q's buffer: release it once the store has read it
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(WG))
            offs = row0 + gl.arange(0, _WG, layout=row_layout)
            gl.store(LSE + bh * NQ + offs, lse, mask=offs < NQ)
            done += 1
            code = code_next
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=RUNTIME_LENGTHS, do_not_specialize_on_alignment=RUNTIME_LENGTHS)
    def _attn_fwd_overlap(desc_q, desc_k, desc_v, desc_o, LSE, SCHED, DESCALE, HQ, NQ, NK, GROUP, offset, win_left,
                          win_right, qk_scale, n_bh, HEAD_DIM: gl.constexpr, NUM_WG: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr,
                          WINDOW: gl.constexpr, PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr,
                          SCHEDULED: gl.constexpr, LATE_WAIT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          FP8: gl.constexpr = False):  # fmt: skip
        """A persistent grid: each program walks its (query tile, head) pairs (``_walk``: its list in ``SCHED``, or
        every ``programs``-th tile), with a loader warp and ``NUM_WG`` consumer warpgroups of 64 rows. With ``FP8``
        q, k and V^T (``desc_v`` over ``(B, Hk, D, Nk')``) are e4m3, O bfloat16, and ``DESCALE`` holds the descales
        (``_consumer``); otherwise ``DESCALE`` is never read."""
        dtype: gl.constexpr = desc_q.dtype
        BLOCK_M: gl.constexpr = NUM_WG * _WG
        n_m = (NQ + BLOCK_M - 1) // BLOCK_M
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 1, 1, _WG, HEAD_DIM], desc_q.layout)
        if O_IN_Q:  # D = 256: a separate O buffer would not fit beside the K/V ring
            o_smem = q_smem
        else:
            o_smem = gl.allocate_shared_memory(desc_o.dtype, [NUM_WG, 1, 1, _WG, HEAD_DIM], desc_o.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], desc_k.layout)
        if FP8:  # V^T's tiles: the keys along the rows; P's e4m3 tile per warpgroup
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, HEAD_DIM, BLOCK_N], desc_v.layout)
            p_smem = gl.allocate_shared_memory(dtype, [NUM_WG, _WG, BLOCK_N], _p_smem_layout(BLOCK_N))
        else:
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], desc_v.layout)
            p_smem = q_smem  # never used
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(NUM_WG):
            mbarrier.init(q_ready.index(w), count=1)  # the loader's expect + the copy's bytes
            mbarrier.init(q_empty.index(w), count=1)  # its warpgroup has issued its last Q K product
            mbarrier.init(turn.index(w), count=1)  # the warpgroup before it has issued its products
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WG)  # every consumer warpgroup releases each buffer
            mbarrier.init(v_empty.index(i), count=NUM_WG)

        # the partitions: consumer warpgroups 0, 1 (, 2) and the loader warp (Gluon takes each one's arguments
        # written out)
        if NUM_WG == 1:
            gl.warp_specialize([
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 0, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                           k_empty, v_empty, HQ, NQ, NK, GROUP, offset, win_left, win_right, n_m, n_bh, SCHED,
                           NUM_WG, BLOCK_N, STAGES, CAUSAL, WINDOW, O_IN_Q, SCHEDULED, FP8)),
            ], [1], [_LOADER_REGS])  # fmt: skip
        elif NUM_WG == 2:
            gl.warp_specialize([
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 0, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 1, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                           k_empty, v_empty, HQ, NQ, NK, GROUP, offset, win_left, win_right, n_m, n_bh, SCHED,
                           NUM_WG, BLOCK_N, STAGES, CAUSAL, WINDOW, O_IN_Q, SCHEDULED, FP8)),
            ], [4, 1], [CONSUMER_REGS, _LOADER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 0, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 1, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_consumer, (desc_o, q_smem, o_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn, LSE, DESCALE, HQ, NQ, NK, offset, win_left, win_right, n_m, n_bh,
                             SCHED, qk_scale, 2, NUM_WG, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, WINDOW, PINGPONG,
                             O_IN_Q, SCHEDULED, LATE_WAIT, FP8)),
                (_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                           k_empty, v_empty, HQ, NQ, NK, GROUP, offset, win_left, win_right, n_m, n_bh, SCHED,
                           NUM_WG, BLOCK_N, STAGES, CAUSAL, WINDOW, O_IN_Q, SCHEDULED, FP8)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, _LOADER_REGS])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Where it runs, and the launch
# ----------------------------------------------------------------------------------------------------------------


def unavailable(q, k, v, causal, window) -> str | None:
    """Why this rung cannot run these inputs here, or None."""
    why = gluon_hopper.not_here(q)
    if why is not None:
        return why
    if q.dtype == torch.float32:
        return "it runs 16-bit inputs only (its dots are the tensor cores')"
    d, nq, nk = q.shape[3], q.shape[2], k.shape[2]
    if d not in HEAD_DIMS:
        return f"its tiles are built for head dims {', '.join(map(str, HEAD_DIMS))}, not {d}"
    if causal and nq > nk:
        return "under a causal mask it needs no more queries than keys (some rows would see no key)"
    if window is not None:
        offset, _, right = visible_band(nq, nk, causal, window)
        if offset + right < 0:  # the first row's band ends left of key 0 (the band is bottom-right aligned)
            return "its window leaves some query rows with no key to see (the Hopper rung gives them zeros)"
    return gluon_hopper.first_not_describable(q=q, k=k, v=v)


_strides = gluon_hopper.strides  # the launcher's planned path (flashlab.host.launches) reads them too


# Where the benchmark measured this rung faster than the rungs below it (H200, 16-bit, docs/forward-ladder.md)
PREFERRED_HEAD_DIMS = (64, 128, 256)


def preferred(q, k, v, causal, window) -> bool:
    """Whether ``flash_attention`` picks this rung by default for these inputs (``PREFERRED_HEAD_DIMS``)."""
    return q.shape[3] in PREFERRED_HEAD_DIMS


_descriptor = gluon_hopper.descriptor


def launch_shape(q, k, causal, window, band):
    """The kernel's ``(grid, schedule table, scalar arguments, constexprs)`` for one call signature; the table is
    None where the programs walk the tiles in a fixed stride (a launch then passes lse in its place, never read).
    Chunked prefill meets new lengths on every call: the constexprs are one dict per combination, kept."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    num_wg, block_n, stages = tiles(d, nq, nk, causal, window)
    block_m = num_wg * WG_ROWS
    n_m = cdiv(nq, block_m)
    programs = min(n_m * b * hq, sm_count(device_index(q)) * PROGRAMS_PER_SM[num_wg])
    table = None
    windowed = window is not None
    if (causal or windowed) and d in SCHEDULED_HEAD_DIMS:
        lengths = tuple(tile_schedule.key_tiles(m * block_m, block_m, block_n, nq, nk, offset, win_left, win_right,
                                                causal, windowed) for m in range(n_m))  # fmt: skip
        table = tile_schedule.kept_table(lengths, b * hq, programs, q.device)
        if table is None and not stream_capturing():  # a CUDA graph's capture cannot copy a new one to the GPU
            table = tile_schedule.table(lengths, b * hq, programs, q.device)
    # Causal and not scheduled (D = 256, or a first call inside a CUDA graph's capture, where the table cannot be
    # copied to the GPU), one program per tile: the GPU hands a tile to a multiprocessor as one finishes, which
    # balances tiles of unequal length in the order they come. Otherwise persistent, one program per multiprocessor.
    scheduled = table is not None
    if causal and not scheduled:
        programs = n_m * b * hq
    scalars = (hq, nq, nk, hq // hk, offset, win_left, win_right, qk_scale, b * hq)
    # A window's band says everything a causal mask would (win_right <= 0), so windowed calls, causal or not, take
    # one binary: the kernel's CAUSAL only orders the tiles of an unscheduled causal walk, longest first
    kind = (d, num_wg, block_n, stages, bool(causal) and not windowed, windowed,
            not causal and not windowed and nk % block_n != 0, scheduled)  # fmt: skip
    meta = _METAS.get(kind)
    if meta is None:
        meta = _METAS[kind] = dict(
            HEAD_DIM=d, NUM_WG=num_wg, BLOCK_N=block_n, STAGES=stages, CAUSAL=kind[4], WINDOW=kind[5],
            KEY_TAIL=kind[6], PINGPONG=PINGPONG and num_wg > 1, O_IN_Q=d in O_THROUGH_Q, SCHEDULED=scheduled,
            LATE_WAIT=d in LATE_WAIT_HEAD_DIMS, CONSUMER_REGS=CONSUMER_REGS[num_wg], num_warps=4,
        )  # fmt: skip
        if num_wg in LAUNCH_REGS:
            meta["maxnreg"] = LAUNCH_REGS[num_wg]
    return (programs,), table, scalars, meta


_METAS = {}  # launch_shape's constexprs per (head dim, tiles, mask kind, key tail, scheduled): never changed


def kept_constexprs(kind: tuple):
    """``launch_shape``'s constexprs dict for ``kind`` (head dim, consumer warpgroups, BLOCK_N, STAGES, causal,
    window, key tail, scheduled), or None where no call has made it yet."""
    return _METAS.get(kind)


def tiles(d, nq, nk, causal, window):
    """``(consumer warpgroups, BLOCK_N, STAGES)`` for a call: ``TILES``, or ``UNMASKED_LONG_TILES`` or
    ``SHORT_CAUSAL_TILES`` where they apply."""
    rows, long_tiles = UNMASKED_LONG_TILES.get(d, (None, None))
    if long_tiles is not None and not causal and window is None and nq >= rows:
        return long_tiles
    rows, short_tiles = SHORT_CAUSAL_TILES.get(d, (None, None))
    if short_tiles is not None and causal and window is None and max(nq, nk) <= rows:
        return short_tiles
    return TILES[d]


def descriptors(q, k, v, o, block_n):
    """The four tensors' copy-engine descriptors: Q and O in 64-row tiles, K and V in key tiles of ``block_n``."""
    return _descriptor(q, WG_ROWS), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(o, WG_ROWS)


def fp8_descriptors(q, k, vt, o, block_n):
    """``descriptors`` for ``launch_fp8``: V^T ``(B, Hk, D, Nk')`` in tiles of all D rows and ``block_n`` keys."""
    return (
        _descriptor(q, WG_ROWS),
        _descriptor(k, block_n),
        _descriptor(vt, q.shape[3], block_n),
        _descriptor(o, WG_ROWS),
    )


def launch(q, k, v, o, lse, causal, window, band, config=None):
    """Run the kernel once on prepared inputs, writing ``o (B, Hq, Nq, D)`` and ``lse (B, Hq, Nq)``.

    Inputs as ``rung2_skip_split.launch`` takes them (the host engine checks and prepares them). Its tiles
    are fixed (``tiles``): a ``config`` is refused. Under a causal mask or a window the Hopper rung's repair pass
    follows, which redoes only query tiles marked non-finite (none, on finite inputs) and otherwise returns at
    once."""
    why = unavailable(q, k, v, causal, window)
    if why is not None:
        raise RuntimeError(f"the overlap rung cannot run these inputs: {why}")
    if config is not None:
        raise ValueError("the overlap rung's tiles are fixed (TILES, per head dim); it takes no config")
    why = not_describable(o)
    if why is not None or not lse.is_contiguous():
        raise RuntimeError(f"the overlap rung cannot write o and lse: {why or 'lse is not contiguous'}")
    grid, table, scalars, meta = launch_shape(q, k, causal, window, band)
    with torch.cuda.device(q.device):
        table = lse if table is None else table
        _attn_fwd_overlap[grid](*descriptors(q, k, v, o, meta["BLOCK_N"]), lse, table, lse, *scalars, **meta)
        if causal or window is not None:
            kernel, rgrid, rargs, rmeta = hopper.repair_parts(q, k, v, o.stride()[:3], causal, window, band)
            kernel[rgrid](q, k, v, o, lse, *rargs, **rmeta)


# Head dims where the FP8 forward (``flashlab.host.fp8``) runs this kernel with 8-bit operands (``FP8``). At D = 256 O
# leaves through Q's buffer, which an 8-bit Q cannot hold; the FP8 forward's copy-engine kernel runs it there.
FP8_HEAD_DIMS = (64, 128)


def fp8_unavailable(q, k, v, causal, window) -> str | None:
    """Why ``launch_fp8`` cannot run these e4m3 inputs here, or None: this rung's conditions, at ``FP8_HEAD_DIMS``."""
    if q.shape[3] not in FP8_HEAD_DIMS:
        return f"with 8-bit inputs it runs head dims {', '.join(map(str, FP8_HEAD_DIMS))}, not {q.shape[3]}"
    return unavailable(q, k, v, causal, window)


def launch_fp8(q, k, vt, o, lse, q_descale, k_descale, v_descale, band, causal, window):
    """The kernel with 8-bit operands (``fp8_unavailable`` says where): q ``(B, Hq, Nq, D)`` and k ``(B, Hk, Nk, D)``
    e4m3, contiguous; ``vt`` V transposed, ``(B, Hk, D, Nk')`` with the keys contiguous (padded with zeros, as
    ``flashlab.kernels.fp8_forward.transposed_v`` makes it); o bfloat16 and lse as ``launch`` writes them; the
    descales float32 ``(B, Hk)``, laid out here per query head as the kernel reads them. ``band`` is
    ``(offset, win_left, win_right, scale * log2 e)``. No repair pass: e4m3 holds no infinities."""
    grid, table, scalars, meta = launch_shape(q, k, causal, window, band)
    group = q.shape[1] // k.shape[1]
    descale = torch.stack((q_descale, k_descale, v_descale)).repeat_interleave(group, dim=2).contiguous()
    with torch.cuda.device(q.device):
        _attn_fwd_overlap[grid](*fp8_descriptors(q, k, vt, o, meta["BLOCK_N"]), lse, lse if table is None else table,
                                descale, *scalars, **{**meta, "FP8": True, "O_IN_Q": False})  # fmt: skip


attn_fwd_overlap = _attn_fwd_overlap if GLUON_ERROR is None else None  # the kernel (None where Gluon is missing)

# the parameters a launch's q, k, v, o, lse and the schedule table go to
DESCRIBED_TENSORS = ("desc_q", "desc_k", "desc_v", "desc_o", "LSE", "SCHED", "DESCALE")

__all__ = [
    "CAPABILITY",
    "DESCRIBED_TENSORS",
    "FP8_HEAD_DIMS",
    "FP8_P_SHIFT",
    "HEAD_DIMS",
    "NAME",
    "RUNTIME_LENGTHS",
    "TILES",
    "attn_fwd_overlap",
    "descriptors",
    "fp8_descriptors",
    "fp8_unavailable",
    "launch",
    "launch_fp8",
    "launch_shape",
    "not_describable",
    "preferred",
    "tiles",
    "unavailable",
]
