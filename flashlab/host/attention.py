"""flashlab's two entry points: ``flash_attention`` and ``flash_attention_with_kvcache``.

Each computes its call signature (``flashlab.host.plan``) and looks its ``Call`` up; the first time a signature
comes, every argument check runs (``flashlab.host.checks``), then its runtime scalars are computed and the plan of
its bucket is looked up or made; then it allocates the outputs and launches (``flashlab.host.launches``). A
differentiable call goes through ``flashlab.host.autograd``; while
torch.compile traces a call, the entry point checks the arguments and calls the registered operator
(``torch.ops.flashlab.*``, ``flashlab.host.custom_ops``), one opaque node of the graph.

On CUDA tensors the kernels are compiled, once per bucket of shapes, with the tile config of
``flashlab.kernels.configs`` (Triton's autotuners only with ``FLASHLAB_AUTOTUNE=1``). On CPU tensors the
very same kernel source runs through Triton's interpreter (one small tile config), so every notebook runs without a
GPU and without the user setting ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import warnings

import torch

from flashlab.host import autograd, fp8
from flashlab.host.checks import (
    DEVICE_CHECK,
    NO_CHECK,
    SYNC_CHECK,
    check_inputs,
    check_kvcache_inputs,
    check_kvcache_values,
    check_num_splits,
    check_ragged_queries,
    check_ragged_values,
    check_rung,
    check_values_flag,
)
from flashlab.host.kvcache_errors import raise_recorded
from flashlab.host.launches import attention_call, family_of, kvcache_plan, run_attention, run_kvcache, unit_stride_d
from flashlab.host.plan import (
    CALLS,
    FAMILIES,
    PLANS,
    kvcache_signature,
    met_before,
    remember,
    remember_call,
    remember_family,
    signature,
)
from flashlab.host.plan import family_key as plan_family_key
from flashlab.kernels import backward as backward_ladder
from flashlab.kernels import ladder
from flashlab.kernels.decode import split_kv
from flashlab.kernels.device import kernel_band, stream_capturing
from flashlab.kernels.ladder import rung2_skip_split as skip_split


def window_to_ints(window) -> tuple[int, int]:
    """``window`` (None or (left, right), None = unbounded) as the two ints of the operators' schema (-1 = None)."""
    if window is None:
        return -1, -1
    left, right = window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def ints_to_window(left: int, right: int):
    """The inverse of ``window_to_ints``: None when both sides are unbounded."""
    if left < 0 and right < 0:
        return None
    return (None if left < 0 else left), (None if right < 0 else right)


