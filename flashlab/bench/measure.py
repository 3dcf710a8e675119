"""Measuring one cell: check each backend against the reference, then its peak extra memory, then time them all
in rounds whose order turns (``time_rounds``); and the roofline's two ceilings (copy bandwidth, matmul rate)."""

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


def time_rounds(
    fns: Sequence[Callable], device: str, warmup: float, rep: float, rounds: int
) -> tuple[list[list[float]], dict[int, Exception]]:
    """Each of ``fns``' median milliseconds per call, once per round: ``rounds`` rounds, each timing every function
    for ``rep / rounds`` ms after ``warmup`` ms (``time_ms``), round ``r`` starting at function ``r`` and going on
    in turn. No function is always the one timed first, or always timed just after the same neighbour: on a GPU
    what ran just before (a long check, another kernel heating the chip) moves a timing by several percent, and it
    would otherwise move the same backend every time.

    Returns each function's timings in round order, and the exception of each function that raised (by index; it
    is not timed again)."""
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be a positive int; got {rounds!r}")
    times: list[list[float]] = [[] for _ in fns]
    failed: dict[int, Exception] = {}
    for r in range(rounds):
        for i in range(len(fns)):
            turn = (r + i) % len(fns)
            if turn in failed:
                continue
            try:
                times[turn].append(time_ms(fns[turn], device, warmup, rep / rounds))
            except Exception as e:  # noqa: BLE001 -- the caller records it; the others are still timed
                failed[turn] = e
    return times, failed


def host_us_rounds(fn: Callable, device: str, calls: int = 40, rounds: int = 11, warmup: int = 10) -> list[float]:
    """Host microseconds per eager call, once per round: after ``warmup`` calls, ``rounds`` loops of ``calls``
    calls, each started with the GPU idle, each loop's wall time before its synchronise divided by its calls.
    Where a call's GPU work is longer than its host work, the launches queue up behind the GPU (the queue is deep
    enough that the host does not wait; on some hosts each launch then costs more). Empty on the CPU, where the
    interpreter runs the kernel on the host."""
    if device != "cuda":
        return []
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return per_call


def host_us(fn: Callable, device: str, calls: int = 40, rounds: int = 11, warmup: int = 10) -> float:
    """Host microseconds per eager call: the fastest of ``host_us_rounds``' rounds, as Python's ``timeit``
    advises (the work is the same every call; other processes and a preempted thread only ever add to a round,
    so the fastest round is the cost itself). NaN on the CPU."""
    per_call = host_us_rounds(fn, device, calls, rounds, warmup)
    return min(per_call) if per_call else float("nan")


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


class NotTimed(Exception):
    """A backend was not timed on a cell, and why: ``status`` is "skipped", "oom", "wrong" or "error"."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, _one_line(reason)


def make_inputs(cell: Cell, config: BenchConfig):
    """Fresh random q ``(B, H, Nq, D)`` and k, v ``(B, Hk, Nk, D)`` for one cell, on the sweep's device."""
    device, dtype = config.device, DTYPES[cell.dtype]
    gen = torch.Generator(device=device).manual_seed(config.seed)
    q = torch.randn((cell.batch, cell.heads, cell.nq, cell.head_dim), generator=gen, device=device).to(dtype)
    kv_shape = (cell.batch, cell.hk, cell.seq_len, cell.head_dim)
    k, v = (torch.randn(kv_shape, generator=gen, device=device).to(dtype) for _ in range(2))
    return q, k, v


def empty_row(cell: Cell, backend: Backend, meta: dict) -> dict:
    """A result row before anything ran: the cell, the backend, the stamp; numbers NaN until measured."""
    nan = float("nan")
    tol = TOLERANCE[cell.dtype] if backend.tolerance is None else backend.tolerance
    row = dict(
        backend=backend.name, dtype=cell.dtype, head_dim=cell.head_dim, seq_len=cell.seq_len, causal=cell.causal,
        batch=cell.batch, heads=cell.heads, kv_heads=cell.hk, q_len=cell.nq, status="ok", reason="",
        rel_err=nan, max_abs_err=nan, tol=tol, time_ms=nan, tflops=nan, bandwidth_gbps=nan,
        peak_extra_mb=nan, host_us=nan, host_us_median=nan, time_spread=nan, flops=cell.flops,
        io_bytes=backend.io_bytes(cell),
    )  # fmt: skip
    row.update({col: meta[col] for col in STAMP_COLUMNS})
    return row


def precheck(cell: Cell, backend: Backend, config: BenchConfig) -> None:
    """Raise ``NotTimed`` before running a backend that cannot run here, or whose score matrix would not fit."""
    reason = backend.unavailable(config.device, DTYPES[cell.dtype])
    if reason:
        raise NotTimed("skipped", reason)
    if backend.materialises:
        need = backend.workspace_bytes(cell)
        free = _free_memory_bytes(config.device, config.max_memory_gb)
        if need > 0.9 * free:
            what = "S and P" if cell.hk == cell.heads else "S, P and K/V repeated per query head"
            raise NotTimed("oom", f"predicted: {what} need {need / 1e9:.3g} GB, {free / 1e9:.3g} GB free")


