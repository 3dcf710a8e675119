"""FlashAttention's forward pass from Python: ``flash_attention`` checks the inputs, plans the call once per call
signature, and launches a kernel.

The kernel itself lives in its own module: ``flashlab.kernels.skip_split`` (the tiled loop of
``flashlab.reference.tiled_attention`` that loads only the key tiles the mask leaves visible and runs the tiles
every row sees without a mask). Decode-sized calls (a few query rows against a long cache) go to
``flashlab.kernels.split_kv`` instead, which cuts the keys into chunks that run in parallel and merges them by
their log-sum-exps.

What this module owns is the host side: the checks (``check_inputs``: every bad argument is a TypeError or
ValueError naming it), the band and scale as the kernels take them (``kernel_args``), the plan a call signature
gets once and reuses (``ForwardPlan``: the path, the launch arguments, the autotuner's pick, a direct relaunch),
and the autograd hook-up (``flashlab.kernels.autograd``).

On CUDA tensors the kernels are compiled (autotuned over block sizes, warps and pipeline stages). On CPU tensors the
very same kernel source runs through Triton's interpreter (one small tile config), so every notebook runs without a
GPU and without the user setting ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings

import torch

from flashlab.core.checks import as_real
from flashlab.core.integers import cdiv
from flashlab.core.masking import visible_band
from flashlab.core.shapes import attention_shape
from flashlab.kernels import autograd, ladder, skip_split, softmax_step, split_kv
from flashlab.kernels.runtime import (
    CPU_CONFIG,
    DTYPES,
    HEAD_DIM_MULTIPLE,
    LOG2_E,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    FastLaunch,
    current_device_index,
    current_stream,
    interpreted,
    interpreted_language,
    reproduces,
)

MAX_FLOAT32 = 3.4028234663852886e38  # the largest finite float32: qk_scale = scale * log2(e) must stay below it

# ----------------------------------------------------------------------------------------------------------------
# The Python entry point: validate, then launch
# ----------------------------------------------------------------------------------------------------------------


_CHECKED: dict = {}  # call signature -> check_inputs' result, for signatures that passed once
MAX_CHECKED = 4096


def check_inputs(q, k, v, causal, window, scale):
    """Validate the arguments of an attention call; returns ``(shape, band)`` (``flashlab.core.shapes``,
    ``flashlab.core.masking.visible_band``). Every bad argument is a TypeError or ValueError naming it.

    Everything checked is a function of the tensors' shapes, dtypes and devices and of the other arguments, so a
    signature that passed once passes again: it is remembered (plain tensors and exactly-typed arguments only)."""
    key = None
    plain = type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    if plain and not torch.compiler.is_compiling():  # torch.compile traces the checks themselves
        key = _plan_key(q, k, v, causal, window, scale, None)
        if key is not None:
            hit = _CHECKED.get(key)
            if hit is not None:
                return hit
    result = _check_inputs(q, k, v, causal, window, scale)
    if key is not None:
        if len(_CHECKED) >= MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED[key] = result
    return result


def _check_inputs(q, k, v, causal, window, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dense(name, x)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; flash_attention supports float16, bfloat16 and float32")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on the same device; got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"flash_attention runs on CUDA (compiled) or CPU (interpreted) tensors; got {q.device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq_len, head_dim); got shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); every dim must be at least 1")
    shape = attention_shape(q.shape, k.shape, v.shape)  # ValueError naming the mismatch (heads, lengths, D)
    if shape.dv != shape.d:
        raise ValueError(f"v must have the same head dim as q and k ({shape.d}); got {shape.dv}")
    d = shape.d
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"head dim {d} is not supported: it must be a multiple of {HEAD_DIM_MULTIPLE} "
            f"between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    band = visible_band(shape.nq, shape.nk, causal, window)  # ValueError for a malformed window; any int side
    check_scale(scale)
    return shape, band


def check_dense(name: str, x) -> None:
    """A TypeError unless ``x`` is a dense (strided) torch.Tensor: the kernels read memory through strides, which a
    sparse or MKL-DNN tensor does not have."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor; got layout {x.layout} (convert it with .to_dense())")


