"""An 8-bit KV cache: keys and values stored as float8 e4m3 with one float32 scale per (sequence, K/V head).

Decode reads the whole cache every step and does little arithmetic on it, so its time is the cache's bytes over
the memory bandwidth; one byte an element instead of two halves it. e4m3 (4 exponent bits, 3 mantissa bits, no
infinity) holds magnitudes up to ``E4M3_MAX`` = 448 with a relative step of 2^-3 between neighbours, so each
(sequence, head) gets its own scale: the stored value is ``x / scale`` rounded to e4m3, with ``scale = amax / 448``
(amax the largest ``|x|`` of that head's keys, or values, over the sequence's tokens), so the largest element
lands on e4m3's largest finite value and the rest keep as many of its 3 bits as they can.

- ``quantize_kv(k, v, block_table=None, cache_seqlens=None)``: ``(k8, v8, k_descale, v_descale)``, the cache in
  the layout ``flashlab.flash_attention_with_kvcache`` takes (contiguous ``(B, N, Hk, D)``, or a pool of blocks
  ``(num_blocks, block_size, Hk, D)`` with a block table), the scales ``(B, Hk)`` float32.
- ``dequantize_kv(k8, v8, k_descale, v_descale, block_table=None)``: the keys and values the 8-bit cache stands
  for, in float64, exactly as the kernel reads them (``k8 * k_descale``): what the float64 reference is run on.

A block shared by several sequences (a common prompt prefix) is stored once, so it has one scale: sequences that
share blocks share their scale (the largest of their amaxes). A zero amax (a head of zeros) takes scale 1, never 0:
the kernel refuses a scale that is not finite and > 0.
"""

from __future__ import annotations

import torch

from flashlab.host.checks import check_dense
from flashlab.kernels.device import DTYPES

