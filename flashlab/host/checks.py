"""Every argument check of flashlab's two entry points, written once: a bad argument is a TypeError or ValueError
naming it, never a wrong answer.

- ``check_inputs``: ``flash_attention``'s q, k, v, mask and scale; ``check_num_splits``, ``check_rung``.
- ``check_kvcache_inputs``: ``flash_attention_with_kvcache``'s shapes, dtypes, devices, layouts, mask and scale
  (and an 8-bit cache's descales, ``check_descales``); ``check_values_flag``: its ``check_values`` argument;
  ``check_kvcache_values``: the values of its lengths, block table and descales read on the host
  (``check_values="sync"``: one synchronisation on a GPU; the default checks them on the device instead,
  ``flashlab.host.kvcache_errors``).
- ``check_dense``, ``check_scale``, ``check_head_dim``: the checks both share.

Everything ``check_inputs`` and ``check_kvcache_inputs`` look at is a function of the call signature (shapes,
strides, dtypes, devices, mask, scale), so the host engine runs them once per signature, when it plans it
(``flashlab.host.plan``); only the values of the lengths and the block table are checked on every call that asks.
"""

from __future__ import annotations

import numbers

import torch

from flashlab.core.checks import as_real
from flashlab.core.masking import visible_band
from flashlab.core.shapes import attention_shape
from flashlab.host.kvcache_errors import entry_message, length_message, scale_message
from flashlab.kernels import ladder
from flashlab.kernels.decode.kvcache import BLOCK_SIZE_MULTIPLE
from flashlab.kernels.decode.split_kv import MAX_SPLITS
from flashlab.kernels.device import DTYPES, HEAD_DIM_MULTIPLE, LOG2_E, MAX_HEAD_DIM, MIN_HEAD_DIM

MAX_FLOAT32 = 3.4028234663852886e38  # the largest finite float32: qk_scale = scale * log2(e) must stay below it
# An 8-bit KV cache's dtype (flashlab.host.quantize), and the query dtypes it goes with: its tiles are widened to
# q's 16-bit dtype for the dots
KV_8BIT = torch.float8_e4m3fn
KV_8BIT_QUERY_DTYPES = (torch.float16, torch.bfloat16)


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


def check_head_dim(d: int) -> None:
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(
            f"head dim {d} is not supported: it must be a multiple of {HEAD_DIM_MULTIPLE} "
            f"between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}"
        )


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")


def check_inputs(q, k, v, causal, window, scale):
    """Validate the arguments of an attention call; returns ``(shape, band)`` (``flashlab.core.shapes``,
    ``flashlab.core.masking.visible_band``)."""
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
    check_head_dim(shape.d)
    check_causal(causal)
    band = visible_band(shape.nq, shape.nk, causal, window)  # ValueError for a malformed window; any int side
    check_scale(scale)
    return shape, band


def check_num_splits(num_splits, nk: int) -> None:
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None; got {type(num_splits).__name__}")
    most = min(nk, MAX_SPLITS)
    if not 1 <= num_splits <= most:
        raise ValueError(f"num_splits must be between 1 and min(Nk, {MAX_SPLITS}) = {most}; got {num_splits}")


def check_rung(rung, num_splits) -> None:
    """An unknown rung name is a ValueError listing the rungs (``flashlab.kernels.ladder``), a rung with
    ``num_splits`` a ValueError (they choose different kernels)."""
    if rung is None:
        return
    ladder.rung_named(rung)
    if num_splits is not None:
        raise ValueError(
            f"num_splits chooses the split-KV path and rung={rung!r} a prefill kernel of the ladder; pass one"
        )


