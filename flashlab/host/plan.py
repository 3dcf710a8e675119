"""The plan: what a bucket of call signatures decides once, in the one cache the host engine keeps.

A call signature is everything the checks and the launch decide from: shapes, strides, dtypes, devices, layouts,
the mask, the scale, the path asked for (``signature`` for ``flash_attention``, ``kvcache_signature`` for
``flash_attention_with_kvcache``). Two caches, both bounded (cleared whole when full: the next calls plan again,
which is cheap next to the launches it saves):

- ``CALLS`` (at most ``MAX_CALLS``): signature -> ``Call``, what the shapes decide per signature: the kernel's
  runtime scalars (lengths, band, strides, chunks), the grid, the outputs' shapes, the copies around the launch.
  Made the first time a signature comes, after every argument check (``flashlab.host.checks``: a few
  microseconds of integer checks); a repeated call (a layer of a model) pays one dict lookup.
- ``PLANS`` (at most ``MAX_PLANS``): plan key -> ``Plan``. A plan key holds only what picks the compiled binary
  and its tiles: the path or rung, device, dtype, head dim, the mask's kind (none / causal / a window with which
  sides), the GQA group, the constexprs and tile config the kernel runs with (``flashlab.kernels.configs``: a
  table by length bucket, never the autotuner inside a call unless ``FLASHLAB_AUTOTUNE=1``), each stride's class
  as Triton specialises it (1, divisible by 16, other; 32 or 64 bits) and whether the tensors' addresses are
  16-byte aligned -- never an exact length or stride. The planned kernels take their lengths as runtime values
  (``do_not_specialize``), so every signature of a bucket runs the same compiled binary: a decode loop over a
  growing cache, or chunked prefill with a new (Nq, Nk) every call, shares one plan per bucket.

A plan launches through Triton's JIT first, then builds a direct launch of the compiled kernel
(``flashlab.host.launcher.FastLaunch``) that takes each call's grid and runtime scalars, checks it once against a
JIT launch bit for bit -- on whichever signature of the bucket comes next, so once per compiled binary -- and uses
it from then on:

    "untried" --first JIT launch--> "built" --next JIT launch, same binary, same bits--> "checked" (direct from now)
          \\--no direct launch here--> "off"      \\--another binary, other bits, an error--> "off" (JIT launches stay)

Paths not bucketed (the lesson loop, fixed configs, the Hopper and overlap rungs, the KV cache, whose signature
does not change in a decode loop) key their plan by the exact signature, as one bucket per signature.
"""

from __future__ import annotations

import torch

from flashlab.kernels.device import stream_capturing

UNTRIED, BUILT, CHECKED, OFF = "untried", "built", "checked", "off"

PLANS: dict = {}  # plan key (a bucket) -> Plan
MAX_PLANS = 1024
CALLS: dict = {}  # call signature -> Call
MAX_CALLS = 4096
FAMILIES: dict = {}  # family key (a signature but its lengths) -> its family (launches.SplitFamily, PrefillFamily)
MAX_FAMILIES = 1024
MAX_MET = 4096  # the (nq, nk) pairs a family remembers having met (``met_before``)


class Plan:
    """One bucket's decisions (see the module docstring). ``run(call, ...)`` launches a call of it: the function
    of ``flashlab.host.launches`` for its path, set when the plan is made."""

    __slots__ = (
        "path",  # the kernel it launches: "split_kv", "kvcache", or a rung's name
        "run",  # the path's launch: run(plan, tensors...)
        "note",  # the warning a call repeats when the rung it asked for cannot run here, or None
        # around the launch
        "copy",  # (q, k, v): copied to unit stride along D
        "negate",  # q runs negated (a negative scale)
        "o_shape",
        "lse_shape",
        "o_like_q",  # o allocated like q (quicker), else contiguous
        "copy_lengths",  # the KV cache's lengths / block table are copied to unit stride (they are tiny)
        "copy_table",
        "backward",  # the plan a differentiable call of this signature runs (the prefill kernel), once made
        # the launch
        "args",  # the kernel's scalar arguments: a tuple, or the kernel module's arguments object
        "tune",  # the autotuner's key arguments
        "meta",  # constexprs (and the autotuner's pick, once made)
        "grid",
        "config",  # the autotuner's pick, once made
        "extra",  # what the path needs besides: the mask and band, a repair pass, a schedule table...
        "fast",  # the direct launches, in launch order, once built
        "state",  # UNTRIED, BUILT, CHECKED or OFF
        "scratch_bytes",  # global scratch the direct launch passes (descriptors); a "planned" plan's: per program
        "views",  # the stream's scratch cut for this plan: (stream, epoch, cut)
        "key",  # the plan key it is kept under
        "binary",  # the compiled kernel its direct launch relaunches, once built
    )

    def __init__(self, path, run):
        self.path, self.run, self.note = path, run, None
        self.copy, self.negate, self.o_like_q = (False, False, False), False, True
        self.o_shape = self.lse_shape = None
        self.copy_lengths = self.copy_table = False
        self.backward = None
        self.args, self.tune, self.meta, self.grid, self.config, self.extra = (), (), {}, None, None, None
        self.fast, self.state, self.scratch_bytes, self.views = None, UNTRIED, 0, None
        self.key = self.binary = None

    @property
    def plan(self):
        """A plan keyed by its signature (the Hopper and overlap rungs) runs as its own call: ``run(plan, ...)``."""
        return self

    def advance(self, build, check) -> None:
        """After a launch through the JIT, move the direct launch one step on. ``build()`` gives the direct
        launches built from this launch (None in the tuple: this Triton does not allow one), or None when this
        launch cannot give them (the autotuner ran it); ``check()`` relaunches them into fresh outputs and says
        whether they gave this launch's bits. Not while a CUDA graph is being captured (nothing is compared)."""
        if self.state == UNTRIED:
            fast = build()
            if fast is None:
                return
            if all(f is not None for f in fast):
                self.fast, self.state = fast, BUILT
            else:
                self.state = OFF
        elif self.state == BUILT and not stream_capturing():
            self.state = CHECKED if check() else OFF