def flash_attention(q, k, v, causal=False, window=None, scale=None, return_lse=False, *, num_splits=None, rung=None,
                    backward_rung=None, q_descale=None, k_descale=None, v_descale=None):  # fmt: skip
    """FlashAttention forward: ``softmax(q k^T * scale + mask) v``, never materialising the score matrix.

    q ``(B, Hq, Nq, D)``, k and v ``(B, Hk, Nk, D)`` with Hq a multiple of Hk (grouped-query attention: query head h
    reads K/V head ``h // (Hq // Hk)``, without copying K/V). Any Nq, Nk >= 1; D a multiple of 8 in [16, 256];
    float16, bfloat16 or float32; any strides (a last dim that is not contiguous is copied once).

    ``causal`` and ``window=(left, right)`` follow ``flashlab.core.masking`` (bottom-right aligned). ``scale``
    defaults to ``1/sqrt(D)``. Returns ``o`` (like q), or ``(o, lse)`` with ``return_lse=True``: lse ``(B, Hq, Nq)``
    float32 is the natural log-sum-exp of each row's scaled, masked scores; a row that sees no key gives zeros and
    lse = -inf.

    Decode (at most ``flashlab.kernels.decode.split_kv.MAX_SPLIT_QUERY_ROWS`` query rows) takes the split-KV path
    (Flash-Decoding): the keys are cut into chunks that run in parallel and are merged by their log-sum-exps.
    ``num_splits`` forces that path with this many chunks (at any Nq); ``None`` chooses.

    ``rung`` picks the prefill kernel from the kernel ladder (``flashlab.kernels.ladder.RUNGS``): ``None`` runs the
    rung measured fastest for these inputs on their device -- on a Hopper GPU ``"overlap"`` for 16-bit inputs at
    D = 64, 128 and 256 (any lengths and windows, layouts the copy engine can describe), ``"hopper"`` for other
    16-bit inputs at head dims 65-128 from 1K keys, ``"skip_split"`` otherwise -- (and split-KV for decode, as
    above); a name such as
    ``"lesson_loop"`` or ``"skip_split"`` runs that rung at any Nq (not split-KV, so it cannot be combined with
    ``num_splits``). Where the named rung cannot run here, a ``RuntimeWarning`` names it and the reason, and the
    fastest rung that can run is used. An unknown name is a ValueError listing the rungs.

    Differentiable: when grad is enabled and q, k or v requires grad, backpropagating through ``o`` gives
    gradients for q, k and v from the FlashAttention-2 backward (the probabilities recomputed from q, k and the
    saved lse, nothing of size Nq x Nk stored; deterministic), through a rung of the backward's ladder
    (``flashlab.kernels.backward``): ``backward_rung`` None runs its choice (``"two_pass"``,
    ``flashlab.kernels.backward.rung1_two_pass``, until another rung is measured faster), a name such as ``"hopper"``
    that rung (a ``RuntimeWarning`` and the fastest rung that can run where it cannot). Such calls
    always take the prefill kernel (``num_splits`` is ignored: split-KV has no backward; a ``rung`` is kept, and the
    backward uses the log-sum-exp that rung computed). ``lse`` is not differentiable: a loss that depends on it
    raises an error in the backward pass, compiled (``torch.compile``) or not.

    Must equal ``flashlab.reference.tiled_attention`` (the NumPy tiled loop) and ``flashlab.reference.attention``
    (the float64 definition) to within the input dtype's rounding (``flashlab.core.numerics.TOLERANCE``). CUDA
    tensors run the compiled, autotuned kernel; CPU tensors run the same kernel through Triton's interpreter.

    FP8: q, k and v ``torch.float8_e4m3fn`` with ``q_descale``, ``k_descale``, ``v_descale`` float32 ``(B, Hk)``
    (one scale per sequence and K/V head, q's covering the query heads of that head's group; ``(Hk,)`` for every
    sequence), as ``flashlab.quantize_qkv`` makes them, run the FP8 forward (``flashlab.kernels.fp8_forward``:
    both products on 8-bit operands, P rounded to e4m3) for D = 64, 128 or 256 on sm_89 or later (the interpreter
    on the CPU), and return o in bfloat16. Its numerics are e4m3's, not the input dtype's: the evaluation gate
    (``flashlab.host.quantize.E4M3_TOLERANCE``) bounds its error against float64 of the inputs before
    quantisation. Not differentiable. A scale that is not finite and > 0 is checked on the device, never read on
    the host: its group's output rows come out NaN and the next FP8 call (or ``flashlab.check_kvcache_errors()``)
    raises a ValueError naming it; on the CPU the call itself raises;
    ``num_splits`` and ``rung`` do not apply.
    """
    if q_descale is not None or k_descale is not None or v_descale is not None or (
            isinstance(q, torch.Tensor) and q.dtype == fp8.FP8):  # fmt: skip
        if num_splits is not None or rung is not None or backward_rung is not None:
            raise ValueError("num_splits, rung and backward_rung choose among the 16-bit kernels; the FP8 forward "
                             "takes none of them")  # fmt: skip
        return fp8.fp8_attention(q, k, v, causal, window, scale, return_lse, q_descale, k_descale, v_descale)
    if backward_rung is not None:
        backward_ladder.rung_named(backward_rung)  # an unknown name: a ValueError listing the rungs
    if torch.compiler.is_compiling():  # one opaque operator in the graph; its checks are traced
        check_inputs(q, k, v, causal, window, scale)
        check_num_splits(num_splits, k.shape[2])
        check_rung(rung, num_splits)
        left, right = window_to_ints(window)
        o, lse = torch.ops.flashlab.attention_forward(q, k, v, causal, left, right, scale, num_splits, rung,
                                                      backward_rung)  # fmt: skip
        return (o, lse) if return_lse else o
    key = signature(q, k, v, causal, window, scale, num_splits, rung)
    call = CALLS.get(key)  # a call exists only for a signature that was checked
    if call is None:
        call = new_call(key, q, k, v, causal, window, scale, num_splits, rung)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # differentiable: the prefill kernel (split-KV has no backward), then the backward's ladder
        if call.backward is None:
            call.backward = autograd.differentiable_call(call, q, k, v, causal, window, scale, rung)
        if call.backward.note is not None:  # the rung asked for cannot run here: said on every call
            warnings.warn(call.backward.note, RuntimeWarning, stacklevel=2)
        o, lse = autograd.FlashAttentionFunction.apply(call.backward, q, k, v, causal, window, scale, backward_rung)
    else:
        if call.note is not None:
            warnings.warn(call.note, RuntimeWarning, stacklevel=2)
        o, lse = run_attention(call, q, k, v, return_lse)
    return (o, lse) if return_lse else o


