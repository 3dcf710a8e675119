"""How the host engine plans and runs each path: what a ``Plan`` holds for it, and its launch.

- ``attention_call``: a ``flash_attention`` signature's ``Call`` and the bucket's plan it runs -- split-KV for
  decode, else the rung of the kernel ladder that runs (skip-and-split, Hopper, overlap; the lesson loop and calls
  with a fixed config are a plain launch every call). ``run_attention`` allocates the outputs and launches it.
  Split-KV and skip-and-split plans are shared by every signature of their bucket (``flashlab.host.plan``): the
  signature's runtime scalars and grid are computed here, once per signature.
- ``kvcache_plan`` / ``run_kvcache``: the same for ``flash_attention_with_kvcache``.

Each path's ``run_*`` launches through Triton's JIT until the plan's direct launch is checked
(``Plan.advance``), then through the direct launch only. The kernels, their arguments and their plain launches
live in ``flashlab.kernels``; this module adds what makes a repeated call cheap.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading

import torch

from flashlab.core.integers import cdiv
from flashlab.host import direct_launch, kvcache_errors
from flashlab.host import plan as plans
from flashlab.host.launcher import FastLaunch, current_stream, reproduces, same_bits
from flashlab.host.plan import BUILT, CHECKED, OFF, Call, Plan
from flashlab.host.scratch import scratch, workspace
from flashlab.kernels import configs, ladder, softmax_step
from flashlab.kernels.decode import kvcache, split_kv
from flashlab.kernels.device import CPU_CONFIG, current_device_index, kernel_band, sm_count, stream_capturing
from flashlab.kernels.interpreter import interpreted, interpreted_language
from flashlab.kernels.ladder import rung2_skip_split as skip_split

SPLIT_KV, KVCACHE = "split_kv", "kvcache"
_NO_CONTEXT = contextlib.nullcontext()


def unit_stride_d(q, k, v):
    """q, k, v with unit stride along D (the kernels' 16-byte vector loads): a copy of any other; and a ValueError
    where 32-bit row offsets cannot reach every row."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    nq, nk = q.shape[2], k.shape[2]
    if max(nq * q.stride(2), nk * k.stride(2), nk * v.stride(2)) >= 2**31:  # 32-bit row offsets in the kernel
        raise ValueError("sequence too long for this memory layout (row offsets exceed 2**31); pass contiguous tensors")
    return q, k, v


# ----------------------------------------------------------------------------------------------------------------
# flash_attention: the plan of a signature
# ----------------------------------------------------------------------------------------------------------------


def kernel_config(kernel: str, q, kv_heads: int, nk: int, band, **extra) -> dict:
    """The tile config a planned kernel runs with on q's GPU (``flashlab.kernels.configs.pick``: the shipped
    table by bucket, or a default that fits everywhere), never the autotuner. ``band`` as ``kernel_band`` gives
    it (its first three)."""
    fields = configs.launch_fields(q, kv_heads, nk, *band[:3])
    return dict(configs.pick(kernel, **fields, **extra))


def autotuning() -> bool:
    """Whether the user opted into Triton's autotuners (``FLASHLAB_AUTOTUNE=1``): then a plan's config is the
    autotuner's pick on its first launch, and its key holds the autotuner's length classes instead."""
    return configs.autotune_enabled()


def attention_call(q, k, v, causal, window, scale, num_splits, rung, config=None) -> Call:
    """The ``Call`` of a checked ``flash_attention`` signature (``num_splits`` and ``rung`` as there), with the
    plan of its bucket. ``config`` (a dict of BLOCK_M, BLOCK_N, num_warps, num_stages) fixes the prefill kernel's
    tiles: a plain launch every call (the small query tiles a differentiable decode-sized call runs with)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    if q.is_cuda:
        direct_launch.prepare()  # the direct launcher's C module, built while this call's kernel compiles
    copy = tuple(x.stride(-1) != 1 for x in (q, k, v))
    q, k, v = unit_stride_d(q, k, v)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, nk, d, causal, window, scale)
    if negate:
        q = -q  # everything below reads the tensor a launch runs on: -q may have other strides than q
    band = (offset, win_left, win_right, qk_scale)
    if num_splits is not None or (rung is None and config is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS):
        call = split_call(q, k, v, causal, window, band, num_splits)
    elif config is not None and rung is None:  # a fixed config goes to skip-and-split, as in forward's switches
        plan = Plan(skip_split.NAME, run_plain)
        plan.extra = (ladder.rung_named(skip_split.NAME), causal, window, band, config)
        call = Call(plan)
    else:
        chosen, note = ladder.select(rung, q, k, v, causal, window)
        if config is not None or chosen.name not in _PLANNED:
            plan = Plan(chosen.name, run_plain)
            plan.extra = (chosen, causal, window, band, config)
            call = Call(plan)
        elif chosen.name in _BUCKETED:
            call = _PLANNED[chosen.name](q, k, v, causal, window, band)
        else:
            call = Call(_PLANNED[chosen.name](q, k, v, causal, window, band))
        call.note = note
    call.copy, call.negate = copy, negate
    call.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
    call.o_shape, call.lse_shape = (b, hq, nq, d), (b, hq, nq)
    return call


def run_attention(call: Call, q, k, v, need_lse=True):
    """Launch a call on tensors of its signature: ``(o, lse)``, lse None when ``need_lse`` is False and the
    split-KV path ran (it then writes the lse to scratch memory instead of a new tensor)."""
    if True in call.copy:
        q, k, v = (x.contiguous() if c else x for x, c in zip((q, k, v), call.copy, strict=True))
    if call.negate:
        q = -q
    o = torch.empty_like(q) if call.o_like_q else torch.empty(call.o_shape, dtype=q.dtype, device=q.device)
    plan = call.plan
    if need_lse or plan.path is not SPLIT_KV:
        lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
    else:
        lse = None
    plan.run(call, q, k, v, o, lse)
    return o, lse


def run_plain(call, q, k, v, o, lse):
    """A rung's plain launch (``flashlab.kernels.ladder``), every call: the lesson loop, or a fixed config."""
    chosen, causal, window, band, config = call.plan.extra
    chosen.launch(q, k, v, o, lse, causal, window, band, config=config)


# ----------------------------------------------------------------------------------------------------------------
# Split-KV and the KV cache: one launch, its chunks merged by their last finishers
# ----------------------------------------------------------------------------------------------------------------


def split_call(q, k, v, causal, window, band, num_splits) -> Call:
    """A split-KV signature's call: its chunks, grid and runtime scalars (``split_kv.SplitArguments``), and the
    plan of its bucket: dtype, head dim, mask kind, GQA group, the packed-row tile and the merge's constexprs, the
    tile config, the strides' classes, the tensors' alignment (``flashlab.host.plan``)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    o = torch.empty((b, hq, nq, d), dtype=q.dtype, device="meta")  # for its strides only
    args = split_kv.SplitArguments(q, k, v, o, *band, num_splits)
    aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    if not q.is_cuda:
        config, tune = {"BLOCK_N": CPU_CONFIG["BLOCK_N"]}, None
    elif autotuning():
        config, tune = None, args.tune  # the autotuner's pick, made on the plan's first launch
    else:
        config, tune = kernel_config(SPLIT_KV, q, hk, nk, band), None
    head = (SPLIT_KV, q.device, q.dtype, d, plans.mask_kind(causal, window), hq // hk)
    config_key = None if config is None else tuple(sorted(config.items()))
    return _split_call_of(head, args, config, config_key, tune, aligned, plans.int_classes(args.scalars[:12]))


def _split_call_of(head, args, config, config_key, tune, aligned, classes) -> Call:
    """The ``Call`` of split-KV arguments ``args`` with the plan of their bucket: ``head`` the key's first fields
    (path, device, dtype, head dim, mask kind, group), ``config`` the tiles (``config_key`` as a sorted tuple; None
    where the autotuner picks, ``tune`` then its key), ``aligned`` the tensors' 16-byte alignment, ``classes`` the
    int classes of the twelve strides that open ``args.scalars``."""
    key = (*head, tuple(args.meta.items()), config_key, tune, classes, plans.wide(args.scalars[12:-1] + args.tune),
           aligned)  # fmt: skip

    def make():
        plan = Plan(SPLIT_KV, run_split)
        plan.meta, plan.config = args.meta, config
        if not aligned:  # addresses of other alignments compile other binaries: the JIT picks per call
            plan.state = OFF
        return plan

    call = Call(plans.planned(key, make))
    call.args, call.grid = args, args.grid
    call.values = (*args.scalars, *args.tune)  # split_kv.SCALAR_PARAMETERS
    return call


def _shapes(q, k, v, key):
    """``(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride())``, from the signature ``key``
    (``flashlab.host.plan.signature``, which opens with them) where given."""
    if key is None:
        return q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride()
    return key[:6]


class SplitFamily:
    """The split-KV calls of one family (``flashlab.host.plan.family_key``: one signature but for its keys'
    count), made from integers alone. A decode loop over a growing cache would otherwise check and plan every
    step from scratch (about 100 us of Python on a GPU server's host, five times the launch); here only what a
    new length changes is worked out: the band, the chunks, the scalars, the grid, the bucket's plan (and its tile
    config, once per length bucket).

    ``call(q, k, v)`` gives the ``Call`` of a new length, or None where that length leaves what the family covers
    (another query count, too many keys for 32-bit row offsets, fewer keys than ``num_splits``): then the full path
    checks it and names the problem. Made from a checked call that needed no copies, ran q as given, and picks its
    tiles by table."""

    __slots__ = ("last", "head", "aligned", "band", "num_splits", "configs", "cuda", "strides", "classes", "plans",
                 "met", "slots")  # fmt: skip

    def __init__(self, call, q, k, causal, window, scale, num_splits, aligned):
        self.last = call  # the family's latest call: its outputs' shapes, its scratch views
        self.head = (SPLIT_KV, q.device, q.dtype, q.shape[3], plans.mask_kind(causal, window), q.shape[1] // k.shape[1])
        self.aligned = aligned  # the family key holds the signature's alignment: the same for every call of it
        self.band = (q.shape[2], q.shape[3], causal, window, scale)
        self.num_splits = num_splits
        self.configs = {}  # (nk's length bucket, mask kind) -> (config, its sorted tuple)
        self.cuda = q.is_cuda
        self.strides = self.classes = None
        self.plans = {}  # (the meta dict's id, the config, the strides' classes, wide) -> the bucket's plan
        self.met = set()  # the (nq, nk) pairs it made calls for, as ints (plan.met_before)
        # a growing cache's steps, by slot -- the chunk count and nk's power-of-two bucket, as one int -- the latest
        # call there (for the strides in self.strides; cleared when they change). A step of a known slot takes its
        # plan, its cut of the scratch and its arguments object (the chunks, grid, constexprs and scratch sizes,
        # which only the slot decides); its own runtime scalars are its values
        # (so ``args.scalars`` are those of the slot's first length)
        self.slots = {}

    @staticmethod
    def of(call, q, k, v, causal, window, scale, num_splits):
        """The family a checked split-KV call starts (``family_of`` has checked it may start one)."""
        aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
        return SplitFamily(call, q, k, causal, window, scale, num_splits, aligned)

    def call(self, q, k, v, key=None):
        """The call of ``q``, ``k``, ``v`` (``key``, where given, their signature: its shapes and strides are read
        instead of asking the tensors again), or None."""
        if key is None:  # _shapes, inline: a growing cache's step runs through here
            q_shape, k_shape, v_shape, k_strides, v_strides = q.shape, k.shape, v.shape, k.stride(), v.stride()
        else:
            q_shape, _, k_shape, k_strides, v_shape, v_strides = key[:6]
        nk = k_shape[2]
        nq, d, causal, window, scale = self.band
        splits = self.num_splits
        if q_shape[2] != nq or nk < 1 or v_shape[2] != nk:
            return None
        if splits is not None and splits > min(nk, split_kv.MAX_SPLITS):
            return None
        if nk * k_strides[2] >= 2**31 or nk * v_strides[2] >= 2**31:
            return None
        last = self.last
        if window is None and splits is None and nk < 2**30 and self.strides == (k_strides, v_strides):
            # a growing cache's step: no window, the chunks chosen, the strides of the last call
            num_splits, keys_per_split = split_kv.unwindowed_chunks(nk, last.args.fixed[1])
            slot = self.slots.get(num_splits << 32 | (nk - 1).bit_length())
            if slot is not None:
                args = slot.args
                win_left = nq + nk + 1
                call = Call(slot.plan)
                call.args, call.grid, call.views = args, args.grid, slot.views
                call.values = (*args.scalars[:16], nk, nk - nq, win_left, 0 if causal else win_left, keys_per_split,
                               num_splits, *args.scalars[-1:], *args.tune)  # fmt: skip
                call.o_like_q, call.o_shape, call.lse_shape = last.o_like_q, last.o_shape, last.lse_shape
                self.last = self.slots[num_splits << 32 | (nk - 1).bit_length()] = call
                return call
        if window is None:  # kernel_band's band, inline: an unbounded side is wider than the matrix
            offset, win_left = nk - nq, nq + nk + 1
            win_right = 0 if causal else win_left
            qk_scale = last.args.scalars[-1]
        else:
            offset, win_left, win_right, qk_scale, _ = kernel_band(nq, nk, d, causal, window, scale)
        args = last.args.relength(k_strides, v_strides, nk, offset, win_left, win_right, qk_scale, splits)
        if self.cuda:
            bucket = (1 << (nk - 1).bit_length(), configs.mask_kind(nq, nk, offset, win_left, win_right))
        else:
            bucket = None  # the interpreter's one tile config
        picked = self.configs.get(bucket)
        if picked is None:
            if self.cuda:
                config = kernel_config(SPLIT_KV, q, k.shape[1], nk, (offset, win_left, win_right))
            else:
                config = {"BLOCK_N": CPU_CONFIG["BLOCK_N"]}
            picked = self.configs[bucket] = (config, tuple(sorted(config.items())))
        scalars = args.scalars
        strides = (k_strides, v_strides)
        if strides != self.strides:  # a cache that torch.cat grows: new strides every step, mostly of one class
            self.strides, self.classes = strides, plans.int_classes(scalars[:12])
            self.slots.clear()
        # plans.wide of the runtime lengths and the tuning key: nothing in them exceeds these (offset >= 1 - nq)
        wide = max(nk, win_left, win_right, scalars[-3], *args.tune) >= 2**31
        local = (id(args.meta), picked[1], self.classes, wide)  # args.meta: one dict per chunk count, kept
        plan = self.plans.get(local)
        if plan is None:
            plan = self.plans[local] = _split_call_of(self.head, args, picked[0], picked[1], None, self.aligned,
                                                      self.classes).plan  # fmt: skip
        call = Call(plan)
        call.args, call.grid, call.values = args, args.grid, (*scalars, *args.tune)
        call.o_like_q, call.o_shape, call.lse_shape = last.o_like_q, last.o_shape, last.lse_shape
        if args.parts == last.args.parts:
            call.views = last.views  # the same cut of the stream's scratch (workspace checks it is still current)
        if window is None and splits is None and not wide:
            self.slots[args.num_splits << 32 | (nk - 1).bit_length()] = call
        self.last = call
        return call


class PrefillFamily:
    """The prefill calls of one family (``flashlab.host.plan.family_key``: one signature but for its query and
    key counts), on a rung whose choice no length changes: rung 4 (overlap) on Hopper, which
    ``flashlab.kernels.ladder.select`` picks for 16-bit inputs by head dim alone, and skip-and-split on the
    interpreter. Chunked prefill meets a new (Nq, Nk) every call; a new pair skips what the family's first call
    settled -- the signature's checks, the ladder's choice, the copies -- and re-checks only what lengths decide:
    at least one query and key, k and v of one length, more query rows than decode's split-KV path takes, a causal
    mask with no more queries than keys, a window that leaves every row a key, 32-bit row offsets. Anything else
    goes back to the full path (None), which names the problem."""

    __slots__ = ("make", "overlap", "causal", "window", "scale", "rung", "met", "last")

    def __init__(self, make, overlap, causal, window, scale, rung):
        self.make, self.overlap = make, overlap  # the rung's call maker (overlap_call, skip_split_call)
        self.causal, self.window, self.scale, self.rung = causal, window, scale, rung
        self.met = set()  # the (nq, nk) pairs it made calls for, as ints (plan.met_before)
        self.last = None  # the family's latest call

    def call(self, q, k, v, key=None):
        """The call of ``q``, ``k``, ``v`` (``key`` as ``SplitFamily.call`` takes it), or None."""
        q_shape, qs, k_shape, ks, v_shape, vs = _shapes(q, k, v, key)
        b, hq, nq, d = q_shape
        nk = k_shape[2]
        causal, window = self.causal, self.window
        if nq < 1 or nk < 1 or v_shape[2] != nk or (self.rung is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS):
            return None
        if max(nq * qs[2], nk * ks[2], nk * vs[2]) >= 2**31:
            return None
        offset, win_left, win_right, qk_scale, _ = kernel_band(nq, nk, d, causal, window, self.scale)
        if self.overlap and ((causal and nq > nk) or (window is not None and offset + win_right < 0)):
            return None  # rung 4's own rules (rung4_overlap.unavailable): the full path picks another rung
        call = self.make(q, k, v, causal, window, (offset, win_left, win_right, qk_scale))
        call.o_like_q = q.is_contiguous()
        call.o_shape, call.lse_shape = (b, hq, nq, d), (b, hq, nq)
        self.last = call
        return call


class OverlapFamily:
    """Rung 4's prefill calls of one family (``PrefillFamily``'s, on Hopper), each new (Nq, Nk) made from integers:
    what ``overlap_call`` works out, with what the family fixes -- the heads, head dim, dtype, mask, scale, the
    repair pass's constexprs, strides that do not change (views of one buffer), their classes -- worked out once.
    Chunked prefill meets a new pair on every call; through ``overlap_call`` its planning cost more host time than
    the kernel's GPU time (H200, docs/host-path.md). A test checks every call against ``overlap_call``'s."""

    __slots__ = ("prefill", "head", "qk_scale", "strides", "classes", "plans", "rmeta", "met", "last")

    def __init__(self, call, q, k, causal, window, scale, rung):
        self.prefill = PrefillFamily(overlap_call, True, causal, window, scale, rung)  # its checks, and windows
        b, hq, _, d = q.shape
        hk = k.shape[1]
        self.head = (b, hq, hk, d, hq // hk, q.element_size(), b * hq, q.device, q.dtype, bool(causal))
        self.qk_scale = kernel_band(1, 1, d, False, None, scale)[3]
        self.strides = self.classes = None
        self.plans = {}  # (the constexprs' dict, the strides' classes, wide) -> the bucket's plan
        repair = call.args[2]
        self.rmeta = None if repair is None else repair[3]
        self.met = self.prefill.met
        self.last = None

    def call(self, q, k, v, key=None):
        """The call of ``q``, ``k``, ``v`` (``key`` as ``SplitFamily.call`` takes it), or None."""
        prefill = self.prefill
        if prefill.window is not None:  # windows: overlap_call itself (its band is not the causal one)
            call = prefill.call(q, k, v, key)
            self.last = prefill.last
            return call
        b, hq, hk, d, group, elem, heads, device, dtype, causal = self.head
        q_shape, qs, k_shape, ks, v_shape, vs = _shapes(q, k, v, key)
        nq, nk = q_shape[2], k_shape[2]
        if nq < 1 or nk < 1 or v_shape[2] != nk or (prefill.rung is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS):
            return None
        if causal and nq > nk:
            return None  # rung 4's own rules (rung4_overlap.unavailable): the full path picks another rung
        if max(nq * qs[2], nk * ks[2], nk * vs[2]) >= 2**31:
            return None
        overlap = _OVERLAP
        offset, big = nk - nq, nq + nk + 1  # kernel_band's band without a window, inline
        band = (offset, big, 0 if causal else big, self.qk_scale)
        num_wg, block_n, stages = overlap.tiles(d, nq, nk, causal, None)
        block_m = num_wg * overlap.WG_ROWS
        n_m = (nq + block_m - 1) // block_m
        programs = min(n_m * heads, sm_count(q.get_device()) * overlap.PROGRAMS_PER_SM[num_wg])
        table = None
        if causal and d in overlap.SCHEDULED_HEAD_DIMS:
            lengths = overlap.tile_schedule.causal_key_tiles(n_m, block_m, block_n, nk, offset)
            table = overlap.tile_schedule.kept_table(lengths, heads, programs, device)
            if table is None and not stream_capturing():
                table = overlap.tile_schedule.table(lengths, heads, programs, device)
        scheduled = table is not None
        if causal and not scheduled:
            programs = n_m * heads
        kind = (d, num_wg, block_n, stages, causal, False, not causal and nk % block_n != 0, scheduled)
        meta = overlap.kept_constexprs(kind)
        if meta is None:  # a combination not met yet: overlap_call makes it
            call = prefill.call(q, k, v, key)
            self.last = prefill.last
            return call
        scalars = (hq, nq, nk, group, offset, band[1], band[2], band[3], heads)
        strides = (qs, ks, vs)
        if strides != self.strides:
            flat = (*qs[:3], *ks[:3], *vs[:3])
            self.strides, self.classes = strides, plans.int_classes(flat)
        wide = nk + nq + 1 >= 2**31
        local = (id(meta), self.classes, wide)
        plan = self.plans.get(local)
        if plan is None:  # overlap_call's plan of this bucket, found through its key once
            call = prefill.call(q, k, v, key)
            if call is not None:
                self.plans[local] = call.plan
            self.last = prefill.last
            return call
        o_strides = (hq * nq * d, nq * d, d)
        maps = (*_map(b, hq, nq, d, qs, elem), *_map(b, hk, nk, d, ks, elem), *_map(b, hk, nk, d, vs, elem),
                *_map(b, hq, nq, d, (*o_strides, 1), elem))  # fmt: skip
        call = Call(plan)
        call.grid = (programs,)
        repair = None
        if causal:
            m_tiles = (nq + overlap.hopper.REPAIR_CONFIG["BLOCK_M"] - 1) // overlap.hopper.REPAIR_CONFIG["BLOCK_M"]
            tiles = heads * m_tiles
            rargs = (*qs[:3], *ks[:3], *vs[:3], *o_strides, hq, group, nq, nk, *band, tiles, m_tiles)
            rgrid = ((tiles + overlap.hopper.REPAIR_TILES_PER_PROGRAM - 1) // overlap.hopper.REPAIR_TILES_PER_PROGRAM,)
            repair = (overlap.hopper.repair_flagged, rgrid, rargs, self.rmeta)
            call.values = ((*maps, *scalars), rgrid, rargs)
        else:
            call.values = ((*maps, *scalars), None, None)
        call.args = (band, table, repair)
        call.o_like_q = q.is_contiguous()
        call.o_shape, call.lse_shape = (b, hq, nq, d), (b, hq, nq)
        self.last = call
        return call


def _map(b, h, n, d, strides, elem) -> tuple:
    """``direct_launch.map_values`` of a (b, h, n, d) tensor with these strides as rung 4's descriptors take them
    (``rung4_overlap._strides``: a dimension of size 1 gets a contiguous tensor's stride), inline."""
    s0, s1, s2 = strides[:3]
    if b == 1:
        s0 = h * n * d
    if h == 1:
        s1 = n * d
    if n == 1:
        s2 = d
    return (d, n, h, b, s2 * elem, s1 * elem, s0 * elem, b, h, n, d, s0, s1, s2, 1)


def family_of(call, q, k, v, causal, window, scale, num_splits, rung):
    """The family a checked call starts (``SplitFamily``, ``PrefillFamily``), or None where new lengths of it
    cannot skip the full path: copies, a negated q, a warning to repeat, the autotuner, a fixed config, a rung
    whose choice lengths change."""
    if True in call.copy or call.negate or call.note is not None or (q.is_cuda and autotuning()):
        return None
    path = call.plan.path
    if path is SPLIT_KV:
        return SplitFamily.of(call, q, k, v, causal, window, scale, num_splits)
    if num_splits is not None or call.plan.run is run_plain:
        return None
    if q.is_cuda and path == "overlap":
        return OverlapFamily(call, q, k, causal, window, scale, rung)
    if not q.is_cuda and path == skip_split.NAME:
        return PrefillFamily(skip_split_call, False, causal, window, scale, rung)
    return None


def run_split(call, q, k, v, o, lse):
    """A split-KV call's launch; ``lse`` None writes it to scratch."""
    plan, args = call.plan, call.args
    if not q.is_cuda:
        o_part, lse_part, spare, counters, _ = workspace(call, q.device, 0)
        tensors = (q, k, v, o_part, lse_part, o, spare if lse is None else lse, counters)
        _interpreted_launch(split_kv.split_kv_partial, call, tensors)
        return
    with torch.cuda.device(q.device) if q.get_device() != current_device_index() else _NO_CONTEXT:
        stream = current_stream(q.get_device())
        o_part, lse_part, spare, counters, _ = workspace(call, q.device, stream)
        tensors = (q, k, v, o_part, lse_part, o, spare if lse is None else lse, counters)
        if plan.state is CHECKED:  # the launcher directly: no binding, no specialisation, no cache lookup
            plan.fast[0](stream, args.grid, call.values, *tensors)
            return
        _split_jit(plan, call, tensors, stream)


def _split_jit(plan, call, tensors, stream):
    """A split-KV launch through the JIT, with the plan's config (the autotuner's pick on the plan's first launch
    where the user opted in), then the direct launch moved on (``Plan.advance``)."""
    grid, jit_function = call.grid, split_kv.split_kv_partial
    args = (*tensors, *call.values)
    kernel = None
    if plan.config is None:
        split_kv.split_kv_partial_tuned[grid](*args, **plan.meta)
        plan.config = split_kv.split_kv_partial_tuned.best_config.all_kwargs()
    else:
        if plan.binary is None:
            launcher_beside(jit_function, args, {**plan.meta, **plan.config})
        kernel = jit_function[grid](*args, **plan.meta, **plan.config)
    _advance(plan, kernel, jit_function, grid, args, {**plan.meta, **plan.config}, split_kv.PARTIAL_TENSORS,
             split_kv.SCALAR_PARAMETERS, tensors[5], tensors[6], lambda o2, lse2: (*tensors[:5], o2, lse2, tensors[7]),
             call, stream)  # fmt: skip


def _advance(plan, kernel, jit_function, grid, args, kwargs, tensor_names, runtime, o, lse, tensors_into, call,
             stream):  # fmt: skip
    """Move a bucket plan's direct launch on after a JIT launch that returned ``kernel`` (None: the autotuner
    ran, nothing to build from) and wrote ``o`` and ``lse``: built from the first, checked on the next -- only if
    the JIT ran the very binary the direct launch relaunches, and it writes the same bits.
    ``tensors_into(o2, lse2)``: this launch's tensors with fresh outputs."""
    if plan.state is BUILT and kernel is not plan.binary:
        plan.state = OFF  # another binary for a signature of this bucket: the key misses a specialisation
        return

    def build():
        if kernel is None:
            return None
        plan.binary = kernel
        return (FastLaunch.build(jit_function, kernel, grid, args, kwargs, tensor_names, runtime=runtime),)

    def check():
        return reproduces(lambda o2, lse2: plan.fast[0](stream, call.grid, call.values, *tensors_into(o2, lse2)), o,
                          lse)  # fmt: skip

    plan.advance(build, check)


def kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, checked,
                 ragged=None, descales=None) -> Plan:  # fmt: skip
    """The plan of a ``flash_attention_with_kvcache`` signature whose shapes passed (``checked``: capacity, pool
    blocks and block size from ``flashlab.host.checks.check_kvcache_inputs``). ``ragged`` ``(B, max_seqlen_q)``:
    q is packed ``(total_q, Hq, D)`` (``cu_seqlens_q``), o is returned so and lse as ``(Hq, total_q)``.
    ``descales`` ``(k_descale, v_descale)``, each ``(B, Hk)``: an 8-bit cache and its scales."""
    capacity, _, page_size = checked
    if q.is_cuda:
        direct_launch.prepare()
    if ragged is None:
        b, hq, nq, d = q.shape
    else:
        (b, nq), (total, hq, d) = ragged, q.shape
    _, win_left, win_right, qk_scale, negate = kernel_band(nq, capacity, d, causal, window, scale)
    plan = Plan(KVCACHE, None)
    plan.copy, plan.negate = (q.stride(-1) != 1, False, False), negate
    if q.stride(-1) != 1:
        q = q.contiguous()
    if negate:
        q = -q  # the strides below are those of the tensor a launch runs on
    # the kernel reads the lengths and a table row at unit stride: other layouts are copied (they are tiny)
    plan.copy_lengths = not cache_seqlens.is_contiguous()
    plan.copy_table = block_table is not None and not block_table.is_contiguous()
    table = cache_seqlens if block_table is None else block_table  # never read without a block table
    if plan.copy_table:
        table = table.contiguous()
    plan.args = kvcache.KVCacheArguments(q, k_cache, v_cache, table, page_size, capacity, win_left, win_right,
                                         qk_scale, ragged, descales)  # fmt: skip
    # the values of later calls' lengths and tables are checked against these; the device's error records
    plan.extra = (*checked, kvcache_errors.error_record(q.device), kvcache_errors.unreported_record(q.device))
    plan.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
    if ragged is None:
        plan.o_shape, plan.lse_shape = (b, hq, nq, d), (b, hq, nq)
    else:
        plan.o_shape, plan.lse_shape = (total, hq, d), (hq, total)
    return plan