def check_descales(k_cache, v_cache, k_descale, v_descale, b: int, device) -> None:
    """An 8-bit cache (float8 e4m3) takes both descales, float32 ``(B, Hk)`` or ``(Hk,)`` on q's device; a 16-bit
    or fp32 cache takes neither. Their values are not read here (``check_kvcache_values``)."""
    if k_cache.dtype != KV_8BIT:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale and v_descale scale an 8-bit ({KV_8BIT}) cache; this cache is "
                             f"{k_cache.dtype}: pass neither")  # fmt: skip
        return
    hk = k_cache.shape[2]
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            raise ValueError(f"an 8-bit ({KV_8BIT}) cache needs k_descale and v_descale (float32 (B, Hk), as "
                             f"flashlab.quantize_kv returns them); {name} is missing")  # fmt: skip
        check_dense(name, x)
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32; got {x.dtype}")
        if tuple(x.shape) not in ((b, hk), (hk,)):
            raise ValueError(f"{name} must be (B, Hk) = ({b}, {hk}) or (Hk,) = ({hk},); got shape {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} must be on q's device ({device}); got {x.device}")


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, causal, window, scale, k_descale=None,
                         v_descale=None):  # fmt: skip
    """Validate the shapes, dtypes, devices and layouts of a ``flash_attention_with_kvcache`` call and its mask and
    scale (and an 8-bit cache's descales); returns ``(capacity, pages, page_size)``: the most keys a sequence can
    hold, the cache's blocks and their size (0 without a block table)."""
    for name, x, ndim in (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("cache_seqlens",
                          cache_seqlens, 1)):  # fmt: skip
        check_dense(name, x)
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dims; got shape {tuple(x.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16 and float32")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype not in DTYPES and x.dtype != KV_8BIT:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16 and float32 (q's dtype), or "
                            f"{KV_8BIT} (an 8-bit cache, with k_descale and v_descale)")  # fmt: skip
    if KV_8BIT in (k_cache.dtype, v_cache.dtype):
        if not k_cache.dtype == v_cache.dtype == KV_8BIT or q.dtype not in KV_8BIT_QUERY_DTYPES:
            dtypes = f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
            raise TypeError(f"an 8-bit cache holds both k_cache and v_cache as {KV_8BIT}, with q float16 or "
                            f"bfloat16; got q, k_cache, v_cache {dtypes}")  # fmt: skip
    elif not q.dtype == k_cache.dtype == v_cache.dtype:
        dtypes = f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        raise TypeError(f"q, k_cache and v_cache must have the same dtype; got {dtypes}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32; got {cache_seqlens.dtype}")
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)]
    if block_table is not None:
        check_dense("block_table", block_table)
        if block_table.ndim != 2:
            raise ValueError(f"block_table must have 2 dims; got shape {tuple(block_table.shape)}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32; got {block_table.dtype}")
        tensors.append(("block_table", block_table))
    for name, x in tensors:
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {x.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"runs on CUDA (compiled) or CPU (interpreted) tensors; got {q.device}")
    if q.numel() == 0:
        raise ValueError(f"q is empty (shape {tuple(q.shape)}); every dim must be at least 1")
    b, hq, nq, d = q.shape
    if k_cache.shape != v_cache.shape:
        shapes = f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        raise ValueError(f"k_cache and v_cache must have the same shape; got {shapes}")
    pages, page_size, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"the cache's head dim ({dk}) must equal q's ({d})")
    check_head_dim(d)
    if hk < 1 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's key/value heads ({hk})")
    if cache_seqlens.shape[0] != b:
        got = tuple(cache_seqlens.shape)
        raise ValueError(f"cache_seqlens must have one length per sequence ({b}); got shape {got}")
    if block_table is None:
        if pages != b:
            raise ValueError(
                f"without a block table the cache is (B, Nk_max, Hk, D) with B = {b}; got shape {tuple(k_cache.shape)}"
            )
        capacity = page_size
    else:
        if block_table.shape[0] != b or block_table.shape[1] < 1:
            raise ValueError(f"block_table must be (B={b}, max_blocks >= 1); got shape {tuple(block_table.shape)}")
        if page_size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"the cache's block size ({page_size}) must be a multiple of {BLOCK_SIZE_MULTIPLE}")
        capacity = block_table.shape[1] * page_size
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its head dim (it is never copied); got {x.stride()}")
        if capacity * x.stride(1) >= 2**31 and block_table is None:
            raise ValueError(f"{name} is too long for 32-bit key offsets; use a block table")
    check_descales(k_cache, v_cache, k_descale, v_descale, b, q.device)
    check_causal(causal)
    visible_band(nq, capacity, causal, window)  # ValueError for a malformed window
    check_scale(scale)
    return capacity, pages, (page_size if block_table is not None else 0)