def check_scale(scale) -> None:
    """A TypeError or ValueError unless ``scale`` is None or a real number the kernels can take: finite, and with
    ``scale * log2(e)`` inside float32's range (the kernels scale scores by it in float32)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a number or None; got {type(scale).__name__}")
    scale = as_real("scale", scale)  # ValueError for NaN, inf, or an int too large for a float (10**400)
    if abs(scale) * LOG2_E > MAX_FLOAT32:
        raise ValueError(
            f"scale {scale:g} is outside float32's range: the kernels multiply scores by scale * log2(e) in "
            f"float32, so |scale| must be at most {MAX_FLOAT32 / LOG2_E:.4g}"
        )


def check_num_splits(num_splits, nk: int) -> None:
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None; got {type(num_splits).__name__}")
    most = min(nk, split_kv.MAX_SPLITS)
    if not 1 <= num_splits <= most:
        raise ValueError(f"num_splits must be between 1 and min(Nk, {split_kv.MAX_SPLITS}) = {most}; got {num_splits}")


def flash_attention(q, k, v, causal=False, window=None, scale=None, return_lse=False, *, num_splits=None, rung=None):
    """FlashAttention forward: ``softmax(q k^T * scale + mask) v``, never materialising the score matrix.

    q ``(B, Hq, Nq, D)``, k and v ``(B, Hk, Nk, D)`` with Hq a multiple of Hk (grouped-query attention: query head h
    reads K/V head ``h // (Hq // Hk)``, without copying K/V). Any Nq, Nk >= 1; D a multiple of 8 in [16, 256];
    float16, bfloat16 or float32; any strides (a last dim that is not contiguous is copied once).

    ``causal`` and ``window=(left, right)`` follow ``flashlab.core.masking`` (bottom-right aligned). ``scale``
    defaults to ``1/sqrt(D)``. Returns ``o`` (like q), or ``(o, lse)`` with ``return_lse=True``: lse ``(B, Hq, Nq)``
    float32 is the natural log-sum-exp of each row's scaled, masked scores; a row that sees no key gives zeros and
    lse = -inf.

    Decode (at most ``flashlab.kernels.split_kv.MAX_SPLIT_QUERY_ROWS`` query rows) takes the split-KV path
    (Flash-Decoding): the keys are cut into chunks that run in parallel and are merged by their log-sum-exps.
    ``num_splits`` forces that path with this many chunks (at any Nq); ``None`` chooses.

    ``rung`` picks the prefill kernel from the kernel ladder (``flashlab.kernels.ladder.RUNGS``): ``None`` runs the
    rung measured fastest for these inputs on their device -- on a Hopper GPU ``"overlap"`` for 16-bit inputs at
    D = 64, 128 and 256 (any lengths and windows, layouts the copy engine can describe), ``"hopper"`` for other
    16-bit inputs at head dims 65-128 from 1K keys,
    ``"skip_split"`` otherwise -- (and split-KV for decode, as above); a name such as
    ``"lesson_loop"`` or ``"skip_split"`` runs that rung at any Nq (not split-KV, so it cannot be combined with
    ``num_splits``). Where the named rung cannot run here, a ``RuntimeWarning`` names it and the reason, and the
    fastest rung that can run is used. An unknown name is a ValueError listing the rungs.

    Differentiable: when grad is enabled and q, k or v requires grad, backpropagating through ``o`` gives
    gradients for q, k and v from the FlashAttention-2 backward (``flashlab.kernels.backward``: the probabilities
    recomputed from q, k and the saved lse, nothing of size Nq x Nk stored; deterministic). Such calls always take
    the prefill kernel (``num_splits`` is ignored: split-KV has no backward; a ``rung`` is kept, and the backward
    uses the log-sum-exp that rung computed). ``lse`` is not differentiable: a loss
    that depends on it raises an error in the backward pass.

    Must equal ``flashlab.reference.tiled_attention`` (the NumPy tiled loop) and ``flashlab.reference.attention``
    (the float64 definition) to within the input dtype's rounding (``flashlab.core.numerics.TOLERANCE``). CUDA
    tensors run the compiled, autotuned kernel; CPU tensors run the same kernel through Triton's interpreter.
    """
    plan = None
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
        key = _plan_key(q, k, v, causal, window, scale, num_splits, rung)
        plan = _PLANS.get(key) if key is not None else None  # a plan exists only for a signature that was checked
    if plan is None:
        check_inputs(q, k, v, causal, window, scale)
        check_num_splits(num_splits, k.shape[2])
        if rung is not None:
            ladder.rung_named(rung)  # an unknown name fails here, before anything runs
            if num_splits is not None:
                raise ValueError(
                    f"num_splits chooses the split-KV path and rung={rung!r} a prefill kernel of the ladder; pass one"
                )
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # differentiable: the prefill kernel (split-KV has no backward), then flashlab.kernels.backward
        run_forward = forward if rung is None else functools.partial(forward, rung=rung)
        o, lse = autograd.differentiable_attention(run_forward, q, k, v, causal, window, scale)
    elif plan is not None:
        o, lse = run_plan(plan, q, k, v, return_lse)
    else:
        o, lse = forward(q, k, v, causal, window, scale, num_splits=num_splits, rung=rung, need_lse=return_lse)
    return (o, lse) if return_lse else o


def launched_q(q, negate: bool):
    """The q a launch runs on: unit stride along D (else a contiguous copy), negated for a negative scale. Its
    strides follow from q's, so a plan takes them from this same function's result at plan time."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return -q if negate else q


def kernel_args(q, k, v, causal, window, scale):
    """The band and scale of a checked call, as the kernels take them: ``(q, offset, win_left, win_right, qk_scale)``.

    A negative scale is applied as ``-q`` with ``-scale`` (exact), because the running max assumes
    ``max(s) * scale = max(s * scale)``; an unbounded side of the band becomes a distance wider than the matrix."""
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
    offset, left, right = visible_band(nq, nk, causal, window)
    scale = 1.0 / math.sqrt(d) if scale is None else as_real("scale", scale)  # a Python float (np.float32 too)
    if scale < 0:
        q, scale = -q, -scale
    big = nq + nk + 1  # "unbounded" side of the band: wider than any distance in the score matrix
    win_left = big if left == float("inf") else min(int(left), big)  # never past int32 in the kernel
    win_right = big if right == float("inf") else min(int(right), big)
    return q, offset, win_left, win_right, scale * LOG2_E


# Set by flashlab.kernels.op: ``forward``'s stand-in while torch.compile traces it (the registered operator).
TRACED_FORWARD = None


class ForwardPlan:
    """What ``forward`` decides for one call signature (shapes, strides, dtype, device, mask, scale, rung), worked
    out once: the path (split-KV or a rung of the ladder), the band and scale as the kernels take them, the launch
    arguments, and on a GPU the autotuner's pick after the first call. Later calls allocate the outputs and launch.

    ``rung`` is the rung the call asked for (None: the fastest that can run, and split-KV for decode); ``note``
    the warning a call repeats when that rung cannot run here. Skip-and-split, the default rung on most inputs, is
    launched here with its autotuner cache and direct relaunch (``scalars``, ``tune``, ``meta``, ``config``,
    ``fast``); any other rung through what its module plans for the signature (``rung_launch``, ``Rung.planned``)."""

    __slots__ = ("copy", "negate", "band", "split", "o_shape", "lse_shape", "grid", "scalars", "tune", "meta")
    __slots__ += ("config", "want_tma", "fast", "fast_state", "rung_launch", "note", "mask", "o_like_q")

    def __init__(self, q, k, v, causal, window, scale, num_splits, rung=None):
        b, hq, nq, d = q.shape
        hk, nk = k.shape[1], k.shape[2]
        self.copy = tuple(x.stride(-1) != 1 for x in (q, k, v))
        # the kernel assumes unit stride along D (16-byte vector loads); other strides are passed through untouched
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if max(nq * q.stride(2), nk * k.stride(2), nk * v.stride(2)) >= 2**31:  # 32-bit row offsets in the kernel
            raise ValueError(
                "sequence too long for this memory layout (row offsets exceed 2**31); pass contiguous tensors"
            )
        q2, offset, win_left, win_right, qk_scale = kernel_args(q, k, v, causal, window, scale)
        self.negate = q2 is not q
        # everything below reads the tensor a launch runs on: -q (which may have other strides than q) when negated
        q = q2
        self.o_like_q = q.is_contiguous()  # o is allocated contiguous: then like q, which is quicker
        self.band = (offset, win_left, win_right, qk_scale)
        self.mask = (causal, window)
        self.o_shape, self.lse_shape = (b, hq, nq, d), (b, hq, nq)
        self.split = None
        self.config = None
        self.fast, self.fast_state = None, "untried"  # direct launches, as in split_kv.LaunchPlan
        self.rung_launch, self.note = None, None
        if num_splits is not None or (rung is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS):  # decode: split-KV
            o = torch.empty(self.o_shape, dtype=q.dtype, device="meta")  # for its strides only
            self.split = split_kv.plan_launch(q, k, v, o, offset, win_left, win_right, qk_scale, num_splits)
            return
        chosen, self.note = ladder.select(rung, q, k, v, causal, window)
        if chosen.name != skip_split.NAME:
            self.rung_launch = chosen.planned(q, k, v, causal, window, self.band)
            return
        # masked short sequences: TMA was erratic there on the H200 (docs/kernel-notes.md)
        self.want_tma = q.is_cuda and skip_split.wants_tma(causal, window, nk)
        strides_o = (hq * nq * d, nq * d, d)  # o is allocated contiguous
        self.scalars = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
        self.scalars += (v.stride(0), v.stride(1), v.stride(2), *strides_o)
        self.scalars += (hq, hq // hk, nq, nk, offset, win_left, win_right, qk_scale)
        # re-tune per power-of-two length and per power-of-two amount of work (B * Hq * Nq query rows), not per shape
        self.tune = skip_split.tune_key(b, hq, nq, nk, causal, window)
        self.meta = skip_split.kernel_meta(q, causal)
        self.grid = (b * hq, nq)  # (query heads, query rows): the first grid dim divides by BLOCK_M at launch


_PLANS: dict = {}  # call signature -> ForwardPlan
MAX_PLANS = 4096  # a decode loop over a growing contiguous cache meets a new length every step: bound the cache


def _plan_key(q, k, v, causal, window, scale, num_splits, rung=None):
    """The call signature a plan (and a passed check) is reused for: everything ``check_inputs`` and ``forward``
    decide from; None where it cannot be hashed exactly, or while torch.compile traces (then nothing is kept)."""
    if type(causal) is not bool or not (scale is None or type(scale) is float or type(scale) is int):
        return None
    if not (rung is None or type(rung) is str) or torch.compiler.is_compiling():
        return None
    if window is not None:
        if type(window) not in (tuple, list) or not all(w is None or type(w) is int for w in window):
            return None
        window = tuple(window)
    if not (q.layout is k.layout is v.layout is torch.strided):  # a sparse tensor has no strides to key on
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, causal, window, scale,
            type(scale), num_splits, k.dtype, v.dtype, k.device, v.device, rung)  # fmt: skip


def forward(q, k, v, causal, window, scale, num_splits=None, config=None, reverse_m=None, use_tma=None, rung=None,
            need_lse=True):  # fmt: skip
    """Run the forward pass on checked inputs; returns ``(o, lse)`` (lse None when ``need_lse`` is False and the
    split-KV path ran: it then writes the lse to scratch memory instead of a new tensor).

    ``num_splits`` and ``rung`` as in ``flash_attention``. The other three are the benchmark's switches for studying
    the kernel (``python -m flashlab.bench --config/--tile-order/--tma``): ``config`` (a dict of BLOCK_M, BLOCK_N,
    num_warps, num_stages) bypasses the autotuner, ``reverse_m`` overrides the causal tile order, ``use_tma`` forces
    TMA loads on or off where they can be used. None leaves each to the kernel's own choice. ``reverse_m`` and
    ``use_tma`` are switches of the skip-and-split rung, which is also the one a ``config`` goes to when no rung is
    named (the backward asks for small query tiles that way).

    The decisions for a call signature are made once (``ForwardPlan``) and reused, so a repeated call (a decode
    step, a layer of a model) pays little more than its kernel launches.
    """
    if config is not None or reverse_m is not None or use_tma is not None:
        return _forward_studied(q, k, v, causal, window, scale, num_splits, config, reverse_m, use_tma, rung)
    if TRACED_FORWARD is not None and torch.compiler.is_compiling():
        return TRACED_FORWARD(q, k, v, causal, window, scale, num_splits, rung)  # one opaque operator (kernels.op)
    key = _plan_key(q, k, v, causal, window, scale, num_splits, rung)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = ForwardPlan(q, k, v, causal, window, scale, num_splits, rung)
        if key is not None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return run_plan(plan, q, k, v, need_lse)


def run_plan(plan: ForwardPlan, q, k, v, need_lse=True):
    """``forward`` for tensors of a planned signature: allocate the outputs and launch."""
    if plan.note is not None:  # the rung asked for cannot run here: said on every call, not only the first
        warnings.warn(plan.note, RuntimeWarning, stacklevel=3)
    if True in plan.copy:
        q, k, v = (x.contiguous() if c else x for x, c in zip((q, k, v), plan.copy, strict=True))
    if plan.negate:
        q = -q
    o = torch.empty_like(q) if plan.o_like_q else torch.empty(plan.o_shape, dtype=q.dtype, device=q.device)
    if plan.split is not None:
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if need_lse else None
        split_kv.run(plan.split, q, k, v, o, lse)
        return o, lse
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if plan.rung_launch is not None:  # a rung other than skip-and-split: its module launches it
        plan.rung_launch(q, k, v, o, lse)
        return o, lse
    if plan.fast_state == "checked" and q.get_device() == current_device_index():  # pointer loads, checked
        plan.fast(current_stream(q.get_device()), q, k, v, o, lse, q, k, v, o)  # the launcher directly
        return o, lse
    descs = skip_split.tma_descriptors(q, k, v, o) if plan.want_tma else None
    args = (q, k, v, o, lse, *(descs if descs else (q, k, v, o)), *plan.scalars, *plan.tune)
    meta = {**plan.meta, "USE_TMA": descs is not None}
    if not q.is_cuda:
        grid = (cdiv(plan.grid[1], CPU_CONFIG["BLOCK_M"]), plan.grid[0])
        with interpreted_language(softmax_step):
            interpreted(skip_split.attn_fwd)[grid](*args, **meta, **CPU_CONFIG)
        return o, lse
    with torch.cuda.device(q.device) if q.device.index != torch.cuda.current_device() else _NO_CONTEXT:
        if plan.config is None or plan.config[0] != meta["USE_TMA"]:  # the autotuner picks, once per tuning key
            bh, nq = plan.grid
            skip_split.attn_fwd_tuned[lambda m: (cdiv(nq, m["BLOCK_M"]), bh)](*args, **meta)
            config = skip_split.attn_fwd_tuned.best_config.all_kwargs()
            plan.config = (meta["USE_TMA"], config, (cdiv(nq, config["BLOCK_M"]), bh))
        else:
            _, config, grid = plan.config
            if descs:
                names = ("desc_q", "desc_k", "desc_v", "desc_o")
                skip_split.set_tma_block_shapes({**dict(zip(names, descs, strict=True)), **config, **meta})
            kernel = skip_split.attn_fwd[grid](*args, **meta, **config)
            if descs is None:
                _try_fast_launch(plan, kernel, grid, args, {**meta, **config}, o, lse)
    return o, lse


PREFILL_TENSORS = ("Q", "K", "V", "O", "LSE", "desc_q", "desc_k", "desc_v", "desc_o")


def _try_fast_launch(plan, kernel, grid, args, kwargs, o, lse):
    """Pointer-load prefill: build a ``FastLaunch`` after a JIT launch, then check it reproduces one, bit for bit."""
    if plan.fast_state == "untried":
        plan.fast = FastLaunch.build(skip_split.attn_fwd, kernel, grid, args, kwargs, PREFILL_TENSORS)
        plan.fast_state = "built" if plan.fast is not None else "off"
    elif plan.fast_state == "built" and not torch.cuda.is_current_stream_capturing():
        q, k, v = args[:3]
        stream = current_stream(q.device.index)
        same = reproduces(lambda o2, lse2: plan.fast(stream, q, k, v, o2, lse2, q, k, v, o2), o, lse)
        plan.fast_state = "checked" if same else "off"


_NO_CONTEXT = contextlib.nullcontext()


def _forward_studied(q, k, v, causal, window, scale, num_splits, config, reverse_m, use_tma, rung=None):
    """``forward`` with the benchmark's switches set: decided afresh on every call."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if max(nq * q.stride(2), nk * k.stride(2), nk * v.stride(2)) >= 2**31:  # row offsets are 32-bit in the kernel
        raise ValueError("sequence too long for this memory layout (row offsets exceed 2**31); pass contiguous tensors")
    q, offset, win_left, win_right, qk_scale = kernel_args(q, k, v, causal, window, scale)
    o = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    split = num_splits is not None or (rung is None and nq <= split_kv.MAX_SPLIT_QUERY_ROWS and config is None)
    if split:  # decode: split-KV
        split_kv.launch(q, k, v, o, lse, offset, win_left, win_right, qk_scale, num_splits)
        return o, lse
    band = (offset, win_left, win_right, qk_scale)
    chosen = ladder.rung_named(skip_split.NAME)  # no rung named: the switches are skip-and-split's
    if rung is not None:
        chosen, note = ladder.select(rung, q, k, v, causal, window)
        if note is not None:
            warnings.warn(note, RuntimeWarning, stacklevel=3)
    if chosen.name == skip_split.NAME:
        skip_split.launch(q, k, v, o, lse, causal, window, band, config=config, reverse_m=reverse_m, use_tma=use_tma)
    elif reverse_m is not None or use_tma is not None:
        raise ValueError(f"reverse_m and use_tma are switches of the skip_split rung, not of rung {chosen.name!r}")
    else:
        chosen.launch(q, k, v, o, lse, causal, window, band, config=config)
    return o, lse


__all__ = [
    "check_dense",
    "check_inputs",
    "check_num_splits",
    "check_scale",
    "flash_attention",
    "launched_q",
    "forward",
    "kernel_args",
]