def run_kvcache(plan: Plan, q, k_cache, v_cache, cache_seqlens, block_table, need_lse, errors, cu_seqlens_q=None,
                descales=None):  # fmt: skip
    """A KV-cache plan's launch on tensors of its signature: ``(o, lse)`` (lse None unless ``need_lse``).
    ``errors`` is the error record the kernel writes a bad length, table entry or scale into
    (``flashlab.host.kvcache_errors``); ``cu_seqlens_q`` the packed query rows' offsets of a ragged plan;
    ``descales`` an 8-bit plan's ``(k_descale, v_descale)``, ``(B, Hk)`` each."""
    if plan.copy[0]:
        q = q.contiguous()
    if plan.negate:
        q = -q
    if plan.copy_lengths:
        cache_seqlens = cache_seqlens.contiguous()
    table = cache_seqlens if block_table is None else block_table  # never read without a block table
    if plan.copy_table:
        table = table.contiguous()
    if cu_seqlens_q is None:
        cu_seqlens_q = cache_seqlens  # never read by a uniform plan
    elif not cu_seqlens_q.is_contiguous():
        cu_seqlens_q = cu_seqlens_q.contiguous()
    ks, vs = (cache_seqlens, cache_seqlens) if descales is None else descales  # never read without descales
    o = torch.empty_like(q) if plan.o_like_q else torch.empty(plan.o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    if not q.is_cuda:
        o_part, lse_part, spare, counters, row_order = workspace(plan, q.device, 0)
        row_order = kvcache.row_order_argument(plan.args, cu_seqlens_q, cache_seqlens, row_order)
        tensors = (q, k_cache, v_cache, table, cache_seqlens, ks, vs, cu_seqlens_q, row_order, o_part, lse_part, o,
                   spare if lse is None else lse)  # fmt: skip
        args = plan.args
        with interpreted_language(*kvcache.DEVICE_MODULES):
            interpreted(kvcache.kvcache_partial)[args.grid](*tensors, counters, errors, *args.scalars, *args.tune,
                                                            **args.meta, BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip
        return o, lse
    with torch.cuda.device(q.device) if q.get_device() != current_device_index() else _NO_CONTEXT:
        stream = current_stream(q.get_device())
        o_part, lse_part, spare, counters, row_order = workspace(plan, q.device, stream)
        row_order = kvcache.row_order_argument(plan.args, cu_seqlens_q, cache_seqlens, row_order)
        tensors = (q, k_cache, v_cache, table, cache_seqlens, ks, vs, cu_seqlens_q, row_order, o_part, lse_part, o,
                   spare if lse is None else lse)  # fmt: skip
        tensors += (counters, errors)
        if plan.state is CHECKED:  # the launcher directly
            plan.fast[0](stream, *tensors)
        else:
            _decode_jit(plan, kvcache.kvcache_partial, kvcache.kvcache_partial_tuned, tensors, stream,
                        kvcache.PARTIAL_TENSORS)  # fmt: skip
    return o, lse


def _interpreted_launch(jit_function, call, tensors):
    """A split-KV call through Triton's interpreter: its grid, its runtime values (``call.values``: the calls of
    one growing-cache slot share their arguments object, not their values) and its constexprs."""
    with interpreted_language(softmax_step):
        interpreted(jit_function)[call.grid](*tensors, *call.values, **call.args.meta,
                                             BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip


def _decode_jit(plan, jit_function, tuned, tensors, stream, names):
    """A KV-cache plan's launch through the JIT: its tile config picked the first time
    (``flashlab.kernels.configs``; the autotuner's pick where the user opted in), then the direct launch moved on
    (``Plan.advance``)."""
    args, grid = (*tensors, *plan.args.scalars, *plan.args.tune), plan.args.grid
    meta = plan.args.meta
    kernel = None
    if "num_warps" in meta:  # a fixed config, or the one picked on an earlier call
        launcher_beside(jit_function, args, meta)
        kernel = jit_function[grid](*args, **meta)
    elif autotuning():
        tuned[grid](*args, **meta)
        plan.args.meta = {**meta, **tuned.best_config.all_kwargs()}
    else:
        q, k_cache = tensors[0], tensors[1]  # q (B, Hq, Nq, D) or packed, the cache (num_blocks or B, page, Hk, D)
        capacity, _, page_size = plan.extra[:3]  # check_kvcache_inputs' (capacity, pages, page size)
        win_left, win_right = plan.args.scalars[19:21]  # KVCacheArguments.scalars: the band
        q = kvcache.bucket_query(q, plan.args.nq)  # (B, Hq, Nq, D) as the tuned table's buckets read it
        band = (capacity - plan.args.nq, win_left, win_right)
        best = kernel_config(plan.path, q, k_cache.shape[2], capacity, band, page_size=page_size)
        plan.args.meta = meta = {**meta, **best}
        launcher_beside(jit_function, args, meta)
        kernel = jit_function[grid](*args, **meta)
    out = names.index("O")  # o and lse follow each other

    def build():
        return None if kernel is None else (FastLaunch.build(jit_function, kernel, grid, args, meta, names),)

    def check():
        into = lambda o2, lse2: plan.fast[0](stream, *tensors[:out], o2, lse2, *tensors[out + 2 :])  # noqa: E731
        return reproduces(into, tensors[out], tensors[out + 1])

    plan.advance(build, check)


# FLASHLAB_COMPILE_BESIDE=0: a plan's second kernel compiles after its first, as a plain launch compiles them
COMPILE_BESIDE = os.environ.get("FLASHLAB_COMPILE_BESIDE", "1") != "0"


def compile_beside(jit_function, grid, args, meta, device):
    """Start compiling ``jit_function`` for ``args`` and ``meta`` (``JITFunction.warmup``: compiled, not launched)
    in a thread, while the caller's thread compiles and launches the plan's first kernel: a plan's first call then
    waits for the longer of its two compiles instead of their sum (LLVM's optimiser and ptxas run without the GIL;
    only Triton's Python front end takes turns). Returns the thread, to join before launching ``jit_function``
    (a cache hit by then), or None where there is nothing to gain. A compile that fails here fails again, with
    its error, at that launch."""
    if not COMPILE_BESIDE:
        return None

    def compile_it():
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                kernel = jit_function.warmup(*args, grid=grid, **meta)
                if device.type == "cuda" and _launcher_maker() is not None:  # its launcher too, and loaded
                    kernel._init_handles()
        except Exception:  # noqa: BLE001 -- the launch that needs this binary compiles it again and raises
            pass

    thread = threading.Thread(target=compile_it, name="flashlab-compile", daemon=True)
    thread.start()
    return thread


def launcher_beside(jit_function, args, kwargs):
    """Build Triton's launcher for the binary that ``jit_function[grid](*args, **kwargs)`` is about to compile, in a
    thread, so that the C compiler runs while the kernel compiles instead of after it. Tritons of the 3.6 era build
    one small C module per kernel signature (0.3-0.45 s of gcc on the H200's host, docs/host-path.md) when a new
    binary is first launched; the thread builds the same source into Triton's cache, where that launch then finds
    it. Returns the thread, or None where there is nothing to build: a Triton without per-signature launchers, a
    signature with tensor descriptors (their launcher depends on the compiled binary), a binary already compiled.
    Nothing here can change a result: a source that differs from Triton's only leaves Triton to build its own."""
    if not COMPILE_BESIDE:
        return None
    make = _launcher_maker()
    if make is None:
        return None
    try:
        caches = jit_function.device_caches[torch.cuda.current_device()]  # made here, not in the thread
    except Exception:  # noqa: BLE001 -- another JITFunction layout: Triton builds its launcher itself
        return None

    def build_it():
        try:
            parts = launcher_parts(jit_function, caches, args, kwargs)
            if parts is not None:
                make(*parts)
        except Exception:  # noqa: BLE001 -- the launch builds its launcher as it would have
            pass

    thread = threading.Thread(target=build_it, name="flashlab-launcher", daemon=True)
    thread.start()
    return thread


def run_options(jit_function, kwargs, knobs):
    """``kwargs`` with the two options ``JITFunction.run`` adds before it binds, in the order it adds them: the
    options the binder passes through keep their order, and the cache key is their dict's ``str``, so the same
    options in another order name another binary."""
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit_function.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kwargs


def launcher_parts(jit_function, caches, args, kwargs):
    """``(constexprs, signature)`` of the binary ``jit_function[grid](*args, **kwargs)`` launches, as Triton's JIT
    works them out before compiling it (``caches``: its ``device_caches`` entry for this device), or None where
    that binary is compiled already or its signature has tensor descriptors."""
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    kernel_cache, key_cache, backend, binder = caches[0], caches[1], caches[-2], caches[-1]
    kwargs = run_options(jit_function, kwargs, knobs)
    bound, specialization, options = binder(*args, **kwargs)
    if compute_cache_key(key_cache, specialization, options) in kernel_cache:
        return None  # compiled already: its launcher was built with it
    _, signature, constexprs, _ = jit_function._pack_args(backend, kwargs, bound, specialization, options)
    if any(str(t).startswith("tensordesc") for t in signature.values()):
        return None
    return constexprs, signature


@functools.cache
def _launcher_maker():
    """``make(constexprs, signature)``, which builds Triton's launcher module for that signature as Triton's
    ``CudaLauncher`` does, or None where this Triton builds no module per signature."""
    try:
        from triton.backends.nvidia import driver as nvidia
        from triton.runtime.build import compile_module_from_src
    except ImportError:
        return None
    if not hasattr(nvidia, "make_launcher") or "compile_module_from_src" not in vars(nvidia):
        return None

    def make(constexprs, signature):
        source = nvidia.make_launcher(constexprs, signature, None)
        compile_module_from_src(src=source, name="__triton_launcher", library_dirs=nvidia.library_dirs(),
                                include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)  # fmt: skip

    return make


# ----------------------------------------------------------------------------------------------------------------
# The ladder's planned rungs: skip-and-split, Hopper, overlap
# ----------------------------------------------------------------------------------------------------------------

PREFILL_TENSORS = ("Q", "K", "V", "O", "LSE", "desc_q", "desc_k", "desc_v", "desc_o")


def skip_split_call(q, k, v, causal, window, band) -> Call:
    """Skip-and-split: a signature's runtime scalars and grid, and the plan of its bucket (dtype, head dim, mask
    kind, GQA group, the TMA choice, the tile config, the strides' classes, the tensors' alignment)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    # masked short sequences: TMA was erratic there on the H200 (docs/host-path.md)
    want_tma = q.is_cuda and skip_split.wants_tma(causal, window, nk)
    strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    strides += (v.stride(0), v.stride(1), v.stride(2), *strides_o)
    lengths = (hq, hq // hk, nq, nk, offset, win_left, win_right)
    # re-tuned per power-of-two length and per power-of-two amount of work where the user opted in
    tune = skip_split.tune_key(b, hq, nq, nk, causal, window)
    meta = skip_split.kernel_meta(q, causal)
    aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    if not q.is_cuda:
        config, tune_class = dict(CPU_CONFIG), None
    elif autotuning():
        config, tune_class = None, tune
    else:
        config, tune_class = kernel_config(skip_split.NAME, q, hk, nk, band), None
    key = (skip_split.NAME, q.device, q.dtype, d, plans.mask_kind(causal, window), hq // hk, tuple(meta.items()),
           want_tma, None if config is None else tuple(sorted(config.items())), tune_class, plans.int_classes(strides),
           plans.wide(lengths + tune), aligned)  # fmt: skip

    def make():
        plan = Plan(skip_split.NAME, run_skip_split)
        plan.meta, plan.config, plan.extra = meta, config, want_tma
        if not aligned:
            plan.state = OFF
        return plan

    call = Call(plans.planned(key, make))
    call.values = (*strides, *lengths, qk_scale, *tune, d)  # skip_split.SCALAR_PARAMETERS
    call.args = (b * hq, nq)  # (query heads, query rows): the grid's first dim divides by BLOCK_M at launch
    if config is not None:
        call.grid = (cdiv(nq, config["BLOCK_M"]), b * hq)
    return call


def run_skip_split(call, q, k, v, o, lse):
    plan = call.plan
    if call.grid is None and plan.config is not None:  # made before the autotuner's pick
        call.grid = (cdiv(call.args[1], plan.config["BLOCK_M"]), call.args[0])
    if plan.state is CHECKED and q.get_device() == current_device_index():  # pointer loads, checked
        # the launcher directly
        plan.fast[0](current_stream(q.get_device()), call.grid, call.values, q, k, v, o, lse, q, k, v, o)
        return
    descs = skip_split.tma_descriptors(q, k, v, o) if plan.extra else None
    args = (q, k, v, o, lse, *(descs if descs else (q, k, v, o)), *call.values)
    meta = {**plan.meta, "USE_TMA": descs is not None}
    if not q.is_cuda:
        with interpreted_language(softmax_step):
            interpreted(skip_split.attn_fwd)[call.grid](*args, **meta, **CPU_CONFIG)
        return
    with torch.cuda.device(q.device) if q.device.index != torch.cuda.current_device() else _NO_CONTEXT:
        bh, nq = call.args
        if plan.config is None:  # opted into the autotuner: its pick, once per plan
            skip_split.attn_fwd_tuned[lambda m: (cdiv(nq, m["BLOCK_M"]), bh)](*args, **meta)
            plan.config = skip_split.attn_fwd_tuned.best_config.all_kwargs()
            return
        config = plan.config
        grid = call.grid = (cdiv(nq, config["BLOCK_M"]), bh)
        if descs:
            names = ("desc_q", "desc_k", "desc_v", "desc_o")
            skip_split.set_tma_block_shapes({**dict(zip(names, descs, strict=True)), **config, **meta})
        if descs is None and plan.binary is None:
            launcher_beside(skip_split.attn_fwd, args, {**meta, **config})
        kernel = skip_split.attn_fwd[grid](*args, **meta, **config)
        if descs is None:  # pointer loads: the direct launch, built, then checked once per binary
            _advance(plan, kernel, skip_split.attn_fwd, grid, args, {**meta, **config}, PREFILL_TENSORS,
                     skip_split.SCALAR_PARAMETERS, o, lse, lambda o2, lse2: (q, k, v, o2, lse2, q, k, v, o2), call,
                     current_stream(q.device.index))  # fmt: skip


HOPPER_TENSORS = ("Q", "K", "V", "O", "LSE")  # the Hopper kernels' five tensor parameters


def hopper_plan(q, k, v, causal, window, band) -> Plan:
    """Rung 3: its arguments and constexprs, the autotuner's pick (first call), and direct relaunches of the kernel
    and of its repair pass. Without the plan a call spent over 100 us of host time in the autotuner's dispatch and
    two JIT launches (H200, docs/host-path.md). The descriptors the programs build live in global scratch: the
    stream's kept scratch for flashlab's own launcher, the allocator's for Triton's."""
    from flashlab.kernels.ladder import rung3_hopper as hopper

    b, hq, nq, d = q.shape
    plan = Plan(hopper.NAME, run_hopper)
    strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
    plan.args, plan.tune, plan.meta = hopper.arguments(q, k, v, strides_o, causal, window, band, is_cuda=True)
    repair_args, repair_grid, repair_meta = hopper.repair_shape(q, plan.meta, is_cuda=True)
    plan.extra = (hopper, (causal, window), band, (nq, b * hq), repair_args, repair_grid, repair_meta)
    return plan


def run_hopper(call, q, k, v, o, lse):
    plan = call.plan
    hopper, mask, band = plan.extra[:3]
    if not q.is_cuda:
        hopper.launch(q, k, v, o, lse, *mask, band)
        return
    if not (hopper.aligned(q) and hopper.aligned(k) and hopper.aligned(v)):  # same signature, addresses TMA refuses
        skip_split.launch(q, k, v, o, lse, *mask, band)
        return
    if plan.state is CHECKED and q.get_device() == current_device_index():
        _hopper_fast(plan, current_stream(q.get_device()), q, k, v, o, lse)
        return
    with torch.cuda.device(q.device):
        _hopper_jit(plan, hopper, q, k, v, o, lse)


def _hopper_fast(plan, stream, q, k, v, o, lse):
    if plan.scratch_bytes:  # the programs' descriptors: the stream's kept scratch (fresh while capturing)
        work = scratch(q.device, stream, cdiv(plan.scratch_bytes, 4), 0)[0]
        plan.fast[0](stream, q, k, v, o, lse, work)
    else:
        plan.fast[0](stream, q, k, v, o, lse)
    if len(plan.fast) > 1:
        plan.fast[1](stream, q, k, v, o, lse)


def _hopper_jit(plan, hopper, q, k, v, o, lse):
    from flashlab.host import direct_launch

    *_, (nq, bh), repair_args, repair_grid, repair_meta = plan.extra
    hopper.ensure_allocator()
    tensors = (q, k, v, o, lse)
    args = (*tensors, *plan.args, *plan.tune)
    kernel = repair_kernel = None
    if plan.config is None and not autotuning():  # the configs table's tiles (flashlab.kernels.configs)
        band = plan.extra[2]
        plan.config = kernel_config(hopper.NAME, q, k.shape[1], k.shape[2], band)
        plan.grid = (cdiv(nq, plan.config["BLOCK_M"]), bh)
    if plan.config is None:  # opted into the autotuner: its pick, once per signature
        hopper.hopper_fwd_tuned[lambda m: (cdiv(nq, m["BLOCK_M"]), bh)](*args, **plan.meta)
        plan.config = hopper.hopper_fwd_tuned.best_config.all_kwargs()
        plan.grid = (cdiv(nq, plan.config["BLOCK_M"]), bh)
    else:
        beside = None
        if plan.meta["FLAG_NONFINITE"] and plan.binary is None:  # its first launch: both kernels compile at once
            beside = compile_beside(hopper.repair_flagged, repair_grid, (*tensors, *plan.args, *repair_args),
                                    repair_meta, q.device)  # fmt: skip
        if plan.binary is None:
            launcher_beside(hopper.hopper_fwd, args, {**plan.meta, **plan.config})
        kernel = hopper.hopper_fwd[plan.grid](*args, **plan.meta, **plan.config)
        if beside is not None:
            beside.join()
    if plan.meta["FLAG_NONFINITE"]:
        repair_kernel = hopper.repair_flagged[repair_grid](*tensors, *plan.args, *repair_args, **repair_meta)

    def build():
        if kernel is None:
            return None
        fast = FastLaunch.build(hopper.hopper_fwd, kernel, plan.grid, args, {**plan.meta, **plan.config},
                                HOPPER_TENSORS, global_scratch=True)  # fmt: skip
        if direct_launch.is_direct(fast):
            plan.scratch_bytes = direct_launch.global_scratch_bytes(kernel, plan.grid)
        if repair_kernel is None:
            return (fast,)
        repair_fast = FastLaunch.build(hopper.repair_flagged, repair_kernel, repair_grid,
                                       (*tensors, *plan.args, *repair_args), repair_meta, HOPPER_TENSORS)  # fmt: skip
        return fast, repair_fast

    def check():
        stream = current_stream(q.get_device())
        return reproduces(lambda o2, lse2: _hopper_fast(plan, stream, q, k, v, o2, lse2), o, lse)

    plan.advance(build, check)


def overlap_call(q, k, v, causal, window, band) -> Call:
    """Rung 4: a signature's grid, schedule table, runtime scalars (its lengths and band, and its four tensor maps'
    dims and strides) and the Hopper rung's repair pass under a mask, and the plan of its bucket (dtype, head dim,
    mask kind, group, the constexprs -- tiles, key tail, schedule --, the strides' classes, alignment), whose direct
    launches go through flashlab's own launcher (which encodes the four tensor maps from each launch's tensors and
    runtime dims). Through Triton's JIT, building the four descriptors in Python and binding them cost 140-390 us of
    host time per call on the H200's host, more than the GPU time of a short call (docs/host-path.md). A call whose
    q, k, v or o is not 16-byte aligned, which the copy engine cannot take, runs skip and split instead."""
    overlap = _OVERLAP or _import_overlap()
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    grid, table, scalars, meta = overlap.launch_shape(q, k, causal, window, band) if q.is_cuda else (None,) * 4
    o_strides = (hq * nq * d, nq * d, d)  # o is allocated contiguous
    repair = None
    if q.is_cuda and (causal or window is not None):
        repair = overlap.hopper.repair_parts(q, k, v, o_strides, causal, window, band, (qs, ks, vs))
    strides = (*qs[:3], *ks[:3], *vs[:3])
    aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    classes = _CLASSES.get(strides)
    if classes is None:
        if len(_CLASSES) >= plans.MAX_PLANS:
            _CLASSES.clear()
        classes = _CLASSES[strides] = plans.int_classes(strides)
    key = (overlap.NAME, q.device, q.dtype, d, plans.mask_kind(causal, window), hq // hk,
           None if meta is None else id(meta), None if repair is None else id(repair[3]), classes,
           plans.wide(scalars or ()), aligned)  # fmt: skip  # the constexprs' dicts are kept, one per combination

    def make():
        plan = Plan(overlap.NAME, run_overlap)
        plan.meta, plan.extra = meta, (overlap, (causal, window), band)  # the band: the CPU's launch only
        if not aligned or not q.is_cuda:
            plan.state = OFF
        return plan

    plan = plans.planned(key, make) if q.is_cuda else make()
    call = Call(plan)
    call.grid = grid
    call.args = (band, table, repair)
    if q.is_cuda:
        elem = q.element_size()
        map_values = direct_launch.map_values
        maps = (*map_values(q.shape, overlap._strides(q, qs), elem),
                *map_values(k.shape, overlap._strides(k, ks), elem),
                *map_values(v.shape, overlap._strides(v, vs), elem),
                *map_values((b, hq, nq, d), (hq * nq * d, nq * d, d, 1), elem))  # fmt: skip  # o is contiguous
        call.values = (*maps, *scalars)  # OVERLAP_RUNTIME's order
        if repair is not None:
            call.values = (call.values, repair[1], repair[2])  # the main kernel's, the repair's grid and values
        else:
            call.values = (call.values, None, None)
    return call


_CLASSES = {}  # q's, k's and v's strides -> their integer classes (plan.int_classes), for overlap_call
_OVERLAP = None  # rung 4's module, imported on its first call (it imports Gluon)


def _import_overlap():
    global _OVERLAP
    from flashlab.kernels.ladder import rung4_overlap

    _OVERLAP = rung4_overlap
    return rung4_overlap


def overlap_plan(q, k, v, causal, window, band) -> Plan:
    """The plan of rung 4's bucket for these inputs (``overlap_call``'s)."""
    return overlap_call(q, k, v, causal, window, band).plan


OVERLAP_RUNTIME = ("desc_q", "desc_k", "desc_v", "desc_o", "HQ", "NQ", "NK", "GROUP", "offset", "win_left",
                   "win_right", "qk_scale", "n_bh")  # fmt: skip


def run_overlap(call, q, k, v, o, lse):
    plan = call.plan
    overlap, mask = plan.extra[:2]
    band = call.args[0] if isinstance(call, Call) else plan.extra[2]  # a plan run as its own call: its first band
    if not all(overlap.hopper.aligned(x) for x in (q, k, v, o)):  # same signature, addresses TMA cannot take
        skip_split.launch(q, k, v, o, lse, *mask, band)
        return
    if not q.is_cuda or not isinstance(call, Call):  # a plan run as its own call: the plain launch
        overlap.launch(q, k, v, o, lse, *mask, band)
        return
    if plan.state is CHECKED and q.get_device() == current_device_index():
        _overlap_fast(plan, call, current_stream(q.get_device()), q, k, v, o, lse)
        return
    with torch.cuda.device(q.device):
        _overlap_jit(plan, call, overlap, q, k, v, o, lse)


def _overlap_fast(plan, call, stream, q, k, v, o, lse):
    table = call.args[1]
    values, repair_grid, repair_values = call.values
    plan.fast[0](stream, call.grid, values, q, k, v, o, lse, lse if table is None else table, lse)  # DESCALE: unread
    if len(plan.fast) > 1:
        plan.fast[1](stream, repair_grid, repair_values, q, k, v, o, lse)


def _overlap_jit(plan, call, overlap, q, k, v, o, lse):
    band, table, repair = call.args
    args = (*overlap.descriptors(q, k, v, o, plan.meta["BLOCK_N"]), lse, lse if table is None else table, lse,
            *call.values[0][-len(OVERLAP_RUNTIME) + 4 :])  # fmt: skip
    beside = None
    if repair is not None and plan.binary is None:  # the plan's first launch: both kernels compile, side by side
        jit, rgrid, rargs, rmeta = repair
        beside = compile_beside(jit, rgrid, (q, k, v, o, lse, *rargs), rmeta, q.device)
    kernel = overlap.attn_fwd_overlap[call.grid](*args, **plan.meta)
    if beside is not None:
        beside.join()
    repair_kernel = None
    if repair is not None:
        jit, rgrid, rargs, rmeta = repair
        repair_kernel = jit[rgrid](q, k, v, o, lse, *rargs, **rmeta)
    if plan.state is BUILT and (plan.binary[0] is not kernel or plan.binary[1] is not repair_kernel):
        plan.state = OFF  # another binary for a signature of this bucket
        return

    def build():
        plan.binary = (kernel, repair_kernel)
        fast = FastLaunch.build(overlap.attn_fwd_overlap, kernel, call.grid, args, plan.meta,
                                overlap.DESCRIBED_TENSORS, native_only=True, runtime=OVERLAP_RUNTIME)  # fmt: skip
        if repair_kernel is None:
            return (fast,)
        jit, rgrid, rargs, rmeta = repair
        names = jit.arg_names[len(HOPPER_TENSORS) : jit.arg_names.index("HEAD_DIM")]
        return fast, FastLaunch.build(jit, repair_kernel, rgrid, (q, k, v, o, lse, *rargs), rmeta, HOPPER_TENSORS,
                                      runtime=names)  # fmt: skip

    def check():
        stream = current_stream(q.get_device())
        return reproduces(lambda o2, lse2: _overlap_fast(plan, call, stream, q, k, v, o2, lse2), o, lse)

    plan.advance(build, check)


# ----------------------------------------------------------------------------------------------------------------
# Kernels planned by their arguments' classes: the packed varlen kernels
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def runtime_positions(jit_function, runtime: tuple) -> dict:
    """{position: whether Triton specialises it} of the parameters named in ``runtime``."""
    names = jit_function.arg_names
    return {names.index(n): not getattr(jit_function.params[names.index(n)], "do_not_specialize", False)
            for n in runtime}  # fmt: skip


@functools.cache
def _key_positions(jit_function, runtime: tuple, kinds: tuple) -> tuple:
    """For arguments of ``kinds`` (True: a tensor), positionally: the tensors' positions, the fixed scalars', and the
    runtime ints' (specialised by Triton, not specialised)."""
    positions = runtime_positions(jit_function, runtime)
    tensors = tuple(i for i, tensor in enumerate(kinds) if tensor)
    fixed = tuple(i for i, tensor in enumerate(kinds) if not tensor and i not in positions)
    specialised = tuple(i for i, flag in positions.items() if flag)
    unspecialised = tuple(i for i, flag in positions.items() if not flag)
    return tensors, fixed, specialised, unspecialised