FP8 = torch.float8_e4m3fn  # the 8-bit cache's dtype
E4M3_MAX = 448.0  # e4m3's largest finite value: 1.75 * 2^8 (torch.finfo(torch.float8_e4m3fn).max)
E4M3_MANTISSA_BITS = 3  # neighbouring e4m3 values differ by 2^-3 of their magnitude (in the normal range)
# The evaluation gate of an 8-bit cache: the relative error ||o - ref|| / ||ref|| its attention output may have
# against the float64 reference of the keys and values before quantisation. Rounding to e4m3 moves an element by
# at most half a step, 2^-(3 + 1) = 6.25% of it (about 2.6% RMS, measured); the softmax-weighted sum averages the
# values' errors, and the keys' errors move each score by about 2.6% of it. On scores of ordinary spread the output
# lands near 4% (notebook 08); keys with outlier channels spread the scores over tens, that same relative error in
# the exponent moves the softmax's weights by tens of percent, and the gate refuses them.
E4M3_TOLERANCE = 2.0 ** -(E4M3_MANTISSA_BITS + 1)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The descale of each amax: ``amax / 448`` (float32), 1 where amax is 0."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to the nearest e4m3 value (``scale`` broadcasts against x), clamped to +-448 first:
    torch's conversion gives NaN, not the largest value, past e4m3's range."""
    return (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def check_quantisable(name: str, x, taker: str, layout: str = "", holder: str = "an 8-bit cache") -> None:
    """A tensor a quantiser (``taker``, e.g. "quantize_kv") may round to e4m3: dense, 4-d (``layout`` names the
    dims in the message), 16- or 32-bit, finite (``holder``: what has no scale for NaN or inf); else a TypeError or
    ValueError naming ``name``."""
    check_dense(name, x)
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dims{layout}; got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; {taker} takes float16, bfloat16 or float32")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or inf: {holder} has no scale that keeps them")


def _lengths(cache_seqlens, b: int, capacity: int, device) -> torch.Tensor:
    """The lengths as int64 ``(B,)``: ``cache_seqlens``, checked to lie in ``[0, capacity]``, or capacity each."""
    if cache_seqlens is None:
        return torch.full((b,), capacity, dtype=torch.int64, device=device)
    check_dense("cache_seqlens", cache_seqlens)
    if cache_seqlens.shape != (b,):
        raise ValueError(f"cache_seqlens must be ({b},); got shape {tuple(cache_seqlens.shape)}")
    lengths = cache_seqlens.to(device=device, dtype=torch.int64)
    if bool(((lengths < 0) | (lengths > capacity)).any()):
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}]; got {cache_seqlens.tolist()}")
    return lengths


def quantize_kv(k, v, *, block_table=None, cache_seqlens=None):
    """``(k8, v8, k_descale, v_descale)``: keys and values as float8 e4m3 and their float32 descales ``(B, Hk)``,
    ``k ~ k8 * k_descale[b, h]`` for every token of sequence b, head h.

    Without ``block_table``, k and v are ``(B, N, Hk, D)``, one slab per sequence; with it (int32 ``(B,
    max_blocks)``), a pool ``(num_blocks, block_size, Hk, D)`` and sequence b's blocks are its row's entries. The
    scale of (b, h) is ``amax / 448`` over the tokens sequence b holds: its first ``cache_seqlens[b]`` (default:
    all of its slab, or every block its row lists), then, where sequences share a block, the largest over the
    sequences that share blocks with each other. Tokens past a sequence's length are stored with its scale
    (clamped); blocks no sequence uses are stored as zeros. Reads the inputs on the host (a synchronisation on a
    GPU): a step that prepares a cache, not one inside the decode loop."""
    check_quantisable("k", k, "quantize_kv")
    check_quantisable("v", v, "quantize_kv")
    if k.shape != v.shape or k.device != v.device:
        raise ValueError(f"k and v must have the same shape and device; got {tuple(k.shape)}, {tuple(v.shape)}")
    if block_table is None:
        b, n, hk, d = k.shape
        lengths = _lengths(cache_seqlens, b, n, k.device)
        held = torch.arange(n, device=k.device)[None, :] < lengths[:, None]  # (B, N)

        def amax(x):  # (B, Hk)
            return (x.abs().to(torch.float32) * held[:, :, None, None]).amax(dim=(1, 3))

        k_descale, v_descale = scales_from_amax(amax(k)), scales_from_amax(amax(v))
        k8 = to_e4m3(k, k_descale[:, None, :, None])
        v8 = to_e4m3(v, v_descale[:, None, :, None])
        return k8, v8, k_descale, v_descale
    return _quantize_paged(k, v, block_table, cache_seqlens)


def _quantize_paged(k, v, block_table, cache_seqlens):
    check_dense("block_table", block_table)
    if block_table.ndim != 2 or block_table.dtype != torch.int32:
        got = f"{block_table.dtype} {tuple(block_table.shape)}"
        raise ValueError(f"block_table must be int32 (B, max_blocks); got {got}")
    if block_table.device != k.device:
        raise ValueError(f"block_table must be on the cache's device ({k.device}); got {block_table.device}")
    pages, bs, hk, d = k.shape
    b, max_blocks = block_table.shape
    lengths = _lengths(cache_seqlens, b, max_blocks * bs, k.device)
    used = torch.arange(max_blocks, device=k.device)[None, :] < (lengths[:, None] + bs - 1) // bs  # (B, max_blocks)
    table = block_table.long()
    if bool((used & ((table < 0) | (table >= pages))).any()):
        bad = (used & ((table < 0) | (table >= pages))).nonzero()[0].tolist()
        raise ValueError(f"block_table[{bad[0]}, {bad[1]}] = {int(table[bad[0], bad[1]])} is not a block of the "
                         f"cache (0 <= entry < {pages})")  # fmt: skip
    table = torch.where(used, table, 0)
    slots = torch.arange(max_blocks * bs, device=k.device).view(max_blocks, bs)
    held = slots[None] < lengths[:, None, None]  # (B, max_blocks, bs): the tokens each sequence holds

    def scales(x):
        amax = (x[table].abs().to(torch.float32) * held[..., None, None]).amax(dim=(1, 2, 4))  # (B, Hk)
        # sequences that share a block share its scale: spread the largest amax along shared blocks until it stops
        # changing (at most once per sequence of a chain of sharing)
        for _ in range(b):
            block_amax = torch.zeros(pages, hk, device=x.device)  # (num_blocks, Hk)
            index = table[used]  # (used entries,)
            src = amax[:, None, :].expand(b, max_blocks, hk)[used]  # (used entries, Hk)
            block_amax.scatter_reduce_(0, index[:, None].expand(-1, hk), src, "amax")
            spread = torch.where(used[..., None], block_amax[table], 0).amax(dim=1)  # (B, Hk)
            if torch.equal(spread, amax):
                break
            amax = spread
        descale = scales_from_amax(amax)
        block_scale = torch.ones(pages, hk, device=x.device)
        block_scale[table[used]] = descale[:, None, :].expand(b, max_blocks, hk)[used]
        unused = torch.ones(pages, dtype=torch.bool, device=x.device)
        unused[table[used]] = False
        x = torch.where(unused[:, None, None, None], 0.0, x.to(torch.float32))  # (num_blocks, bs, Hk, D)
        return to_e4m3(x, block_scale[:, None, :, None]), descale

    (k8, k_descale), (v8, v_descale) = scales(k), scales(v)
    return k8, v8, k_descale, v_descale


def dequantize_kv(k8, v8, k_descale, v_descale, *, block_table=None):
    """The keys and values an 8-bit cache stands for, in float64, as the kernel reads them: ``k8 * k_descale``.

    Without ``block_table``, ``(B, N, Hk, D)`` like the cache. With it, each sequence's blocks gathered in order
    into ``(B, max_blocks * block_size, Hk, D)`` (a contiguous cache of the same keys), each with that sequence's
    scale; entries outside the pool give zeros. ``k_descale``, ``v_descale`` ``(B, Hk)`` or ``(Hk,)``."""

    def widen(x8, descale):
        descale = descale.to(torch.float64)
        if block_table is None:
            x = x8.to(torch.float64)  # (B, N, Hk, D)
        else:
            pages = x8.shape[0]
            table = block_table.long()
            ok = (table >= 0) & (table < pages)  # (B, max_blocks)
            x = x8.to(torch.float64)[torch.where(ok, table, 0)] * ok[..., None, None, None]  # (B, mb, bs, Hk, D)
            x = x.flatten(1, 2)  # (B, max_blocks * bs, Hk, D)
        return x * (descale[:, None, :, None] if descale.ndim == 2 else descale[None, None, :, None])

    return widen(k8, k_descale), widen(v8, v_descale)


__all__ = ["E4M3_MANTISSA_BITS", "E4M3_MAX", "E4M3_TOLERANCE", "FP8", "check_quantisable", "dequantize_kv",
           "quantize_kv", "scales_from_amax", "to_e4m3"]  # fmt: skip