class Call:
    """One call signature's share (see the module docstring): its plan and what its shapes decide. ``args``: the
    path's kernel arguments for these shapes (``split_kv.SplitArguments``...), ``values``: the runtime scalars a
    direct launch passes, in the order it was built with, ``grid``: the launch grid."""

    __slots__ = ("plan", "note", "copy", "negate", "o_shape", "lse_shape", "o_like_q", "args", "values", "grid",
                 "views", "backward")  # fmt: skip

    def __init__(self, plan):
        self.plan, self.note = plan, plan.note
        self.copy, self.negate, self.o_like_q = (False, False, False), False, True
        self.o_shape = self.lse_shape = None
        self.args, self.values, self.grid, self.views, self.backward = None, (), None, None, None

    @property
    def path(self):
        return self.plan.path


def forget() -> None:
    """Drop every kept plan, call and family: each signature's next call plans afresh, reading the kernels' tile
    constants again (what a probe that changes them between timings needs)."""
    PLANS.clear()
    CALLS.clear()
    FAMILIES.clear()


def remember(key, plan: Plan) -> Plan:
    """Keep ``plan`` under the key ``key`` (None: a signature that cannot be hashed exactly, not kept)."""
    if key is not None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
        plan.key = key
    return plan


def planned(key, make) -> Plan:
    """The plan kept under ``key``, or ``make()``'s, kept."""
    plan = PLANS.get(key)
    return plan if plan is not None else remember(key, make())


def remember_call(key, call: Call) -> Call:
    """Keep ``call`` for the signature ``key`` (None: not kept)."""
    if key is not None:
        if len(CALLS) >= MAX_CALLS:
            CALLS.clear()
        CALLS[key] = call
    return call


def remember_family(key, family):
    """Keep ``family`` under the family key ``key`` (either None: nothing kept)."""
    if key is not None and family is not None:
        if len(FAMILIES) >= MAX_FAMILIES:
            FAMILIES.clear()
        FAMILIES[key] = family
    return family


def met_before(met: set, nq: int, nk: int) -> bool:
    """Whether a family has met the signature of ``nq`` queries and ``nk`` keys before, ``met`` being its set of
    the pairs it has made calls for; it joins them if not. Within one family (``family_key``) the two counts are
    all that tells its signatures apart. A family's call is kept in ``CALLS`` only from its signature's second
    meeting: a decode loop over a growing cache, or chunked prefill, meets each signature once, and keeping each of
    those calls would fill the heap with objects that outlive Python's young generations, whose full collections
    then cost the loop a share of every step. The pair is held as one int (ints are not tracked by the collector;
    the counts are below 2**32)."""
    pair = nq << 32 | nk
    if pair in met:
        return True
    if len(met) >= MAX_MET:
        met.clear()
    met.add(pair)
    return False


def family_key(key, q, k, v):
    """A ``flash_attention`` signature (``signature``: None gives None) without its query and key counts: the
    signatures of one decode loop over a growing cache share it, and those of chunked prefill. A tensor's strides
    stay in it unless the tensor is contiguous (then they follow from the shape, and a cache that ``torch.cat``
    grows keeps one family). None where the call has no family (no signature, or tensors that are not 4-d)."""
    if key is None:
        return None
    q_shape, q_stride, k_shape, k_stride, v_shape, v_stride = key[:6]
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return None  # not a (batch, heads, tokens, head dim) call: checked_call's checks say what is wrong
    # flat, a contiguous tensor's strides as None: a growing decode loop builds one of these every step
    return (q_shape[0], q_shape[1], q_shape[3], k_shape[0], k_shape[1], k_shape[3], v_shape[0], v_shape[1],
            v_shape[3], None if q.is_contiguous() else q_stride, None if k.is_contiguous() else k_stride,
            None if v.is_contiguous() else v_stride, key[6:])  # fmt: skip


