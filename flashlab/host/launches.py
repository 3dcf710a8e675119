"""How the host engine plans and runs each path: what a ``Plan`` holds for it, and its launch.

- ``attention_plan``: a ``flash_attention`` signature's plan -- split-KV for decode, else the rung of the kernel
  ladder that runs (skip-and-split, Hopper, overlap; the lesson loop and calls with a fixed config are a plain
  launch every call). ``run_attention`` allocates the outputs and launches it.
- ``kvcache_plan`` / ``run_kvcache``: the same for ``flash_attention_with_kvcache``.

Each path's ``run_*`` launches through Triton's JIT until the plan's direct launch is checked
(``Plan.advance``), then through the direct launch only. The kernels, their arguments and their plain launches
live in ``flashlab.kernels``; this module adds what makes a repeated call cheap.
"""

from __future__ import annotations

import contextlib

import torch

from flashlab.core.integers import cdiv
from flashlab.host import kvcache_errors
from flashlab.host.launcher import FastLaunch, current_stream, reproduces
from flashlab.host.plan import CHECKED, TUNED, Plan
from flashlab.host.scratch import scratch, workspace
from flashlab.kernels import ladder, softmax_step
from flashlab.kernels.decode import kvcache, split_kv
from flashlab.kernels.device import CPU_CONFIG, current_device_index, kernel_band
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


def attention_plan(q, k, v, causal, window, scale, num_splits, rung, config=None) -> Plan:
    """The plan of a checked ``flash_attention`` signature (``num_splits`` and ``rung`` as there). ``config`` (a
    dict of BLOCK_M, BLOCK_N, num_warps, num_stages) fixes the prefill kernel's tiles: a plain launch every call
    (the small query tiles a differentiable decode-sized call runs with)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    copy = tuple(x.stride(-1) != 1 for x in (q, k, v))
    q, k, v = unit_stride_d(q, k, v)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, nk, d, causal, window, scale)
    if negate:
        q = -q  # everything below reads the tensor a launch runs on: -q may have other strides than q
    band = (offset, win_left, win_right, qk_scale)
    if num_splits is not None or (rung is None and config is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS):
        plan = Plan(SPLIT_KV, run_split)
        o = torch.empty((b, hq, nq, d), dtype=q.dtype, device="meta")  # for its strides only
        plan.args = split_kv.SplitArguments(q, k, v, o, offset, win_left, win_right, qk_scale, num_splits)
    elif config is not None and rung is None:  # a fixed config goes to skip-and-split, as in forward's switches
        plan = Plan(skip_split.NAME, run_plain)
        plan.extra = (ladder.rung_named(skip_split.NAME), causal, window, band, config)
    else:
        chosen, note = ladder.select(rung, q, k, v, causal, window)
        if config is not None or chosen.name not in _PLANNED:
            plan = Plan(chosen.name, run_plain)
            plan.extra = (chosen, causal, window, band, config)
        else:
            plan = _PLANNED[chosen.name](q, k, v, causal, window, band)
        plan.note = note
    plan.copy, plan.negate = copy, negate
    plan.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
    plan.o_shape, plan.lse_shape = (b, hq, nq, d), (b, hq, nq)
    return plan


def run_attention(plan: Plan, q, k, v, need_lse=True):
    """Launch a plan on tensors of its signature: ``(o, lse)``, lse None when ``need_lse`` is False and the
    split-KV path ran (it then writes the lse to scratch memory instead of a new tensor)."""
    if True in plan.copy:
        q, k, v = (x.contiguous() if c else x for x, c in zip((q, k, v), plan.copy, strict=True))
    if plan.negate:
        q = -q
    o = torch.empty_like(q) if plan.o_like_q else torch.empty(plan.o_shape, dtype=q.dtype, device=q.device)
    if need_lse or plan.path is not SPLIT_KV:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    else:
        lse = None
    plan.run(plan, q, k, v, o, lse)
    return o, lse


def run_plain(plan, q, k, v, o, lse):
    """A rung's plain launch (``flashlab.kernels.ladder``), every call: the lesson loop, or a fixed config."""
    chosen, causal, window, band, config = plan.extra
    chosen.launch(q, k, v, o, lse, causal, window, band, config=config)


# ----------------------------------------------------------------------------------------------------------------
# Split-KV and the KV cache: one launch, its chunks merged by their last finishers
# ----------------------------------------------------------------------------------------------------------------


