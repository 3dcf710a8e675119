"""The backends timed side by side: naive materialised attention, flashlab's kernel, each rung of flashlab's kernel
ladder (``flashlab_<rung>``, run when named), each rung of its backward's ladder (``backward_<rung>``, run
when named) and each PyTorch SDPA backend pinned explicitly; and the float64 reference rows every backend is
checked against."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashlab.bench.grid import DTYPES, Cell
from flashlab.host import flash_attention, flash_attention_with_kvcache
from flashlab.host.attention import forward
from flashlab.host.checks import check_inputs
from flashlab.host.fp8 import FP8_FORWARD_TOLERANCE, dequantize_qkv, quantize_qkv
from flashlab.host.fp8 import MIN_CAPABILITY as FP8_MIN_CAPABILITY
from flashlab.host.quantize import dequantize_kv, quantize_kv
from flashlab.kernels import backward as backward_ladder
from flashlab.kernels import ladder
from flashlab.kernels.decode.kvcache import paged_kv_cache
from flashlab.reference.torch_float64 import attention_float64

# ----------------------------------------------------------------------------------------------------------------
# The backends


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Materialised attention in torch, three kernels the way a textbook writes it: matmul -> softmax -> matmul.

    q ``(B, H, Nq, D)``, k/v ``(B, Hk, Nk, D)``. The ``(B, H, Nq, Nk)`` score matrix S and probabilities P are
    written to memory in full -- the traffic FlashAttention avoids. With fewer K/V heads (GQA) K and V are first
    copied once per query head, as a framework without a GQA kernel does. Causal is aligned bottom-right
    (``flashlab.core.masking``); Nq <= Nk here, so every row sees at least one key.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # (B, H, Nk, D): a copy of K per query head
        v = v.repeat_interleave(group, dim=1)  # (B, H, Nk, D)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk): written to memory
    if causal:
        nq, nk = s.shape[-2:]
        visible = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril(diagonal=nk - nq)  # (Nq, Nk)
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B, H, Nq, Nk): read S, write P
    return p @ v  # (B, H, Nq, D): read P


def reference_rows(q, k, v, causal: bool, rows, scale: float | None = None):
    """Float64 attention output for the query rows ``rows`` only, ``(B, H, len(rows), D)``: the slice of
    ``flashlab.reference.torch_float64.attention_float64`` a benchmark cell is checked on."""
    return attention_float64(q, k, v, causal=causal, scale=scale, rows=rows)[0]


@dataclass(frozen=True)
class Backend:
    """A way to compute attention: ``run(q, k, v, causal)`` -> o, all ``(B, H, N, D)``.

    ``unavailable(device, dtype)`` returns why it cannot run there (or None); ``materialises`` says it holds the
    score matrix (and, under GQA, copies of K and V), so the harness checks it fits in memory before running it;
    ``score_bytes`` is how many bytes it holds per score entry; ``by_default`` whether a sweep that names no
    backends runs it. ``stands_for(q, k, v)``, for a backend that stores its inputs in fewer bits, gives the
    float64 q, k, v they stand for, which it is checked against (None: q, k and v themselves), within
    ``tolerance`` (None: the cell's dtype's); ``kv_bytes_per_element`` the K/V bytes per element (None: the cell's
    dtype's), for its Q/K/V/O bandwidth.
    """

    name: str
    description: str
    run: Callable
    unavailable: Callable = lambda device, dtype: None
    materialises: bool = False
    score_bytes: Callable = lambda dtype: 2 * dtype.itemsize  # S and P alive at once
    by_default: bool = True
    stands_for: Callable | None = None
    tolerance: float | None = None
    kv_bytes_per_element: int | None = None

    def io_bytes(self, cell: Cell) -> int:
        """The cell's Q, K, V, O bytes with K and V at this backend's cache width."""
        if self.kv_bytes_per_element is None:
            return cell.io_bytes
        kv = cell.kv_bytes // DTYPES[cell.dtype].itemsize * self.kv_bytes_per_element
        return cell.io_bytes - cell.kv_bytes + kv

    def workspace_bytes(self, cell: Cell) -> int:
        """Memory a materialising backend needs beyond its inputs: S and P, plus K/V repeated per query head."""
        dtype = DTYPES[cell.dtype]
        scores = cell.batch * cell.heads * cell.nq * cell.seq_len * self.score_bytes(dtype)
        repeated_kv = 0 if cell.hk == cell.heads else 2 * cell.batch * cell.heads * cell.seq_len * cell.head_dim
        return scores + repeated_kv * dtype.itemsize


def _sdpa_backend(member: str, description: str, cuda_only: bool, materialises: bool = False) -> Backend:
    def run(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # K/V heads shared by query heads
        with sdpa_kernel([getattr(SDPBackend, member)]):  # pinned: no silent fallback to another backend
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

    def unavailable(device, dtype):
        if cuda_only and device != "cuda":
            return f"SDPA {member} has no CPU kernel"
        return None

    return Backend(
        name=f"sdpa_{member.split('_')[0].lower()}",
        description=f"torch SDPA pinned to {member}: {description}",
        run=run,
        unavailable=unavailable,
        materialises=materialises,
        # the math backend computes half-precision inputs in fp32 on CUDA: S and P at 4 bytes each
        score_bytes=(lambda dtype: 8) if materialises else (lambda dtype: 2 * dtype.itemsize),
    )


def _flashlab_run(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal)


def flashlab_variant(kernel_config=None, tile_order=None, tma=None) -> Backend:
    """flashlab's prefill kernel with the autotuner's pick, the causal tile order or the TMA choice overridden:
    the benchmark's ``--kernel-config``, ``--tile-order`` and ``--tma``."""
    config = None
    if kernel_config is not None:
        bm, bn, warps, stages = kernel_config
        config = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    reverse_m = None if tile_order is None else tile_order == "reverse"
    use_tma = None if tma is None else tma == "on"

    def run(q, k, v, causal):
        check_inputs(q, k, v, causal, None, None)
        return forward(q, k, v, causal, None, None, config=config, reverse_m=reverse_m, use_tma=use_tma)[0]

    what = ", ".join(f"{n}={x}" for n, x in (("config", config), ("tile order", tile_order), ("tma", tma)) if x)
    return Backend("flashlab", f"flashlab.flash_attention's prefill kernel with {what}", run)


RUNG_PREFIX = "flashlab_"  # flashlab_lesson_loop, flashlab_skip_split, ...: one backend per rung of the ladder


def rung_backend(rung: ladder.Rung) -> Backend:
    """One rung of flashlab's kernel ladder, named explicitly (``flash_attention(..., rung=name)``: at every Nq, no
    split-KV). A rung that cannot run a cell is skipped with its reason, never replaced by another rung: its
    ``unavailable`` is asked once per cell signature, before the call."""
    asked: dict = {}  # (shapes, dtype, device, causal) -> the rung's reason, or None

    def run(q, k, v, causal):
        key = (q.shape, k.shape, q.dtype, q.device, causal)
        if key not in asked:
            asked[key] = rung.unavailable(q, k, v, causal, None)
        if asked[key] is not None:
            raise NotImplementedError(f"rung {rung.name!r} cannot run here: {asked[key]}")
        return flash_attention(q, k, v, causal=causal, rung=rung.name)

    description = f"flashlab.flash_attention(rung={rung.name!r}), the ladder's rung that removes {rung.removes}"
    return Backend(RUNG_PREFIX + rung.name, description, run, by_default=False)


BACKWARD_RUNG_PREFIX = "backward_"  # backward_two_pass, backward_hopper: one backend per rung of the backward ladder


def backward_rung_backend(rung) -> Backend:
    """flashlab with one rung of the backward's ladder named (``flash_attention(..., backward_rung=name)``): the
    same forward as ``flashlab``, so its forward cells repeat flashlab's; for ``--mode backward``. A rung that
    cannot run a cell's backward is skipped with its reason, never replaced by another."""
    asked: dict = {}

    def run(q, k, v, causal):
        key = (q.shape, k.shape, q.dtype, q.device)
        if key not in asked:
            asked[key] = rung.unavailable(q, k, v, q)  # dO has q's shape, dtype and layout
        if asked[key] is not None:
            raise NotImplementedError(f"backward rung {rung.name!r} cannot run here: {asked[key]}")
        return flash_attention(q, k, v, causal=causal, backward_rung=rung.name)

    description = f"flashlab.flash_attention(backward_rung={rung.name!r}), the backward rung that removes "
    description += rung.removes
    return Backend(BACKWARD_RUNG_PREFIX + rung.name, description, run, by_default=False)


def _paged_backend(block_size: int) -> Backend:
    """flashlab's paged-cache kernel on the cell's K/V copied into a shuffled pool of ``block_size``-token blocks
    (copied once per cell, not timed), as a decode loop calls it: ``check_values=False`` (no host read of the
    table per step). Decode cells only."""
    made = {}  # the pool of the K/V tensors last seen

    def run(q, k, v, causal):
        if q.shape[2] == k.shape[2] and q.shape[2] > 1:
            raise ValueError("the paged-cache backend runs decode cells (one query token against a cache)")
        if made.get("k") is None or made["k"]() is not k or made["v"]() is not v:
            made.clear()
            made.update(k=weakref.ref(k), v=weakref.ref(v), cache=paged_kv_cache(k, v, block_size, seed=block_size))
        kc, vc, table, seqlens = made["cache"]
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=causal, check_values=False)

    return Backend(
        f"paged{block_size}",
        f"flashlab.flash_attention_with_kvcache, the cache in shuffled {block_size}-token blocks (decode only)",
        run,
    )