def _kinds(args) -> tuple:
    """Per argument, whether it is a tensor (anything but a plain scalar; isinstance on a tensor is slow)."""
    return tuple([type(a) not in _SCALAR_TYPES for a in args])


def launch_key(jit_function, args, kwargs, runtime, device: int, kinds=None) -> tuple | None:
    """The plan key of ``jit_function[grid](*args, **kwargs)``: everything that picks its binary and the values a
    direct launch packs once -- each tensor's dtype and 16-byte alignment, every fixed scalar's value, for each
    runtime scalar (``runtime``: the names of those given per launch) the class Triton specialises an int on
    (``plan.int_class``; only its width, 32 or 64 bits, where the kernel says ``do_not_specialize``; else its
    type), the constexprs and options. ``device``: the CUDA device's index; ``kinds``: ``_kinds(args)``, where
    the caller has it. None where a scalar is of a kind this does not key."""
    kinds = _kinds(args) if kinds is None else kinds
    tensors, fixed, specialised, unspecialised = _key_positions(jit_function, runtime, kinds)
    try:
        ptrs = [args[i].data_ptr() for i in tensors]
        dtypes = tuple([args[i].dtype for i in tensors])
    except AttributeError:  # an argument neither a tensor nor a plain scalar
        return None
    aligned = tuple([p & 15 == 0 for p in ptrs])
    classes = tuple([plans.int_class(args[i]) if type(args[i]) is int else type(args[i]) for i in specialised])
    wide = tuple([plans.int_class(args[i]) & 4 if type(args[i]) is int else type(args[i]) for i in unspecialised])
    scalars = tuple([args[i] for i in fixed])
    return (jit_function, device, kinds, dtypes, aligned, scalars, classes, wide, tuple(kwargs.items()))