def run_split(plan, q, k, v, o, lse):
    """A split-KV plan's launch; ``lse`` None writes it to scratch."""
    if not q.is_cuda:
        o_part, lse_part, spare, counters = workspace(plan, q.device, 0)
        tensors = (q, k, v, o_part, lse_part, o, spare if lse is None else lse, counters)
        _interpreted_launch(split_kv.split_kv_partial, plan.args, tensors)
        return
    with torch.cuda.device(q.device) if q.get_device() != current_device_index() else _NO_CONTEXT:
        stream = current_stream(q.get_device())
        o_part, lse_part, spare, counters = workspace(plan, q.device, stream)
        tensors = (q, k, v, o_part, lse_part, o, spare if lse is None else lse, counters)
        if plan.state is CHECKED:  # the launcher directly: no binding, no specialisation, no cache lookup
            plan.fast[0](stream, *tensors)
            return
        _decode_jit(plan, split_kv.split_kv_partial, split_kv.split_kv_partial_tuned, tensors, stream,
                    split_kv.PARTIAL_TENSORS)  # fmt: skip


def kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, checked) -> Plan:
    """The plan of a ``flash_attention_with_kvcache`` signature whose shapes passed (``checked``: capacity, pool
    blocks and block size from ``flashlab.host.checks.check_kvcache_inputs``)."""
    capacity, _, page_size = checked
    b, hq, nq, d = q.shape
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
                                         qk_scale)  # fmt: skip
    # the values of later calls' lengths and tables are checked against these; the device's error records
    plan.extra = (*checked, kvcache_errors.error_record(q.device), kvcache_errors.unreported_record(q.device))
    plan.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
    plan.o_shape, plan.lse_shape = (b, hq, nq, d), (b, hq, nq)
    return plan


