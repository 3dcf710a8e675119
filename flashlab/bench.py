"""The benchmark harness: naive attention, flashlab's kernel and PyTorch's SDPA backends, side by side.

    python -m flashlab.bench                        # the issue's grid on the GPU: bf16, D 64/128, N 1K..16K
    python -m flashlab.bench --device cpu --quick   # a tiny grid on the CPU (flashlab runs in Triton's interpreter)

For every cell of the sweep (dtype x head dim D x sequence length N x causal, with B*N = ``--tokens`` and
H = ``--model-dim`` / D) and every backend, in the order llm.c's ``dev/cuda`` uses:

1. **check** -- run the backend once and compare its output with a float64 reference computed on a sample of query
   rows (``reference_rows``); a backend whose relative error exceeds the dtype's tolerance is reported as
   ``wrong`` and never timed;
2. **measure memory** -- peak extra memory of one call (``torch.cuda.max_memory_allocated`` minus what was
   allocated before it: the output plus any workspace, such as naive attention's score matrix);
3. **time** -- ``triton.testing.do_bench`` (median over ``--rep`` ms after ``--warmup`` ms) on CUDA, the median of
   ``time.perf_counter`` runs on the CPU.

A row then reports time, TFLOP/s (forward FLOPs = 4*B*H*N^2*D, halved for causal), achieved bandwidth counting
only the bytes of Q, K, V and O (so a kernel that re-reads K/V or spills the score matrix moves more than this
figure says), and peak extra memory. Backends that cannot run a cell (no CPU kernel, unsupported dtype or head
dim) are ``skipped`` with PyTorch's reason; a backend that runs out of memory -- or would, by a pre-check of the
score matrix against free memory -- is ``oom``, and the sweep carries on.

Once per GPU run the two ceilings of the roofline are measured too: device-to-device copy bandwidth and an
8192^3 bf16 matmul. Results go to ``PREFIX.csv`` and ``PREFIX.json`` stamped with the device, torch / triton /
CUDA versions, the date and the exact command; ``data/results/README.md`` describes the columns.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import flashlab
from flashlab import roofline
from flashlab.masking import visible_band

# ----------------------------------------------------------------------------------------------------------------
# The sweep: cells and configuration

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# Relative error (Frobenius norm of the difference over that of the reference) a backend may have on a checked
# slice. The inputs are already rounded to the dtype, so this is the error of the computation alone: rounding P
# and O to the dtype (bf16 has 8 significant bits, fp16 11). fp32 leaves room for TF32 tensor-core products
# (11 bits), which Triton's tl.dot uses for fp32 by default. A wrong answer (a missed mask, a lost rescale) is
# off by 1e-1 or more.
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 5e-3}

CAUSAL_CHOICES = {"both": (False, True), "no": (False,), "yes": (True,)}


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: q is ``(batch, heads, q_len, head_dim)``, k and v ``(batch, kv_heads, seq_len,
    head_dim)``, all of ``dtype``.

    Prefill (the default): ``q_len = seq_len`` and ``kv_heads = heads``. Decode: ``q_len = 1``, one new token
    against a KV cache of ``seq_len`` tokens, with ``kv_heads < heads`` under grouped-query attention.
    """

    dtype: str
    head_dim: int
    seq_len: int
    causal: bool
    batch: int
    heads: int
    q_len: int | None = None  # None: seq_len (prefill)
    kv_heads: int | None = None  # None: heads (no GQA)

    @property
    def nq(self) -> int:
        return self.seq_len if self.q_len is None else self.q_len

    @property
    def hk(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def flops(self) -> float:
        if self.nq == self.seq_len:
            return attention_flops(self.batch, self.heads, self.seq_len, self.head_dim, self.causal)
        # decode: Q K^T and P V over nq x seq_len scores per query head (nq = 1 sees every key: no mask)
        return 4.0 * self.batch * self.heads * self.nq * self.seq_len * self.head_dim

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V (the KV cache) read once."""
        return 2 * self.batch * self.hk * self.seq_len * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def io_bytes(self) -> int:
        """Bytes of Q, K, V read and O written, once each: the least any implementation must move."""
        q_and_o = 2 * self.batch * self.heads * self.nq * self.head_dim * DTYPES[self.dtype].itemsize
        return q_and_o + self.kv_bytes

    def label(self) -> str:
        if self.nq != self.seq_len:
            return f"{self.dtype} D={self.head_dim} decode KV={self.seq_len} B={self.batch} H={self.heads}/{self.hk}"
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} D={self.head_dim} N={self.seq_len} {mask} B={self.batch} H={self.heads}"


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of the whole batch: ``flashlab.roofline.attention_flops`` (4*N^2*D per head, causal half)."""
    return float(batch * heads * roofline.attention_flops(seq_len, head_dim, causal=causal))


@dataclass
class BenchConfig:
    """Everything a sweep depends on. ``None`` fields take the device's defaults (see ``resolve``)."""

    seq_lens: Sequence[int] | None = None
    head_dims: Sequence[int] | None = None
    dtypes: Sequence[str] | None = None
    causal: str = "both"
    backends: Sequence[str] | None = None
    mode: str = "prefill"
    batches: Sequence[int] | None = None  # decode only
    q_heads: int | None = None  # decode only
    kv_heads: int | None = None  # decode only
    tokens: int | None = None
    model_dim: int | None = None
    warmup: float | None = None  # ms
    rep: float | None = None  # ms
    device: str | None = None
    quick: bool = False
    ceilings: bool = True
    check_rows: int = 256
    max_memory_gb: float | None = None
    seed: int = 0

    def resolve(self) -> BenchConfig:
        """Fill in defaults for the device (GPU: the issue's grid; CPU or --quick: tiny sizes); validate."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu'; got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU; use --device cpu")
        gpu = device == "cuda"
        if self.mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode'; got {self.mode!r}")
        if self.mode == "decode":
            return self._resolve_decode(device)
        if self.quick or not gpu:
            defaults = dict(
                seq_lens=(512, 2048) if gpu else (64, 100),
                head_dims=(64, 128) if gpu else (16, 40),
                dtypes=("bf16",) if gpu else ("fp32",),
                tokens=4096 if gpu else 128,
                model_dim=2048 if gpu else 64,
                warmup=10.0 if gpu else 1.0,
                rep=30.0 if gpu else 5.0,
            )
        else:
            defaults = dict(
                seq_lens=(1024, 2048, 4096, 8192, 16384),
                head_dims=(64, 128),
                dtypes=("bf16",),
                tokens=16384,
                model_dim=2048,
                warmup=25.0,
                rep=100.0,
            )
        return self._fill(device, defaults)

    def _resolve_decode(self, device: str) -> BenchConfig:
        gpu = device == "cuda"
        defaults = dict(
            seq_lens=(4096, 32768) if gpu and self.quick else (4096, 32768, 131072) if gpu else (100, 257),
            head_dims=(128,) if gpu else (16,),
            dtypes=("bf16",) if gpu else ("fp32",),
            batches=(1, 8) if gpu else (1, 2),
            q_heads=64 if gpu else 4,
            kv_heads=8 if gpu else 2,
            tokens=0,
            model_dim=0,
            warmup=(10.0 if self.quick else 25.0) if gpu else 1.0,
            rep=(30.0 if self.quick else 100.0) if gpu else 5.0,
        )
        filled = self._fill(device, defaults)
        if min(filled.batches, default=0) < 1:
            raise ValueError(f"batches must be a non-empty list of positive ints; got {filled.batches}")
        if filled.kv_heads < 1 or filled.q_heads < 1 or filled.q_heads % filled.kv_heads:
            raise ValueError(f"q_heads ({filled.q_heads}) must be a positive multiple of kv_heads ({filled.kv_heads})")
        return replace(filled, batches=tuple(int(b) for b in filled.batches), causal="no")

    def _fill(self, device: str, defaults: dict) -> BenchConfig:
        filled = {k: (getattr(self, k) if getattr(self, k) is not None else v) for k, v in defaults.items()}
        filled["dtypes"] = tuple(_dtype_name(d) for d in filled["dtypes"])
        filled["seq_lens"] = tuple(int(n) for n in filled["seq_lens"])
        filled["head_dims"] = tuple(int(d) for d in filled["head_dims"])
        backends = tuple(self.backends) if self.backends is not None else tuple(BACKENDS)
        if self.causal not in CAUSAL_CHOICES:
            raise ValueError(f"causal must be one of {sorted(CAUSAL_CHOICES)}; got {self.causal!r}")
        for name, values in (("seq_lens", filled["seq_lens"]), ("head_dims", filled["head_dims"])):
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of positive ints; got {values}")
        for name in ("tokens", "model_dim") if self.mode == "prefill" else ():
            if filled[name] < 1:
                raise ValueError(f"{name} must be a positive int; got {filled[name]}")
        if filled["warmup"] < 0 or filled["rep"] <= 0:
            raise ValueError(f"warmup must be >= 0 and rep > 0 (ms); got {filled['warmup']}, {filled['rep']}")
        if self.check_rows < 1:
            raise ValueError(f"check_rows must be a positive int; got {self.check_rows}")
        return replace(self, device=device, backends=backends, **filled)

    def cells(self) -> list[Cell]:
        """The sweep's cells, in the order they run: dtype, then head dim, then causal, then sequence length."""
        c = self.resolve()  # idempotent: a resolved config resolves to itself
        if c.mode == "decode":
            return [
                Cell(dtype, d, n, False, batch=b, heads=c.q_heads, q_len=1, kv_heads=c.kv_heads)
                for dtype in c.dtypes
                for d in c.head_dims
                for n in c.seq_lens
                for b in c.batches
            ]
        return [
            Cell(dtype, d, n, causal, batch=max(1, c.tokens // n), heads=max(1, c.model_dim // d))
            for dtype in c.dtypes
            for d in c.head_dims
            for causal in CAUSAL_CHOICES[c.causal]
            for n in c.seq_lens
        ]

    def to_argv(self) -> list[str]:
        """The command-line flags that reproduce this (resolved) configuration."""
        c = self.resolve()  # idempotent: a resolved config resolves to itself
        argv = [
            "--mode", c.mode,
            "--device", c.device,
            "--dtypes", ",".join(c.dtypes),
            "--head-dims", ",".join(map(str, c.head_dims)),
            "--seq-lens", ",".join(map(str, c.seq_lens)),
            "--backends", ",".join(c.backends),
            "--warmup", f"{c.warmup:g}",
            "--rep", f"{c.rep:g}",
            "--check-rows", str(c.check_rows),
            "--seed", str(c.seed),
        ]  # fmt: skip
        if c.mode == "decode":
            argv += ["--batches", ",".join(map(str, c.batches)), "--q-heads", str(c.q_heads)]
            argv += ["--kv-heads", str(c.kv_heads)]
        else:
            argv += ["--causal", c.causal, "--tokens", str(c.tokens), "--model-dim", str(c.model_dim)]
        if c.max_memory_gb is not None:
            argv += ["--max-memory-gb", f"{c.max_memory_gb:g}"]
        if not c.ceilings:
            argv.append("--no-ceilings")
        return argv


def _dtype_name(name: str) -> str:
    key = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return key


# ----------------------------------------------------------------------------------------------------------------
# The backends


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Materialised attention in torch, three kernels the way a textbook writes it: matmul -> softmax -> matmul.

    q ``(B, H, Nq, D)``, k/v ``(B, Hk, Nk, D)``. The ``(B, H, Nq, Nk)`` score matrix S and probabilities P are
    written to memory in full -- the traffic FlashAttention avoids. With fewer K/V heads (GQA) K and V are first
    copied once per query head, as a framework without a GQA kernel does. Causal is aligned bottom-right
    (``flashlab.masking``); Nq <= Nk here, so every row sees at least one key.
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


def reference_rows(q, k, v, causal: bool, rows, scale: float | None = None, max_bytes: int = 256 * 2**20):
    """Float64 attention output for the query rows ``rows`` only: ``(B, H, len(rows), D)``.

    A row's output depends on its own query and all keys, so a sample of rows checks a kernel without building
    the full N x N float64 score matrix. The mask uses ``flashlab.masking.visible_band`` (causal aligned
    bottom-right, as every flashlab implementation). k/v may have fewer heads than q (GQA: query head h reads K/V
    head ``h // group``). Heads are processed in groups of at most about ``max_bytes`` of float64 scores and K/V.
    Rows that see no key give zeros, as in ``flashlab.reference``.
    """
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = torch.as_tensor(rows, device=q.device, dtype=torch.long)
    offset, left, right = visible_band(nq, nk, causal)
    diag = (rows + offset)[:, None]  # (R, 1)
    j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
    visible = (j >= diag - left) & (j <= diag + right)  # (R, Nk)
    b, h = q.shape[:2]
    group = h // k.shape[1]
    heads_per_step = max(1, max_bytes // (8 * nk * (len(rows) + 2 * d)))
    out = torch.empty(b, h, len(rows), v.shape[-1], dtype=torch.float64, device=q.device)
    for h0 in range(0, h, heads_per_step):
        hs = slice(h0, min(h, h0 + heads_per_step))
        kv = torch.arange(hs.start, hs.stop, device=q.device) // group  # the K/V head each query head reads
        qs = q[:, hs][:, :, rows].double()  # (B, h, R, D)
        s = (qs @ k[:, kv].double().transpose(-2, -1)) * scale  # (B, h, R, Nk)
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> zeros
        out[:, hs] = p @ v[:, kv].double()  # (B, h, R, D)
    return out


@dataclass(frozen=True)
class Backend:
    """A way to compute attention: ``run(q, k, v, causal)`` -> o, all ``(B, H, N, D)``.

    ``unavailable(device, dtype)`` returns why it cannot run there (or None); ``materialises`` says it holds the
    score matrix (and, under GQA, copies of K and V), so the harness checks it fits in memory before running it;
    ``score_bytes`` is how many bytes it holds per score entry.
    """

    name: str
    description: str
    run: Callable
    unavailable: Callable = lambda device, dtype: None
    materialises: bool = False
    score_bytes: Callable = lambda dtype: 2 * dtype.itemsize  # S and P alive at once

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
    return flashlab.flash_attention(q, k, v, causal=causal)


def _flashlab_unavailable(device, dtype):
    try:
        flashlab.flash_attention  # noqa: B018 -- imports flashlab.kernel (helper C1's Triton kernel)
    except (ImportError, AttributeError) as e:
        return f"flashlab.flash_attention not importable: {e}"
    return None


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("naive", "torch matmul -> softmax -> matmul, score matrix materialised", naive_attention,
                materialises=True),
        Backend("flashlab", "flashlab.flash_attention (Triton; the interpreter on CPU)", _flashlab_run,
                unavailable=_flashlab_unavailable),
        _sdpa_backend("FLASH_ATTENTION", "FlashAttention-2 inside PyTorch", cuda_only=False),
        _sdpa_backend("CUDNN_ATTENTION", "cuDNN's fused attention", cuda_only=True),
        _sdpa_backend("EFFICIENT_ATTENTION", "xformers' memory-efficient kernel", cuda_only=True),
        _sdpa_backend("MATH", "PyTorch's composite fallback", cuda_only=False, materialises=True),
    )
}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Measuring one cell


def _check_rows(n: int, count: int) -> torch.Tensor:
    """Query rows to check: evenly spread, always including the first and last (the causal mask's extremes)."""
    return torch.unique(torch.linspace(0, n - 1, min(n, count)).round().long())


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower()
    )


def _free_memory_bytes(device: str, max_memory_gb: float | None) -> float:
    if max_memory_gb is not None:
        return max_memory_gb * 1e9
    if device == "cuda":
        # Earlier cells leave blocks cached by PyTorch's allocator; the driver counts them as used, so hand them
        # back first (without this the H200 run of 2026-11-29 saw "13 GB free" of 141 GB and skipped naive).
        torch.cuda.empty_cache()
        return float(torch.cuda.mem_get_info()[0])
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable, device: str, warmup: float, rep: float) -> float:
    """Median milliseconds per call: do_bench on CUDA; perf_counter around each call on the CPU."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warmup:
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start) * 1e3 < rep:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_extra_bytes(fn: Callable, device: str) -> float:
    """Peak memory one call allocates beyond what was allocated before it (inputs); NaN on the CPU (n/a)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return float(peak)