def int_class(x: int) -> int:
    """How Triton specialises an integer argument: 1 (a constant), divisible by 16, other; +4 where it takes 64
    bits. Two strides of one class compile to the same binary."""
    return (x == 1) + 2 * (x % 16 == 0) + 4 * (not -(2**31) <= x < 2**31)


def int_classes(values) -> tuple:
    return tuple(int_class(x) for x in values)


def wide(values) -> bool:
    """Whether any of these runtime integers takes 64 bits (another binary)."""
    return bool(values) and not (-(2**31) <= min(values) and max(values) < 2**31)


def mask_kind(causal, window) -> tuple:
    """The mask's kind as a plan key holds it: causal, and a window's bounded sides (its widths are runtime)."""
    if window is None:
        return (bool(causal), None)
    return (bool(causal), (window[0] is not None, window[1] is not None))


def mask_name(causal, window) -> str:
    """``flashlab.kernels.configs``' name of the mask: "none", "causal" or "window"."""
    return "window" if window is not None else ("causal" if causal else "none")


def _window_key(window):
    if window is None:
        return None
    if type(window) not in (tuple, list) or not all(w is None or type(w) is int for w in window):
        return False  # not hashable exactly
    return tuple(window)


def signature(q, k, v, causal, window, scale, num_splits, rung):
    """A ``flash_attention`` call's signature, or None where it cannot be hashed exactly (arguments of other
    types, a sparse tensor, while torch.compile traces): then nothing is kept for the call."""
    if type(causal) is not bool or not (scale is None or type(scale) is float or type(scale) is int):
        return None
    if not (type(q) is type(k) is type(v) is torch.Tensor) or not (rung is None or type(rung) is str):
        return None
    if not (num_splits is None or type(num_splits) is int):
        return None
    window = _window_key(window)
    if window is False or not (q.layout is k.layout is v.layout is torch.strided):
        return None
    aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15  # Triton specialises 16-byte aligned pointers
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, causal, window, scale,
            type(scale), num_splits, k.dtype, v.dtype, k.device, v.device, aligned, rung)  # fmt: skip


def kvcache_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, cu_seqlens_q=None,
                      max_seqlen_q=None, k_descale=None, v_descale=None):  # fmt: skip
    """A ``flash_attention_with_kvcache`` call's signature (its tensors' shapes, strides, dtypes and devices, the
    mask and scale), or None where it cannot be hashed exactly. A packed q's (``cu_seqlens_q``) adds the offsets'
    tensor and ``max_seqlen_q``: with q's shape (total_q), what its grid and scratch are cut for. An 8-bit cache's
    descales add theirs (the cache's dtype is already in: a 16-bit and an 8-bit cache compile apart)."""
    if type(causal) is not bool or not (scale is None or type(scale) is float or type(scale) is int):
        return None
    window = _window_key(window)
    if window is False or not (type(q) is type(k_cache) is type(v_cache) is type(cache_seqlens) is torch.Tensor):
        return None
    if not (q.layout is k_cache.layout is v_cache.layout is cache_seqlens.layout is torch.strided):
        return None
    key = ("kvcache", causal, window, scale, type(scale), q.shape, q.stride(), q.dtype, q.device, k_cache.shape,
           k_cache.stride(), k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype,
           v_cache.device, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
           cache_seqlens.device)  # fmt: skip
    if cu_seqlens_q is not None:
        if type(cu_seqlens_q) is not torch.Tensor or cu_seqlens_q.layout is not torch.strided:
            return None
        if type(max_seqlen_q) is not int:
            return None
        key = (*key, "ragged", cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_q.device,
               max_seqlen_q)  # fmt: skip
    elif max_seqlen_q is not None:
        return None
    if k_descale is not None or v_descale is not None:
        if not (type(k_descale) is type(v_descale) is torch.Tensor):
            return None
        if not (k_descale.layout is v_descale.layout is torch.strided):
            return None
        key = (*key, "descales", k_descale.shape, k_descale.stride(), k_descale.dtype, k_descale.device,
               v_descale.shape, v_descale.stride(), v_descale.dtype, v_descale.device)  # fmt: skip
    if block_table is None:
        return key
    if type(block_table) is not torch.Tensor or block_table.layout is not torch.strided:
        return None
    return (*key, block_table.shape, block_table.stride(), block_table.dtype, block_table.device)


__all__ = ["BUILT", "CALLS", "CHECKED", "Call", "FAMILIES", "MAX_CALLS", "MAX_FAMILIES", "MAX_PLANS", "OFF", "PLANS",
           "Plan", "UNTRIED", "family_key", "forget", "int_class", "int_classes", "kvcache_signature", "mask_kind",
           "mask_name", "met_before", "planned", "remember", "remember_call", "remember_family", "signature",
           "wide"]  # fmt: skip