def run_kvcache(plan: Plan, q, k_cache, v_cache, cache_seqlens, block_table, need_lse, errors):
    """A KV-cache plan's launch on tensors of its signature: ``(o, lse)`` (lse None unless ``need_lse``).
    ``errors`` is the error record the kernel writes a bad length or table entry into
    (``flashlab.host.kvcache_errors``)."""
    if plan.copy[0]:
        q = q.contiguous()
    if plan.negate:
        q = -q
    if plan.copy_lengths:
        cache_seqlens = cache_seqlens.contiguous()
    table = cache_seqlens if block_table is None else block_table  # never read without a block table
    if plan.copy_table:
        table = table.contiguous()
    o = torch.empty_like(q) if plan.o_like_q else torch.empty(plan.o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
    if not q.is_cuda:
        o_part, lse_part, spare, counters = workspace(plan, q.device, 0)
        tensors = (q, k_cache, v_cache, table, cache_seqlens, o_part, lse_part, o, spare if lse is None else lse)
        args = plan.args
        with interpreted_language(*kvcache.DEVICE_MODULES):
            interpreted(kvcache.kvcache_partial)[args.grid](*tensors, counters, errors, *args.scalars, *args.tune,
                                                            **args.meta, BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip
        return o, lse
    with torch.cuda.device(q.device) if q.get_device() != current_device_index() else _NO_CONTEXT:
        stream = current_stream(q.get_device())
        o_part, lse_part, spare, counters = workspace(plan, q.device, stream)
        tensors = (q, k_cache, v_cache, table, cache_seqlens, o_part, lse_part, o, spare if lse is None else lse)
        tensors += (counters, errors)
        if plan.state is CHECKED:  # the launcher directly
            plan.fast[0](stream, *tensors)
        else:
            _decode_jit(plan, kvcache.kvcache_partial, kvcache.kvcache_partial_tuned, tensors, stream,
                        kvcache.PARTIAL_TENSORS)  # fmt: skip
    return o, lse


def _interpreted_launch(jit_function, args, tensors):
    with interpreted_language(softmax_step):
        interpreted(jit_function)[args.grid](*tensors, *args.scalars, *args.tune, **args.meta,
                                             BLOCK_N=CPU_CONFIG["BLOCK_N"])  # fmt: skip


def _decode_jit(plan, jit_function, tuned, tensors, stream, names):
    """A decode plan's launch through the JIT: the autotuner's pick for its tuning key the first time that key
    comes (``TUNED``), then the direct launch moved on (``Plan.advance``)."""
    args, grid = (*tensors, *plan.args.scalars, *plan.args.tune), plan.args.grid
    meta = plan.args.meta
    kernel = None
    if "num_warps" in meta:  # a fixed config, or the pick found on an earlier call
        kernel = jit_function[grid](*args, **meta)
    else:
        key = (plan.path, tensors[0].device, tensors[0].dtype, plan.args.tune, *meta.values())
        best = TUNED.get(key)
        if best is None:
            tuned[grid](*args, **meta)
            best = TUNED[key] = tuned.best_config.all_kwargs()
        else:
            kernel = jit_function[grid](*args, **meta, **best)
        plan.args.meta = meta = {**meta, **best}
    out = names.index("O")  # o and lse follow each other

    def build():
        return None if kernel is None else (FastLaunch.build(jit_function, kernel, grid, args, meta, names),)

    def check():
        into = lambda o2, lse2: plan.fast[0](stream, *tensors[:out], o2, lse2, *tensors[out + 2 :])  # noqa: E731
        return reproduces(into, tensors[out], tensors[out + 1])

    plan.advance(build, check)


# ----------------------------------------------------------------------------------------------------------------
# The ladder's planned rungs: skip-and-split, Hopper, overlap
# ----------------------------------------------------------------------------------------------------------------

PREFILL_TENSORS = ("Q", "K", "V", "O", "LSE", "desc_q", "desc_k", "desc_v", "desc_o")


def skip_split_plan(q, k, v, causal, window, band) -> Plan:
    """Skip-and-split: its arguments, its TMA choice, and (after the first call on a GPU) the autotuner's pick."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    offset, win_left, win_right, qk_scale = band
    plan = Plan(skip_split.NAME, run_skip_split)
    # masked short sequences: TMA was erratic there on the H200 (docs/host-path.md)
    want_tma = q.is_cuda and skip_split.wants_tma(causal, window, nk)
    strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
    scalars = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    scalars += (v.stride(0), v.stride(1), v.stride(2), *strides_o)
    plan.args = scalars + (hq, hq // hk, nq, nk, offset, win_left, win_right, qk_scale)
    # re-tune per power-of-two length and per power-of-two amount of work (B * Hq * Nq query rows), not per shape
    plan.tune = skip_split.tune_key(b, hq, nq, nk, causal, window)
    plan.meta = skip_split.kernel_meta(q, causal)
    plan.grid = (b * hq, nq)  # (query heads, query rows): the first grid dim divides by BLOCK_M at launch
    plan.extra = want_tma
    return plan


def run_skip_split(plan, q, k, v, o, lse):
    if plan.state is CHECKED and q.get_device() == current_device_index():  # pointer loads, checked
        plan.fast[0](current_stream(q.get_device()), q, k, v, o, lse, q, k, v, o)  # the launcher directly
        return
    descs = skip_split.tma_descriptors(q, k, v, o) if plan.extra else None
    args = (q, k, v, o, lse, *(descs if descs else (q, k, v, o)), *plan.args, *plan.tune)
    meta = {**plan.meta, "USE_TMA": descs is not None}
    if not q.is_cuda:
        grid = (cdiv(plan.grid[1], CPU_CONFIG["BLOCK_M"]), plan.grid[0])
        with interpreted_language(softmax_step):
            interpreted(skip_split.attn_fwd)[grid](*args, **meta, **CPU_CONFIG)
        return
    with torch.cuda.device(q.device) if q.device.index != torch.cuda.current_device() else _NO_CONTEXT:
        if plan.config is None or plan.config[0] != meta["USE_TMA"]:  # the autotuner picks, once per tuning key
            bh, nq = plan.grid
            skip_split.attn_fwd_tuned[lambda m: (cdiv(nq, m["BLOCK_M"]), bh)](*args, **meta)
            config = skip_split.attn_fwd_tuned.best_config.all_kwargs()
            plan.config = (meta["USE_TMA"], config, (cdiv(nq, config["BLOCK_M"]), bh))
            return
        _, config, grid = plan.config
        if descs:
            names = ("desc_q", "desc_k", "desc_v", "desc_o")
            skip_split.set_tma_block_shapes({**dict(zip(names, descs, strict=True)), **config, **meta})
        kernel = skip_split.attn_fwd[grid](*args, **meta, **config)
        if descs is None:  # pointer loads: the direct launch, built, then checked once
            stream = current_stream(q.device.index)

            def build():
                kwargs = {**meta, **config}
                return (FastLaunch.build(skip_split.attn_fwd, kernel, grid, args, kwargs, PREFILL_TENSORS),)

            def check():
                return reproduces(lambda o2, lse2: plan.fast[0](stream, q, k, v, o2, lse2, q, k, v, o2), o, lse)

            plan.advance(build, check)


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


def run_hopper(plan, q, k, v, o, lse):
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
    if plan.config is None:  # the autotuner picks, once per signature
        hopper.hopper_fwd_tuned[lambda m: (cdiv(nq, m["BLOCK_M"]), bh)](*args, **plan.meta)
        plan.config = hopper.hopper_fwd_tuned.best_config.all_kwargs()
        plan.grid = (cdiv(nq, plan.config["BLOCK_M"]), bh)
    else:
        kernel = hopper.hopper_fwd[plan.grid](*args, **plan.meta, **plan.config)
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


def overlap_plan(q, k, v, causal, window, band) -> Plan:
    """Rung 4: the grid, the arguments and constexprs, and direct relaunches of the kernel and of the Hopper
    rung's repair pass, through flashlab's own launcher (which encodes the four tensor maps from the tensors'
    addresses). Through Triton's JIT, building the four descriptors in Python and binding them cost 140-390 us of
    host time per call on the H200's host, more than the GPU time of a short call (docs/host-path.md). A
    signature does not include addresses: a call whose q, k, v or o is not 16-byte aligned, which the copy engine
    cannot take, runs skip and split instead."""
    from flashlab.kernels.ladder import rung4_overlap as overlap

    plan = Plan(overlap.NAME, run_overlap)
    table = None
    if q.is_cuda:
        plan.grid, table, plan.args, plan.meta = overlap.launch_shape(q, k, causal, window, band)
    plan.extra = [overlap, (causal, window), band, table, None]  # the repair pass: from the first call's o
    return plan


def run_overlap(plan, q, k, v, o, lse):
    overlap, mask, band, table = plan.extra[:4]
    if not all(overlap.hopper.aligned(x) for x in (q, k, v, o)):  # same signature, addresses TMA cannot take
        skip_split.launch(q, k, v, o, lse, *mask, band)
        return
    if not q.is_cuda:
        overlap.launch(q, k, v, o, lse, *mask, band)
        return
    if plan.state is CHECKED and q.get_device() == current_device_index():
        _overlap_fast(plan, current_stream(q.get_device()), q, k, v, o, lse)
        return
    with torch.cuda.device(q.device):
        _overlap_jit(plan, overlap, q, k, v, o, lse)


def _overlap_fast(plan, stream, q, k, v, o, lse):
    table = plan.extra[3]
    plan.fast[0](stream, q, k, v, o, lse, lse if table is None else table)
    if len(plan.fast) > 1:
        plan.fast[1](stream, q, k, v, o, lse)


def _overlap_jit(plan, overlap, q, k, v, o, lse):
    (causal, window), band, table = plan.extra[1:4]
    if plan.extra[4] is None and (causal or window is not None):
        plan.extra[4] = overlap.hopper.repair_parts(q, k, v, o.stride()[:3], causal, window, band)
    repair = plan.extra[4]
    args = (*overlap.descriptors(q, k, v, o, plan.meta["BLOCK_N"]), lse, lse if table is None else table, *plan.args)
    kernel = overlap.attn_fwd_overlap[plan.grid](*args, **plan.meta)
    repair_kernel = None
    if repair is not None:
        jit, rgrid, rargs, rmeta = repair
        repair_kernel = jit[rgrid](q, k, v, o, lse, *rargs, **rmeta)

    def build():
        fast = FastLaunch.build(overlap.attn_fwd_overlap, kernel, plan.grid, args, plan.meta,
                                overlap.DESCRIBED_TENSORS, native_only=True)  # fmt: skip
        if repair_kernel is None:
            return (fast,)
        jit, rgrid, rargs, rmeta = repair
        return fast, FastLaunch.build(jit, repair_kernel, rgrid, (q, k, v, o, lse, *rargs), rmeta, HOPPER_TENSORS)

    def check():
        stream = current_stream(q.get_device())
        return reproduces(lambda o2, lse2: _overlap_fast(plan, stream, q, k, v, o2, lse2), o, lse)

    plan.advance(build, check)


_PLANNED = {"skip_split": skip_split_plan, "hopper": hopper_plan, "overlap": overlap_plan}


__all__ = ["KVCACHE", "SPLIT_KV", "attention_plan", "kvcache_plan", "run_attention", "run_kvcache", "unit_stride_d"]
