"""The plan: what a call signature decides once, in the one cache the host engine keeps.

A call signature is everything the checks and the launch decide from: shapes, strides, dtypes, devices, layouts,
the mask, the scale, the path asked for (``signature`` for ``flash_attention``, ``kvcache_signature`` for
``flash_attention_with_kvcache``). An entry point computes it once per call and looks it up in ``PLANS``; a
signature is planned (checked, then its launches decided) the first time it comes, so a repeated call (a decode
step, a layer of a model) pays one dict lookup, its outputs' allocation and its kernel launches.

``Plan`` is the one plan type, for prefill, split-KV, the paged KV cache and every rung of the ladder: the path,
what the entry point does around the launch (copies, the negation of q, the outputs), the kernel's arguments, and
the direct launch's state. A plan launches through Triton's JIT first (the autotuner's pick is made there, once),
then builds a direct launch of the compiled kernel (``flashlab.host.launcher.FastLaunch``), checks it once against
a JIT launch bit for bit, and uses it from then on:

    "untried" --first JIT launch--> "built" --next JIT launch, same bits--> "checked" (direct launches from now on)
          \\--no direct launch here--> "off"      \\--other bits, or an error--> "off" (JIT launches stay)

``TUNED`` keeps the autotuner's pick per tuning key (a power-of-two length class), so a new plan of a known class
(a decode loop meets a new cache length every step) skips the autotuner's own bookkeeping.
"""

from __future__ import annotations

import torch

from flashlab.kernels.device import stream_capturing

UNTRIED, BUILT, CHECKED, OFF = "untried", "built", "checked", "off"

PLANS: dict = {}  # call signature -> Plan
# A decode loop over a growing contiguous cache meets a new length every step: the cache is bounded, and cleared
# whole when full (the next calls plan again; each plan is cheap to make next to the launches it saves).
MAX_PLANS = 4096
TUNED: dict = {}  # (kernel, device, dtype, tuning key, constexprs) -> the autotuner's pick (a dict of its kwargs)


class Plan:
    """One call signature's decisions (see the module docstring). ``run(plan, ...)`` launches it: the function of
    ``flashlab.host.launches`` for its path, set when the plan is made."""

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
        "scratch_bytes",  # global scratch the direct launch passes (the Hopper rung's descriptors)
        "views",  # the stream's scratch cut for this plan: (stream, epoch, cut)
    )

    def __init__(self, path, run):
        self.path, self.run, self.note = path, run, None
        self.copy, self.negate, self.o_like_q = (False, False, False), False, True
        self.o_shape = self.lse_shape = None
        self.copy_lengths = self.copy_table = False
        self.backward = None
        self.args, self.tune, self.meta, self.grid, self.config, self.extra = (), (), {}, None, None, None
        self.fast, self.state, self.scratch_bytes, self.views = None, UNTRIED, 0, None

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


def remember(key, plan: Plan) -> Plan:
    """Keep ``plan`` for the signature ``key`` (None: a signature that cannot be hashed exactly, not kept)."""
    if key is not None:
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[key] = plan
    return plan


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
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, causal, window, scale,
            type(scale), num_splits, k.dtype, v.dtype, k.device, v.device, rung)  # fmt: skip


def kvcache_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale):
    """A ``flash_attention_with_kvcache`` call's signature (its tensors' shapes, strides, dtypes and devices, the
    mask and scale), or None where it cannot be hashed exactly."""
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
    if block_table is None:
        return key
    if type(block_table) is not torch.Tensor or block_table.layout is not torch.strided:
        return None
    return (*key, block_table.shape, block_table.stride(), block_table.dtype, block_table.device)


__all__ = ["BUILT", "CHECKED", "MAX_PLANS", "OFF", "PLANS", "Plan", "TUNED", "UNTRIED", "kvcache_signature",
           "remember", "signature"]  # fmt: skip