def bench_cell(cell: Cell, backends: Sequence[Backend], config: BenchConfig, meta: dict) -> list[dict]:
    """Check, measure and time every backend on one cell; one result row per backend."""
    device, dtype = config.device, DTYPES[cell.dtype]
    gen = torch.Generator(device=device).manual_seed(config.seed)
    shape = (cell.batch, cell.heads, cell.nq, cell.head_dim)  # (B, H, Nq, D)
    kv_shape = (cell.batch, cell.hk, cell.seq_len, cell.head_dim)  # (B, Hk, Nk, D)
    q = torch.randn(shape, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(kv_shape, generator=gen, device=device).to(dtype) for _ in range(2))
    rows = _check_rows(cell.nq, config.check_rows).to(device)
    batches = sorted({0, cell.batch - 1})  # the first and last batch entries
    ref = reference_rows(q[batches], k[batches], v[batches], cell.causal, rows)  # (b, H, R, D) float64
    tol = TOLERANCE[cell.dtype]
    rows_out = []
    for backend in backends:
        row = dict(
            backend=backend.name,
            dtype=cell.dtype,
            head_dim=cell.head_dim,
            seq_len=cell.seq_len,
            causal=cell.causal,
            batch=cell.batch,
            heads=cell.heads,
            kv_heads=cell.hk,
            q_len=cell.nq,
            status="ok",
            reason="",
            rel_err=float("nan"),
            max_abs_err=float("nan"),
            tol=tol,
            time_ms=float("nan"),
            tflops=float("nan"),
            bandwidth_gbps=float("nan"),
            peak_extra_mb=float("nan"),
            flops=cell.flops,
            io_bytes=cell.io_bytes,
        )
        row.update({col: meta[col] for col in STAMP_COLUMNS})
        rows_out.append(row)

        reason = backend.unavailable(device, dtype)
        if reason:
            row.update(status="skipped", reason=reason)
            continue
        if backend.materialises:  # pre-check: would the score matrix fit?
            need = backend.workspace_bytes(cell)
            free = _free_memory_bytes(device, config.max_memory_gb)
            if need > 0.9 * free:
                what = "S and P" if cell.hk == cell.heads else "S, P and K/V repeated per query head"
                row.update(status="oom", reason=f"predicted: {what} need {need / 1e9:.3g} GB, {free / 1e9:.3g} GB free")
                continue

        def fn(backend=backend):
            return backend.run(q, k, v, cell.causal)

        try:
            # 1. check against the float64 reference before any timing
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = fn()
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                    if _is_oom(e):
                        raise
                    why = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught)) or str(e)
                    row.update(status="skipped", reason=_one_line(f"{e.__class__.__name__}: {why}"))
                    continue
            _sync(device)
            if tuple(out.shape) != shape:
                row.update(status="wrong", reason=f"output shape {tuple(out.shape)}, expected {shape}")
                continue
            got = out[batches][:, :, rows].double()  # (b, H, R, D)
            del out
            diff = got - ref
            rel_err = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref)).item()
            max_abs = diff.abs().max().item()
            row.update(rel_err=rel_err, max_abs_err=max_abs)
            if not rel_err <= tol:  # NaN fails too
                row.update(status="wrong", reason=f"relative error {rel_err:.3g} > tolerance {tol:g}; not timed")
                continue
            # 2. peak extra memory of one call, then 3. time
            row["peak_extra_mb"] = peak_extra_bytes(fn, device) / 1e6
            ms = time_ms(fn, device, config.warmup, config.rep)
        except Exception as e:  # noqa: BLE001 -- one failing backend must not end the sweep
            if _is_oom(e):
                row.update(status="oom", reason=_one_line(f"out of memory: {e}"))
            else:
                row.update(status="error", reason=_one_line(f"{e.__class__.__name__}: {e}"))
        if row["status"] != "ok":
            if device == "cuda":  # the exception and its frames are gone now: hand their memory back
                torch.cuda.empty_cache()
            continue
        row.update(time_ms=ms, tflops=cell.flops / (ms * 1e-3) / 1e12, bandwidth_gbps=cell.io_bytes / (ms * 1e-3) / 1e9)
    return rows_out


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _copy_ms(nbytes: int) -> float:
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median"))


