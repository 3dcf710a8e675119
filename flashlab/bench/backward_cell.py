"""Measuring one cell in backward mode (``--mode backward``): the gradients dq, dk, dv from an upstream dO.

For each backend: one forward with autograd recording, then the backward from dO (``torch.autograd.grad(o, (q, k,
v), do)``) is checked against float64 ``torch.autograd`` of the materialised attention
(``flashlab.reference.torch_float64.attention_float64_grads``) on the first batch entry and the first K/V head
(dK and dV need every query row, so rows cannot be sampled as in the forward's check), then its peak extra memory
of forward + backward is recorded, then the backward alone is timed. FLOPs are 2.5x the forward's (the
FlashAttention-2 convention: five matrix products against the forward's two).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashlab.bench.config import BenchConfig
from flashlab.bench.grid import DTYPES, STAMP_COLUMNS, Cell
from flashlab.bench.implementations import Backend
from flashlab.bench.measure import free_memory_bytes, is_oom, one_line, peak_extra_bytes, time_ms
from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.reference.torch_float64 import attention_float64_grads, query_heads

BACKWARD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs
# A materialising backend's backward holds S, P, dP and dS at once: twice its forward's score bytes.
MATERIALISED_BACKWARD_FACTOR = 2


def bench_cell_backward(cell: Cell, backends: Sequence[Backend], config: BenchConfig, meta: dict) -> list[dict]:
    """Check, measure and time every backend's backward on one cell; one result row per backend."""
    device, dtype = config.device, DTYPES[cell.dtype]
    gen = torch.Generator(device=device).manual_seed(config.seed)
    q = torch.randn((cell.batch, cell.heads, cell.nq, cell.head_dim), generator=gen, device=device).to(dtype)
    kv_shape = (cell.batch, cell.hk, cell.seq_len, cell.head_dim)
    k, v = (torch.randn(kv_shape, generator=gen, device=device).to(dtype) for _ in range(2))
    do = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    heads = query_heads([0], cell.heads // cell.hk)
    ref = attention_float64_grads(q, k, v, do, cell.causal, batch=[0], kv_heads=[0])  # float64 (1, g, N, D) ...
    tol = grad_tolerance(dtype)
    flops = BACKWARD_FLOPS_FACTOR * cell.flops
    rows_out = []
    for backend in backends:
        row = dict(
            backend=backend.name, dtype=cell.dtype, head_dim=cell.head_dim, seq_len=cell.seq_len, causal=cell.causal,
            batch=cell.batch, heads=cell.heads, kv_heads=cell.hk, q_len=cell.nq, status="ok", reason="",
            rel_err=float("nan"), max_abs_err=float("nan"), tol=tol, time_ms=float("nan"), tflops=float("nan"),
            bandwidth_gbps=float("nan"), peak_extra_mb=float("nan"), flops=flops,
            io_bytes=2 * cell.io_bytes,  # q, k, v, o, dO read and dq, dk, dv written: twice the forward's
        )  # fmt: skip
        row.update({col: meta[col] for col in STAMP_COLUMNS})
        rows_out.append(row)
        reason = backend.unavailable(device, dtype)
        if reason:
            row.update(status="skipped", reason=reason)
            continue
        if backend.materialises:
            need = MATERIALISED_BACKWARD_FACTOR * backend.workspace_bytes(cell)
            free = free_memory_bytes(device, config.max_memory_gb)
            if need > 0.9 * free:
                row.update(status="oom", reason=f"predicted: S, P, dP, dS need {need / 1e9:.3g} GB, {free / 1e9:.3g}")
                continue
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def train_step(backend=backend, qg=qg, kg=kg, vg=vg):  # forward + backward, nothing kept
            return torch.autograd.grad(backend.run(qg, kg, vg, cell.causal), (qg, kg, vg), do)

        try:
            try:  # 1. check the gradients against float64 autograd before any timing
                grads = train_step()
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                if is_oom(e):
                    raise
                row.update(status="skipped", reason=one_line(f"{e.__class__.__name__}: {e}"))
                continue
            got = (grads[0][[0]][:, heads], grads[1][[0]][:, [0]], grads[2][[0]][:, [0]])
            del grads
            errors = [relative_error(x, r) for x, r in zip(got, ref, strict=True)]
            rel_err = max(errors)
            max_abs = max((x.double() - r).abs().max().item() for x, r in zip(got, ref, strict=True))
            row.update(rel_err=rel_err, max_abs_err=max_abs)
            if not rel_err <= tol:  # NaN fails too
                errs = ", ".join(f"d{n} {e:.3g}" for n, e in zip("qkv", errors, strict=True))
                row.update(status="wrong", reason=f"gradient errors {errs} > tolerance {tol:g}; not timed")
                continue
            # 2. peak extra memory of forward + backward, then 3. the backward alone, from one recorded forward
            row["peak_extra_mb"] = peak_extra_bytes(train_step, device) / 1e6
            o = backend.run(qg, kg, vg, cell.causal)
            inputs = (qg, kg, vg)
            ms = time_ms(lambda o=o, inputs=inputs: torch.autograd.grad(o, inputs, do, retain_graph=True), device,
                         config.warmup, config.rep)  # fmt: skip
            del o
        except Exception as e:  # noqa: BLE001 -- one failing backend must not end the sweep
            if is_oom(e):
                row.update(status="oom", reason=one_line(f"out of memory: {e}"))
            else:
                row.update(status="error", reason=one_line(f"{e.__class__.__name__}: {e}"))
        if row["status"] != "ok":
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        row.update(time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12, bandwidth_gbps=row["io_bytes"] / (ms * 1e-3) / 1e9)
    return rows_out