def check_ragged_queries(q, cu_seqlens_q, max_seqlen_q) -> int:
    """Validate a ragged ``flash_attention_with_kvcache`` call's packed q ``(total_q, Hq, D)``, its ``cu_seqlens_q``
    (int32 ``(B + 1,)`` on q's device) and ``max_seqlen_q`` (None or an int >= 1), as far as their shapes go;
    returns B. The offsets' values are ``check_ragged_values``'."""
    check_dense("q", q)
    check_dense("cu_seqlens_q", cu_seqlens_q)
    if q.ndim != 3:
        raise ValueError(f"with cu_seqlens_q, q is packed as (total_q, Hq, D) and must have 3 dims; got shape "
                         f"{tuple(q.shape)}")  # fmt: skip
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_q must be int32; got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must be (B + 1,) with B >= 1; got shape {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q must be on q's device ({q.device}); got {cu_seqlens_q.device}")
    if q.shape[0] == 0:
        raise ValueError(f"q has no query rows (shape {tuple(q.shape)}); a packed q needs at least one")
    if max_seqlen_q is not None and (type(max_seqlen_q) is not int or max_seqlen_q < 1):
        raise ValueError(f"max_seqlen_q must be None or an int >= 1; got {max_seqlen_q!r}")
    return cu_seqlens_q.shape[0] - 1


def check_ragged_values(cu_seqlens_q, cache_seqlens, total_q: int, max_seqlen_q) -> int:
    """Read ``cu_seqlens_q`` and ``cache_seqlens`` on the host (one synchronisation on a GPU) and raise a
    ValueError unless the offsets start at 0, never decrease, end at ``total_q``, give no sequence more query rows
    than its cache holds keys, and none more than ``max_seqlen_q`` (if given). Returns ``max_seqlen_q``, or where
    it is None the most query rows a sequence has (at least 1)."""
    b = cache_seqlens.shape[0]
    values = torch.cat([cu_seqlens_q, cache_seqlens]).tolist()  # one transfer
    cu, lengths = values[: b + 1], values[b + 1 :]
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0; got cu_seqlens_q[0] = {cu[0]}")
    rows = [cu[i + 1] - cu[i] for i in range(b)]
    for i, n in enumerate(rows):
        if n < 0:
            raise ValueError(f"cu_seqlens_q must not decrease; got cu_seqlens_q[{i}] = {cu[i]} > "
                             f"cu_seqlens_q[{i + 1}] = {cu[i + 1]}")  # fmt: skip
    if cu[-1] != total_q:
        raise ValueError(f"cu_seqlens_q's last entry ({cu[-1]}) must equal q's rows, total_q = {total_q}")
    for i, (n, length) in enumerate(zip(rows, lengths, strict=True)):
        if n > length:
            raise ValueError(f"sequence {i} has {n} query rows but cache_seqlens[{i}] = {length}: its query rows are "
                             "its newest positions, so its cache must hold at least as many keys")  # fmt: skip
    longest = max(max(rows), 1)
    if max_seqlen_q is not None and max_seqlen_q < longest:
        raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is less than the longest sequence's query rows ({longest})")
    return longest if max_seqlen_q is None else max_seqlen_q


def check_kvcache_values(cache_seqlens, block_table, capacity: int, pages: int, page_size: int, k_descale=None,
                         v_descale=None) -> None:  # fmt: skip
    """A ValueError for a length outside ``[0, capacity]``, a used block-table entry outside the pool or a descale
    that is not finite and > 0, read on the host: one synchronisation on a GPU (``check_values="sync"``)."""
    bad_len = (cache_seqlens < 0) | (cache_seqlens > capacity)  # (B,)
    bad_len_any = bad_len.any()
    if block_table is None:
        bad_entry = torch.zeros_like(bad_len_any)
    else:
        used = (
            torch.arange(block_table.shape[1], device=block_table.device)[None, :]
            < ((cache_seqlens.clamp(min=0, max=capacity) + page_size - 1) // page_size)[:, None]
        )  # (B, max_blocks): the entries a sequence's keys live in
        bad_entry = (((block_table < 0) | (block_table >= pages)) & used).any()
    descales = [(n, x) for n, x in (("k_descale", k_descale), ("v_descale", v_descale)) if x is not None]
    bad_scales = [~(torch.isfinite(x) & (x > 0)) for _, x in descales]
    flags = torch.stack([bad_len_any, bad_entry, *(bad.any() for bad in bad_scales)]).tolist()  # one sync on a GPU
    if flags[0]:
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(length_message(b, int(cache_seqlens[b]), capacity))
    if flags[1]:
        b, j = (int(x) for x in (((block_table < 0) | (block_table >= pages)) & used).nonzero()[0])
        raise ValueError(entry_message(b, j, int(block_table[b, j]), pages))
    for (name, x), bad, flag in zip(descales, bad_scales, flags[2:], strict=True):
        if flag:
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(scale_message(name, index, float(x[index])))


# check_values' three ways: on the device without a synchronisation, on the host (synchronously), not at all
DEVICE_CHECK, SYNC_CHECK, NO_CHECK = "device", "sync", "off"


def check_values_flag(check_values) -> str:
    """``check_values`` as one of ``DEVICE_CHECK`` (True), ``SYNC_CHECK`` ("sync") and ``NO_CHECK`` (False); a
    TypeError for any other type, a ValueError for any other string."""
    if check_values is True:
        return DEVICE_CHECK
    if check_values is False:
        return NO_CHECK
    if isinstance(check_values, str):
        if check_values == SYNC_CHECK:
            return SYNC_CHECK
        raise ValueError(f'check_values must be True, False or "sync"; got {check_values!r}')
    raise TypeError(f'check_values must be True, False or "sync"; got {check_values!r}')


__all__ = [
    "DEVICE_CHECK",
    "KV_8BIT",
    "KV_8BIT_QUERY_DTYPES",
    "MAX_FLOAT32",
    "NO_CHECK",
    "SYNC_CHECK",
    "check_causal",
    "check_dense",
    "check_descales",
    "check_head_dim",
    "check_inputs",
    "check_kvcache_inputs",
    "check_kvcache_values",
    "check_num_splits",
    "check_ragged_queries",
    "check_ragged_values",
    "check_rung",
    "check_scale",
    "check_values_flag",
]