def _matmul_ms(n: int) -> float:
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return float(triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median"))


def measure_ceilings(device: str) -> dict:
    """The roofline's two ceilings, measured: device-to-device copy bandwidth and an 8192^3 bf16 matmul."""
    if device != "cuda":
        return dict(copy_tbps=None, matmul_tflops=None, note="ceilings are measured on CUDA GPUs only")
    nbytes = 2**30
    copy_tbps = 2 * nbytes / (_copy_ms(nbytes) * 1e-3) / 1e12  # bytes read + written
    n = 8192
    matmul_tflops = 2 * n**3 / (_matmul_ms(n) * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return dict(
        copy_tbps=copy_tbps,
        matmul_tflops=matmul_tflops,
        note=f"copy: {nbytes} B buffer, bytes read + written / time; matmul: {n}^3 bf16 random normal, 2*n^3 FLOPs",
    )


# ----------------------------------------------------------------------------------------------------------------
# A whole sweep, its stamp, and files

STAMP_COLUMNS = ("device_name", "torch", "triton", "cuda", "date")
ROW_COLUMNS = (
    "backend", "dtype", "head_dim", "seq_len", "causal", "batch", "heads", "kv_heads", "q_len", "status", "reason",
    "rel_err", "max_abs_err", "tol", "time_ms", "tflops", "bandwidth_gbps", "peak_extra_mb", "flops", "io_bytes",
) + STAMP_COLUMNS  # fmt: skip


@dataclass
class BenchResults:
    """A sweep's result rows (dicts with ``ROW_COLUMNS``), its stamp ``meta`` and the measured ``ceilings``."""

    meta: dict
    rows: list[dict]
    ceilings: dict = field(default_factory=dict)

    def ok_rows(self, **match) -> list[dict]:
        """Rows that were checked and timed, optionally filtered by column values (e.g. ``backend='naive'``)."""
        return [r for r in self.rows if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]

    def to_json(self) -> dict:
        return dict(meta=self.meta, ceilings=self.ceilings, rows=[_json_row(r) for r in self.rows])

    def save(self, prefix) -> tuple[Path, Path]:
        """Write ``PREFIX.json`` (meta, ceilings, rows) and ``PREFIX.csv`` (rows, stamp columns in each)."""
        prefix = Path(prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        json_path, csv_path = prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".csv")
        json_path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=ROW_COLUMNS)
            writer.writeheader()
            for r in self.rows:
                writer.writerow({k: ("" if _is_nan(r.get(k, "")) else r.get(k, "")) for k in ROW_COLUMNS})
        return json_path, csv_path

    @classmethod
    def load(cls, path) -> BenchResults:
        """Read a ``.json`` written by ``save`` (missing numbers, stored as null, come back as NaN)."""
        data = json.loads(Path(path).read_text())
        rows = [{k: (float("nan") if v is None else v) for k, v in r.items()} for r in data["rows"]]
        return cls(meta=data["meta"], rows=rows, ceilings=data.get("ceilings", {}))


def _is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _json_row(r: dict) -> dict:
    return {k: (None if _is_nan(v) else v) for k, v in r.items()}


def environment_stamp(device: str) -> dict:
    """What produced the numbers: device, versions, date."""
    import triton

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name = props.name
        extra = dict(
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gb=round(props.total_memory / 1e9, 1),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        extra = {}
    return dict(
        tool="flashlab.bench",
        flashlab=flashlab.__version__,
        device=device,
        device_name=device_name,
        is_cuda_gpu=device == "cuda",
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda if device == "cuda" else None,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **extra,
    )


def run_sweep(
    config: BenchConfig | None = None,
    extra_backends: Sequence[Backend] = (),
    progress: bool = True,
    command: str | None = None,
) -> BenchResults:
    """Run the sweep ``config`` describes (``BenchConfig()``: the device's default grid) and return its results.

    ``extra_backends`` are run after the named ones (tests inject a broken one this way). ``command`` is the
    stamp's command line; by default the ``python -m flashlab.bench`` flags that reproduce ``config``.
    """
    from tqdm import tqdm

    config = (config or BenchConfig()).resolve()
    unknown = [b for b in config.backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    backends = [BACKENDS[b] for b in config.backends] + list(extra_backends)
    meta = environment_stamp(config.device)
    meta["command"] = command or "python -m flashlab.bench " + shlex.join(config.to_argv())
    meta["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
    meta["timing"] = (
        "triton.testing.do_bench, median" if config.device == "cuda" else "time.perf_counter per call, median"
    )
    meta["backends"] = {b.name: b.description for b in backends}
    cells = config.cells()
    ceilings = measure_ceilings(config.device) if config.ceilings else {}
    rows = []
    start = time.perf_counter()
    bar = tqdm(total=len(cells) * len(backends), desc="flashlab.bench", unit="run", disable=not progress)
    for cell in cells:
        bar.set_postfix_str(cell.label())
        cell_rows = bench_cell(cell, backends, config, meta)
        rows += cell_rows
        bar.update(len(cell_rows))
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return BenchResults(meta=meta, rows=rows, ceilings=ceilings)


# ----------------------------------------------------------------------------------------------------------------
# Summaries


def speedups(results: BenchResults, numerator: str = "flashlab", denominator: str = "sdpa_flash") -> dict:
    """Time of ``denominator`` / time of ``numerator`` per cell (>1: numerator faster), for cells where both ran.

    Keys are ``(dtype, head_dim, causal, seq_len, batch)``.
    """

    def key(r):
        return (r["dtype"], r["head_dim"], r["causal"], r["seq_len"], r["batch"])

    num = {key(r): r["time_ms"] for r in results.ok_rows(backend=numerator)}
    den = {key(r): r["time_ms"] for r in results.ok_rows(backend=denominator)}
    return {c: den[c] / num[c] for c in num if c in den}


def geomean(values) -> float:
    values = list(values)
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def summary_table(results: BenchResults) -> str:
    """Per cell, every backend's TFLOP/s (prefill) or Q/K/V/O bandwidth in TB/s (decode, where K and V are nearly
    all of it), then the speed ratios flashlab / FA2 and flashlab / cuDNN, and their geo-means."""
    decode = results.meta.get("config", {}).get("mode") == "decode"
    names = list(dict.fromkeys(r["backend"] for r in results.rows))

    def key(r):
        return (r["dtype"], r["head_dim"], r["causal"], r["seq_len"], r["batch"])

    cells = list(dict.fromkeys(key(r) for r in results.rows))
    status = {key(r) + (r["backend"],): r for r in results.rows}
    vs_fa2 = speedups(results, "flashlab", "sdpa_flash")
    vs_cudnn = speedups(results, "flashlab", "sdpa_cudnn")
    head = ["dtype", "D", "mask", "N", "B"] + names + ["fl/FA2", "fl/cuDNN"]
    lines = []
    for c in cells:
        line = [c[0], str(c[1]), "decode" if decode else "causal" if c[2] else "full", str(c[3]), str(c[4])]
        for name in names:
            r = status.get(c + (name,))
            if r is None or r["status"] != "ok":
                line.append("-" if r is None else r["status"])
            else:
                line.append(f"{r['bandwidth_gbps'] / 1e3:.3g}" if decode else f"{r['tflops']:.3g}")
        line += [f"{vs_fa2[c]:.2f}" if c in vs_fa2 else "-", f"{vs_cudnn[c]:.2f}" if c in vs_cudnn else "-"]
        lines.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    what = "decode, Q/K/V/O bandwidth in TB/s (or why not)" if decode else "forward TFLOP/s (or why not)"
    out = [f"{results.meta['device_name']}, torch {results.meta['torch']}, triton {results.meta['triton']}, "
           f"{results.meta['date']} -- {what}"]  # fmt: skip
    out += [fmt.format(*head)] + [fmt.format(*line) for line in lines]
    for name, ratios in (("FA2 (sdpa_flash)", vs_fa2), ("cuDNN (sdpa_cudnn)", vs_cudnn)):
        if ratios:
            out.append(
                f"flashlab vs {name}: geo-mean {geomean(ratios.values()):.2f}x over {len(ratios)} cells "
                f"(min {min(ratios.values()):.2f}x, max {max(ratios.values()):.2f}x)"
            )
        else:
            out.append(f"flashlab vs {name}: no cell where both ran")
    ceil = results.ceilings
    if ceil.get("copy_tbps"):
        out.append(
            f"ceilings: copy {ceil['copy_tbps']:.2f} TB/s, 8192^3 bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s"
        )
    problems = [r for r in results.rows if r["status"] in ("wrong", "error")]
    for r in problems:
        out.append(
            f"{r['status'].upper()}: {r['backend']} {r['dtype']} D={r['head_dim']} N={r['seq_len']}: {r['reason']}"
        )
    return "\n".join(out)


def default_prefix(meta: dict) -> Path:
    """``data/results/<gpu>-<dtypes>-<date>`` for a GPU run (``<gpu>-decode-...`` in decode mode);
    ``test-artifacts/bench/cpu-...`` on the CPU."""
    dtypes = "-".join(meta["config"]["dtypes"])
    if meta["config"].get("mode") == "decode":
        dtypes = "decode-" + dtypes
    date = meta["date"][:10]
    if meta["is_cuda_gpu"]:
        slug = meta["device_name"].lower().replace("nvidia", "").strip().replace(" ", "-")
        return Path("data/results") / f"{slug}-{dtypes}-{date}"
    return Path("test-artifacts/bench") / f"cpu-{dtypes}-{date}"


def newest_gpu_results(directory="data/results", mode: str = "prefill") -> Path | None:
    """The newest ``*.json`` in ``directory`` whose stamp says a CUDA GPU produced it in ``mode`` (by stamp date),
    or None."""
    found = []
    for path in Path(directory).glob("*.json"):
        try:
            meta = json.loads(path.read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        file_mode = (meta.get("config") or {}).get("mode", "prefill")
        if meta.get("tool") == "flashlab.bench" and meta.get("is_cuda_gpu") and file_mode == mode:
            found.append((meta.get("date", ""), path.name, path))
    return max(found)[2] if found else None


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _sizes(text: str) -> list[int]:
    """'1024,2k,16K' -> [1024, 2048, 16384] (k = 1024)."""
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        try:
            out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated sizes like 1024,2k,16k; got {text!r}") from None
    return out


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashlab.bench",
        description=__doc__.split("\n\n")[0]
        + " Each (backend, cell) is checked against a float64 reference before it is timed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Defaults marked None depend on the device and mode: on a GPU, prefill runs the issue's grid (bf16, "
        "D 64,128, N 1k..16k, 16k tokens, model dim 2048, warmup 25, rep 100) and decode bf16, D 128, KV 4k,32k,128k, "
        "batches 1,8, 64 query / 8 KV heads; on the CPU or with --quick, tiny grids.",
    )
    p.add_argument(
        "--mode",
        choices=["prefill", "decode"],
        default="prefill",
        help="prefill: N queries attend to N keys (the issue's grid); decode: one query token per sequence against "
        "a KV cache of N tokens, grouped-query heads (--q-heads / --kv-heads), batches from --batches",
    )
    p.add_argument(
        "--seq-lens", type=_sizes, help="sequence lengths N, comma-separated ('2k' = 2048); in decode, KV cache lengths"
    )
    p.add_argument("--head-dims", type=_sizes, help="head dims D, comma-separated")
    p.add_argument("--dtypes", type=_names, help=f"dtypes, comma-separated, from {sorted(DTYPES)}")
    p.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), default="both", help="causal mask: yes, no or both")
    p.add_argument(
        "--backends",
        type=_names,
        help=f"backends to run, comma-separated (default: all of {','.join(BACKENDS)})",
    )
    p.add_argument("--tokens", type=int, help="prefill: tokens per batch B*N; batch B = tokens // N (at least 1)")
    p.add_argument("--model-dim", type=int, help="prefill: model width H*D; heads H = model_dim // D (at least 1)")
    p.add_argument("--batches", type=_sizes, help="decode: batch sizes, comma-separated (default 1,8 on a GPU)")
    p.add_argument("--q-heads", type=int, help="decode: query heads (default 64 on a GPU)")
    p.add_argument("--kv-heads", type=int, help="decode: key/value heads, dividing --q-heads (default 8 on a GPU)")
    p.add_argument("--warmup", type=float, help="warm-up time per measurement, ms (do_bench's warmup)")
    p.add_argument("--rep", type=float, help="timed repetitions per measurement, ms (do_bench's rep); median reported")
    p.add_argument(
        "--out",
        help="write PREFIX.csv and PREFIX.json (default: data/results/<gpu>-<dtypes>-<date> on a GPU, "
        "test-artifacts/bench/cpu-<dtypes>-<date> on the CPU)",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="a tiny grid that finishes in seconds (smoke test)")
    p.add_argument(
        "--no-ceilings", action="store_true", help="skip measuring copy bandwidth and matmul TFLOP/s (GPU only)"
    )
    p.add_argument("--check-rows", type=int, default=256, help="query rows per head checked against float64")
    p.add_argument(
        "--max-memory-gb",
        type=float,
        help="memory (GB) a materialising backend may assume free when pre-checking its score matrix "
        "(default: what the device reports free)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for q, k, v")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` a parsed command line asks for (unresolved: device defaults still to fill in)."""
    return BenchConfig(
        seq_lens=args.seq_lens,
        head_dims=args.head_dims,
        dtypes=args.dtypes,
        causal=args.causal,
        backends=args.backends,
        mode=args.mode,
        batches=args.batches,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        tokens=args.tokens,
        model_dim=args.model_dim,
        warmup=args.warmup,
        rep=args.rep,
        device=args.device,
        quick=args.quick,
        ceilings=not args.no_ceilings,
        check_rows=args.check_rows,
        max_memory_gb=args.max_memory_gb,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> BenchResults:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    results = run_sweep(
        config, progress=not args.no_progress, command=shlex.join(["python", "-m", "flashlab.bench", *argv])
    )
    json_path, csv_path = results.save(args.out or default_prefix(results.meta))
    print(summary_table(results))
    print(f"wrote {json_path} and {csv_path}")
    return results


if __name__ == "__main__":
    main()