def new_call(key, q, k, v, causal, window, scale, num_splits, rung):
    """The ``Call`` of a signature not in ``CALLS`` (``key``): from its family's (``flashlab.host.plan``'s
    ``family_key``: a decode step against a cache one token longer, or the next chunk of a prefill, is a new
    signature of a known family) where one covers it, kept in ``CALLS`` from the signature's second meeting
    (``met_before``); else ``checked_call``'s, kept, which starts the family anew."""
    family_key = plan_family_key(key, q, k, v)
    family = FAMILIES.get(family_key)
    if family is not None:
        call = family.call(q, k, v, key)
        if call is not None:
            return remember_call(key, call) if met_before(family.met, key[0][2], key[2][2]) else call
    call = remember_call(key, checked_call(q, k, v, causal, window, scale, num_splits, rung))
    if family_key is not None:
        remember_family(family_key, family_of(call, q, k, v, causal, window, scale, num_splits, rung))
    return call


def checked_call(q, k, v, causal, window, scale, num_splits, rung):
    """Check a ``flash_attention`` call's arguments (every new signature: integer checks of a few microseconds),
    then make its call, with its bucket's plan."""
    check_inputs(q, k, v, causal, window, scale)
    check_num_splits(num_splits, k.shape[2])
    check_rung(rung, num_splits)
    return attention_call(q, k, v, causal, window, scale, num_splits, rung)


def forward(q, k, v, causal, window, scale, num_splits=None, config=None, reverse_m=None, use_tma=None, rung=None,
            need_lse=True):  # fmt: skip
    """Run the forward pass on checked inputs (no autograd); returns ``(o, lse)`` (lse None when ``need_lse`` is
    False and the split-KV path ran: it then writes the lse to scratch memory instead of a new tensor).

    ``num_splits`` and ``rung`` as in ``flash_attention``. The other three are the benchmark's switches for studying
    the kernel (``python -m flashlab.bench --config/--tile-order/--tma``): ``config`` (a dict of BLOCK_M, BLOCK_N,
    num_warps, num_stages) bypasses the autotuner, ``reverse_m`` overrides the causal tile order, ``use_tma`` forces
    TMA loads on or off where they can be used. None leaves each to the kernel's own choice. ``reverse_m`` and
    ``use_tma`` are switches of the skip-and-split rung, which is also the one a ``config`` goes to when no rung is
    named. With a switch set the call is decided afresh (plain launches); without, it runs its signature's call.
    """
    if config is not None or reverse_m is not None or use_tma is not None:
        return _forward_studied(q, k, v, causal, window, scale, num_splits, config, reverse_m, use_tma, rung)
    key = signature(q, k, v, causal, window, scale, num_splits, rung)
    call = CALLS.get(key)
    if call is None:
        call = remember_call(key, checked_call(q, k, v, causal, window, scale, num_splits, rung))
    if call.note is not None:
        warnings.warn(call.note, RuntimeWarning, stacklevel=2)
    return run_attention(call, q, k, v, need_lse)


def _forward_studied(q, k, v, causal, window, scale, num_splits, config, reverse_m, use_tma, rung=None):
    """``forward`` with the benchmark's switches set: decided afresh on every call, plain launches."""
    b, hq, nq, d = q.shape
    q, k, v = unit_stride_d(q, k, v)
    offset, win_left, win_right, qk_scale, negate = kernel_band(nq, k.shape[2], d, causal, window, scale)
    if negate:
        q = -q
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