FP8_SUFFIX = "_fp8"  # paged16_fp8, paged256_fp8: the paged backends on an 8-bit cache


def _dequantised(q, k, v):
    """q, and the float64 keys and values an 8-bit cache of k, v ``(B, Hk, N, D)`` stands for, ``(B, Hk, N, D)``."""
    k8, v8, ks, vs = quantize_kv(k.transpose(1, 2), v.transpose(1, 2))  # (B, N, Hk, D), as the kvcache API lays it
    kd, vd = dequantize_kv(k8, v8, ks, vs)
    return q, kd.transpose(1, 2), vd.transpose(1, 2)


def _fp8_backend() -> Backend:
    """flashlab's FP8 forward (``flash_attention`` on e4m3 q, k, v): the cell's tensors quantised once per cell (not
    timed), one scale per (sequence, K/V head); checked against float64 of the dequantised inputs within
    ``FP8_FORWARD_TOLERANCE`` (P's rounding to e4m3). D = 64, 128, 256; 16-bit cells."""
    made = {}

    def run(q, k, v, causal):
        if made.get("q") is None or any(made[n]() is not x for n, x in (("q", q), ("k", k), ("v", v))):
            made.clear()
            made.update(q=weakref.ref(q), k=weakref.ref(k), v=weakref.ref(v), inputs=quantize_qkv(q, k, v))
        q8, k8, v8, qd, kd, vd = made["inputs"]
        return flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    def stands_for(q, k, v):
        return dequantize_qkv(*quantize_qkv(q, k, v))

    def unavailable(device, dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            return f"the FP8 forward is timed on 16-bit cells (quantised from them); the cell is {dtype}"
        if device == "cuda" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
            return "the FP8 forward needs 8-bit tensor cores (sm_89 or later)"
        return None

    return Backend(
        "fp8_forward",
        "flashlab.flash_attention on float8 e4m3 q, k, v (quantised from the cell's; checked against float64 of "
        "the dequantised inputs)",
        run,
        unavailable=unavailable,
        by_default=False,
        stands_for=stands_for,
        tolerance=FP8_FORWARD_TOLERANCE,
        kv_bytes_per_element=1,
    )


def _paged_fp8_backend(block_size: int) -> Backend:
    """flashlab's paged-cache kernel reading an 8-bit (float8 e4m3) cache: the cell's K/V copied into a shuffled
    pool of ``block_size``-token blocks and quantised once per cell (not timed), one scale per (sequence, K/V
    head); checked against float64 of the dequantised cache. Decode cells, 16-bit q."""
    made = {}

    def run(q, k, v, causal):
        if q.shape[2] == k.shape[2] and q.shape[2] > 1:
            raise ValueError("the paged-cache backend runs decode cells (one query token against a cache)")
        if made.get("k") is None or made["k"]() is not k or made["v"]() is not v:
            made.clear()
            kc, vc, table, seqlens = paged_kv_cache(k, v, block_size, seed=block_size)
            k8, v8, ks, vs = quantize_kv(kc, vc, block_table=table, cache_seqlens=seqlens)
            made.update(k=weakref.ref(k), v=weakref.ref(v), cache=(k8, v8, table, seqlens, ks, vs))
        k8, v8, table, seqlens, ks, vs = made["cache"]
        return flash_attention_with_kvcache(q, k8, v8, seqlens, table, causal=causal, check_values=False,
                                            k_descale=ks, v_descale=vs)  # fmt: skip

    def unavailable(device, dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            return f"an 8-bit cache goes with float16 or bfloat16 queries; the cell is {dtype}"
        return None

    return Backend(
        f"paged{block_size}{FP8_SUFFIX}",
        f"flashlab.flash_attention_with_kvcache on an 8-bit (e4m3) cache in shuffled {block_size}-token blocks "
        "(decode only; checked against float64 of the dequantised cache)",
        run,
        unavailable=unavailable,
        by_default=False,
        stands_for=_dequantised,
        kv_bytes_per_element=1,
    )


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("naive", "torch matmul -> softmax -> matmul, score matrix materialised", naive_attention,
                materialises=True),
        Backend("flashlab", "flashlab.flash_attention (Triton; the interpreter on CPU)", _flashlab_run),
        *(rung_backend(r) for r in ladder.RUNGS),
        *(backward_rung_backend(r) for r in backward_ladder.BACKWARD_RUNGS),
        _paged_backend(16),
        _paged_backend(256),
        _paged_fp8_backend(16),
        _paged_fp8_backend(256),
        _fp8_backend(),
        _sdpa_backend("FLASH_ATTENTION", "FlashAttention-2 inside PyTorch", cuda_only=False),
        _sdpa_backend("CUDNN_ATTENTION", "cuDNN's fused attention", cuda_only=True),
        _sdpa_backend("EFFICIENT_ATTENTION", "xformers' memory-efficient kernel", cuda_only=True),
        _sdpa_backend("MATH", "PyTorch's composite fallback", cuda_only=False, materialises=True),
    )
}  # fmt: skip

# What a sweep runs when it names no backends: every backend but the ladder's rungs (``flashlab`` is already the
# fastest rung; the others run when named, e.g. --backends flashlab_lesson_loop,flashlab_skip_split,sdpa_flash).
DEFAULT_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.by_default)