_SCALAR_TYPES = frozenset((int, float, bool, type(None)))


def _descriptor_scratch(plan, grid, stream) -> tuple:
    """The global scratch a planned direct launch on ``grid`` passes after its tensors, ``()`` where its kernel
    takes none: ``plan.scratch_bytes`` for each program, from the stream's kept scratch (fresh while capturing)."""
    if not plan.scratch_bytes:
        return ()
    floats = cdiv(math.prod(grid) * plan.scratch_bytes, 4)
    return (scratch(torch.device("cuda", torch.cuda.current_device()), stream, floats, 0)[0],)


def planned_launch(jit_function, grid, args, kwargs, runtime=(), outputs=()):
    """``jit_function[grid](*args, **kwargs)`` on the current device, through a plan (``flashlab.host.plan``) kept
    under ``launch_key``: through Triton's JIT until the plan's direct launch is checked, then directly, with this
    call's ``grid`` and the values of the scalars named in ``runtime`` (lengths, scales: what changes between calls
    of one binary). The kernel must take its tensors and scalars positionally, its constexprs by name, and be
    idempotent: launched again on the same arguments it writes the same bits to ``outputs`` (the names of the
    tensors it writes), which is how the direct launch is checked once, against the JIT launch before it."""
    runtime = tuple(runtime)
    device = torch.cuda.current_device()
    kinds = _kinds(args)
    tensor_positions = _key_positions(jit_function, runtime, kinds)[0]
    key = launch_key(jit_function, args, kwargs, runtime, device, kinds)
    plan = plans.PLANS.get(key) if key is not None else None
    tensors = [args[i] for i in tensor_positions]
    values = tuple(args[i] for i in runtime_positions(jit_function, runtime))  # in runtime's order
    stream = current_stream(device)
    if plan is not None and plan.state is CHECKED:
        plan.fast[0](stream, grid, values, *tensors, *_descriptor_scratch(plan, grid, stream))
        return
    kernel = jit_function[grid](*args, **kwargs)
    if key is None:
        return
    if plan is None:
        plan = plans.remember(key, Plan("planned", None))
    if plan.state is BUILT and kernel is not plan.binary:
        plan.state = OFF  # another binary under this key: it misses a specialisation
        return
    names = jit_function.arg_names
    tensor_names = [names[i] for i in tensor_positions]
    # the outputs in device memory (a record in page-locked host memory is written while the host reads on)
    written = [t for t in (args[names.index(n)] for n in outputs) if t.is_cuda]

    def build():
        plan.binary = kernel
        # device-side descriptors live in global scratch: only flashlab's launcher is handed it (Triton's own
        # would allocate it at every launch, which a direct launch skips)
        each = kernel.metadata.num_ctas * kernel.metadata.global_scratch_size
        fast = FastLaunch.build(jit_function, kernel, grid, args, kwargs, tensor_names, global_scratch=each > 0,
                                native_only=each > 0, runtime=runtime)  # fmt: skip
        plan.scratch_bytes = each  # per program
        return (fast,)

    def check():  # the JIT's bits, then the direct launch's on the same arguments
        before = [t.clone() for t in written]
        try:
            plan.fast[0](stream, grid, values, *tensors, *_descriptor_scratch(plan, grid, stream))
        except Exception:  # noqa: BLE001 -- a launcher that does not take these arguments: JIT launches stay
            return False
        return all(same_bits(a, b) for a, b in zip(before, written, strict=True))

    plan.advance(build, check)


_BUCKETED = ("skip_split", "overlap")  # the rungs whose plans a bucket of signatures shares
_PLANNED = {"skip_split": skip_split_call, "hopper": hopper_plan, "overlap": overlap_call}


__all__ = ["KVCACHE", "SPLIT_KV", "attention_call", "autotuning", "kernel_config", "kvcache_plan", "launch_key",
           "planned_launch", "run_attention", "run_kvcache", "runtime_positions", "skip_split_call", "split_call",
           "unit_stride_d"]  # fmt: skip