def flash_attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table=None,
    causal=False,
    window=None,
    scale=None,
    return_lse=False,
    *,
    check_values=True,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    k_descale=None,
    v_descale=None,
):
    """Attention of new queries against a KV cache with per-sequence lengths, paged or not.

    q ``(B, Hq, Nq, D)`` (flashlab's layout: the Nq newest positions of each sequence, Nq = 1 for a decode step,
    up to a few hundred for a chunk of prefill). The cache, in the layout serving engines use:

    - with ``block_table`` ``(B, max_blocks)`` int32: ``k_cache``, ``v_cache`` ``(num_blocks, block_size, Hk, D)``;
      key j of sequence b is in block ``block_table[b, j // block_size]``, slot ``j % block_size``. Any block size
      that is a multiple of 16; blocks in any order, shared between sequences; entries past a sequence's last
      block are never read (they may hold anything, e.g. -1).
    - without: ``k_cache``, ``v_cache`` ``(B, Nk_max, Hk, D)``, sequence b in its own slab.

    ``cache_seqlens`` ``(B,)`` int32: the keys each sequence holds (its Nq newest included). ``causal`` and
    ``window`` follow ``flashlab.core.masking``, aligned to each sequence's own end: query i sees key j when
    ``seqlen_b - Nq + i - left <= j <= seqlen_b - Nq + i + right``. A sequence of length 0 gives zeros (lse -inf).
    Returns ``o`` like q, or ``(o, lse)`` with lse ``(B, Hq, Nq)`` float32 natural log-sum-exps.

    An 8-bit cache: ``k_cache``, ``v_cache`` ``torch.float8_e4m3fn`` (q float16 or bfloat16), with ``k_descale``,
    ``v_descale`` float32 ``(B, Hk)``, one scale per sequence and K/V head (``(Hk,)`` is read as the same scale for
    every sequence): key j of sequence b, head h is ``k_cache[...] * k_descale[b, h]``, as ``flashlab.quantize_kv``
    makes them. The kernel reads the 8-bit tiles (half the bytes of a 16-bit cache) and widens them as it goes. A
    scale that is not finite and > 0 is a bad value like a bad length (below): NaN rows for that sequence's heads
    that read it, reported as ``check_values`` says.

    A length outside ``[0, capacity]`` or a used block-table entry outside the pool is never followed: the kernel
    reads nothing outside the pool and gives NaN in every output row of that sequence (its lse is then not
    meaningful). ``check_values`` says how such a value is reported, as a ValueError naming it:

    - ``True`` (the default): the kernel checks the values as it reads them and records the first bad one where
      the host reads it without waiting for the GPU. On a GPU the error is raised by the first later call on the
      same device that begins after the faulty launch has finished (in a decode loop whose host runs ahead of the
      GPU, a later step), or at once by ``flashlab.check_kvcache_errors()``, which waits for the GPU; on the CPU
      it is raised by the call itself. No synchronisation, so a decode loop never stalls on it; a launch replayed
      from a CUDA graph records its errors the same way.
    - ``"sync"``: the lengths and the table are read on the host before the launch, so the same call raises; on a
      GPU that costs one synchronisation per call, which stalls a decode loop.
    - ``False``: nothing is reported (the NaN rows stay the only sign; an error recorded earlier waits for the
      next call that checks).

    Mixed batches (some sequences' prefill chunks, others' single decode rows, in one launch): with
    ``cu_seqlens_q`` (int32 ``(B + 1,)`` on q's device) q is packed ``(total_q, Hq, D)``, sequence b's rows being
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``, its newest positions (a sequence may have none); o comes back
    ``(total_q, Hq, D)`` and lse ``(Hq, total_q)``, and the masks align to each sequence's own end as above, with
    its own row count for Nq. ``max_seqlen_q``, the most rows a sequence has, sizes the launch. The offsets are
    read on the host (one synchronisation on a GPU) unless ``check_values`` is False and ``max_seqlen_q`` is
    given, and a ValueError names any that do not start at 0, decrease, end at total_q, or give a sequence more
    rows than its cache holds keys. Inside CUDA-graph capture the host cannot read them: pass ``max_seqlen_q``.
    """
    if torch.compiler.is_compiling():  # the values are checked inside the operator, when it runs
        mode = check_values_flag(check_values)
        check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, cu_seqlens_q,
                             max_seqlen_q, k_descale, v_descale)  # fmt: skip
        left, right = window_to_ints(window)
        o, lse = torch.ops.flashlab.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal,
                                                           left, right, scale, mode != NO_CHECK,
                                                           mode == SYNC_CHECK, cu_seqlens_q,
                                                           max_seqlen_q, k_descale, v_descale)  # fmt: skip
        return (o, lse) if return_lse else o
    o, lse = kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, check_values,
                               return_lse, cu_seqlens_q, max_seqlen_q, k_descale, v_descale)  # fmt: skip
    return (o, lse) if return_lse else o


