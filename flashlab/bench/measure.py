"""Measuring one cell: check each backend against the reference, then its peak extra memory, then its median
time; and the roofline's two ceilings (copy bandwidth, matmul rate)."""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from flashlab.bench.config import BenchConfig
from flashlab.bench.grid import DTYPES, STAMP_COLUMNS, TOLERANCE, Cell
from flashlab.bench.implementations import Backend, reference_rows

# ----------------------------------------------------------------------------------------------------------------
# Measuring one cell


def check_rows(n: int, count: int) -> torch.Tensor:
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
    rows = check_rows(cell.nq, config.check_rows).to(device)
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


# shared with the backward mode (flashlab.bench.backward)
free_memory_bytes, is_oom, one_line = _free_memory_bytes, _is_oom, _one_line