def check_output(fn: Callable, cell: Cell, ref, rows, batches, device: str) -> tuple[float, float]:
    """Run ``fn`` once and compare the checked slice with the float64 reference: ``(rel_err, max_abs_err)``.

    Raises ``NotTimed`` when the backend refuses the problem ("skipped", with PyTorch's own reasons), returns the
    wrong shape, or misses the dtype's tolerance ("wrong": never timed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            if _is_oom(e):
                raise
            why = "; ".join(dict.fromkeys(str(w.message).strip() for w in caught)) or str(e)
            raise NotTimed("skipped", f"{e.__class__.__name__}: {why}") from e
    _sync(device)
    shape = (cell.batch, cell.heads, cell.nq, cell.head_dim)
    if tuple(out.shape) != shape:
        raise NotTimed("wrong", f"output shape {tuple(out.shape)}, expected {shape}")
    diff = out[batches][:, :, rows].double() - ref  # (b, H, R, D)
    del out
    rel_err = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref)).item()
    return rel_err, diff.abs().max().item()


def bench_cell(cell: Cell, backends: Sequence[Backend], config: BenchConfig, meta: dict) -> list[dict]:
    """Check and measure every backend on one cell, then time them together; one result row per backend.

    1. check against the float64 reference on sampled rows of the first and last batch entries (never timed if
       wrong); 2. peak extra memory of one call (decode: the host time per call too); 3. the median time over
       ``config.rounds`` rounds of every backend that passed, the order turning each round (``time_rounds``), and
       its spread, (slowest - fastest round) / median. The JSON rows keep each round's time (``round_ms``) and
       the backend's place in that round's order (``round_position``, 0: timed first), so an order effect
       can be read off a recording."""
    device = config.device
    q, k, v = make_inputs(cell, config)
    rows = check_rows(cell.nq, config.check_rows).to(device)
    batches = sorted({0, cell.batch - 1})  # the first and last batch entries
    ref = reference_rows(q[batches], k[batches], v[batches], cell.causal, rows)  # (b, H, R, D) float64
    rows_out, timed = [], []
    for backend in backends:
        row = empty_row(cell, backend, meta)
        rows_out.append(row)

        def fn(backend=backend):
            return backend.run(q, k, v, cell.causal)

        try:
            precheck(cell, backend, config)
            own_ref = ref
            if backend.stands_for is not None:  # inputs in fewer bits: checked against what they stand for
                own_ref = reference_rows(*backend.stands_for(q[batches], k[batches], v[batches]), cell.causal, rows)
            rel_err, max_abs = check_output(fn, cell, own_ref, rows, batches, device)
            row.update(rel_err=rel_err, max_abs_err=max_abs)
            if not rel_err <= row["tol"]:  # NaN fails too
                raise NotTimed("wrong", f"relative error {rel_err:.3g} > tolerance {row['tol']:g}; not timed")
            row["peak_extra_mb"] = peak_extra_bytes(fn, device) / 1e6
            if cell.nq != cell.seq_len:  # decode: the host's launch work is a large part of a short step
                per_round = host_us_rounds(fn, device)
                if per_round:  # the fastest round (host_us' reading), and the median one beside it
                    row.update(host_us=min(per_round), host_us_median=statistics.median(per_round))
            timed.append((row, fn))
        except NotTimed as e:
            row.update(status=e.status, reason=e.reason)
        except Exception as e:  # noqa: BLE001 -- one failing backend must not end the sweep
            _record_failure(row, e, device)
    if timed:
        per_round, failed = time_rounds([fn for _, fn in timed], device, config.warmup, config.rep, config.rounds)
        for i, ((row, _), times) in enumerate(zip(timed, per_round, strict=True)):
            if i in failed:
                _record_failure(row, failed[i], device)
                continue
            ms = statistics.median(times)
            row.update(
                time_ms=ms, time_spread=(max(times) - min(times)) / ms, tflops=cell.flops / (ms * 1e-3) / 1e12,
                bandwidth_gbps=row["io_bytes"] / (ms * 1e-3) / 1e9,
                round_ms=times, round_position=[(i - r) % len(timed) for r in range(len(times))],
            )  # fmt: skip
    return rows_out


def _record_failure(row: dict, e: BaseException, device: str) -> None:
    """Mark ``row`` as failed by ``e`` ("oom" or "error", with the reason) and hand the failure's memory back."""
    status = "oom" if _is_oom(e) else "error"
    row.update(status=status, reason=_one_line(f"{'out of memory' if _is_oom(e) else e.__class__.__name__}: {e}"))
    if device == "cuda":  # the exception and its frames are gone now: hand their memory back
        torch.cuda.empty_cache()


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


# shared with the backward mode (flashlab.bench.backward_cell)
free_memory_bytes, is_oom, one_line = _free_memory_bytes, _is_oom, _one_line