def check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, cu_seqlens_q,
                         max_seqlen_q, k_descale=None, v_descale=None):  # fmt: skip
    """``check_kvcache_inputs`` for q as it comes: ``(B, Hq, Nq, D)``, or packed ``(total_q, Hq, D)`` with
    ``cu_seqlens_q`` (its shapes checked by ``check_ragged_queries``). Returns ``(checked, b)``: what
    ``check_kvcache_inputs`` returns, and B for a packed q (else None)."""
    if cu_seqlens_q is None:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q sizes a packed q: pass it with cu_seqlens_q")
        checked = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale,
                                       k_descale, v_descale)  # fmt: skip
        return checked, None
    b = check_ragged_queries(q, cu_seqlens_q, max_seqlen_q)
    per_sequence = q[:1].unsqueeze(2).expand(b, -1, max_seqlen_q or 1, -1)  # (B, Hq, Nq, D): a view, for the checks
    checked = check_kvcache_inputs(per_sequence, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale,
                                   k_descale, v_descale)  # fmt: skip
    return checked, b


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, check_values,
                      need_lse=True, cu_seqlens_q=None, max_seqlen_q=None, k_descale=None,
                      v_descale=None):  # fmt: skip
    """``flash_attention_with_kvcache`` in eager mode: ``(o, lse)`` (lse None unless ``need_lse``). The shapes are
    checked when the signature is planned. The values, as ``check_values`` asks: the device's error record is read
    first (a plain memory read) and raises what an earlier launch met; with "sync" the host reads the lengths,
    the table and an 8-bit cache's descales (except while a CUDA graph is being captured, where the host cannot
    read device memory); on the CPU the record is read again after the launch, which the interpreter has run to
    its end.

    A packed q (``cu_seqlens_q``) has its shapes checked on every call and its offsets read on the host
    (``check_ragged_values``) unless ``check_values`` is False and ``max_seqlen_q`` is given; its plan is keyed by
    total_q and max_seqlen_q (what the grid and the scratch are cut for)."""
    mode = DEVICE_CHECK if check_values is True else check_values_flag(check_values)
    ragged = None
    if cu_seqlens_q is not None:
        checked, b = check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale,
                                          cu_seqlens_q, max_seqlen_q, k_descale, v_descale)  # fmt: skip
        if mode is not NO_CHECK or max_seqlen_q is None:
            if q.is_cuda and stream_capturing():
                if max_seqlen_q is None:
                    raise ValueError("the host cannot read cu_seqlens_q while a CUDA graph is captured: pass "
                                     "max_seqlen_q")  # fmt: skip
            else:
                max_seqlen_q = check_ragged_values(cu_seqlens_q, cache_seqlens, q.shape[0], max_seqlen_q)
        ragged = (b, max_seqlen_q)
    key = kvcache_signature(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, cu_seqlens_q,
                            max_seqlen_q, k_descale, v_descale)  # fmt: skip
    descales = None if k_descale is None and v_descale is None else (k_descale, v_descale)
    plan = PLANS.get(key)  # a plan exists only for a signature whose shapes passed
    if plan is None:
        if ragged is None:
            checked, _ = check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale,
                                              None, max_seqlen_q, k_descale, v_descale)  # fmt: skip
        plan = remember(key, kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale,
                                          checked, ragged, descales))  # fmt: skip
    capacity, pages, page_size, record, unreported = plan.extra
    if mode is NO_CHECK:
        record = unreported
    else:
        if record.holds_error() and not (q.is_cuda and stream_capturing()):  # an earlier launch met a bad value
            raise_recorded(record, earlier=True)
        if mode is SYNC_CHECK and not (q.is_cuda and stream_capturing()):
            check_kvcache_values(cache_seqlens, block_table, capacity, pages, page_size, k_descale, v_descale)
    o, lse = run_kvcache(plan, q, k_cache, v_cache, cache_seqlens, block_table, need_lse, record.tensor, cu_seqlens_q,
                         descales)  # fmt: skip
    if not q.is_cuda and mode is not NO_CHECK:  # the interpreter has finished: this call's own error
        raise_recorded(record, earlier=False)
    return o, lse


__all__ = ["check_kvcache_shapes", "flash_attention", "flash_attention_with_kvcache", "forward", "ints_to_window",
           "kvcache_attention", "window_to_ints"]  # fmt: skip
