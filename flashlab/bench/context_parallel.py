"""Context parallelism timed: ring attention against all-gather attention and one GPU, forward + backward.

Run under torchrun, one process per GPU (NCCL), or on CPU processes (gloo) with tiny shapes::

    torchrun --nproc-per-node 2 -m flashlab.bench.context_parallel --seq-len 128k --out results/cp

Every rank holds its slice of the sequence (``flashlab.distributed``). Before anything is timed, each method's
output and gradients at ``--check-len`` positions are compared, on every rank, with one-process
``flash_attention`` on the gathered sequence and the output with the float64 reference on a sample of rows; a
method that fails the check is reported and not timed. Then each method runs ``--warmup`` untimed and ``--rep``
timed steps of forward + backward; a step's time is the slowest rank's (the ranks wait for each other at the
next layer), and the median step is reported. The one-GPU baseline runs the whole sequence on rank 0 alone.
``speedup`` is the one-GPU time over the method's: ``world`` at perfect scaling.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashlab import flash_attention
from flashlab.bench.args import size_list
from flashlab.bench.stamp import environment_stamp
from flashlab.calculators.roofline import attention_backward_flops, attention_flops
from flashlab.core.numerics import grad_tolerance, relative_error, tolerance
from flashlab.distributed import LAYOUTS, all_gather_attention, ring_attention, shard_sequence
from flashlab.reference.torch_float64 import attention_float64

METHODS = {"ring": ring_attention, "all_gather": all_gather_attention}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECK_ROWS = 64  # rows of the float64 check per rank


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.bench --mode context-parallel", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--mode", default="context-parallel", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=lambda s: size_list(s)[0], default=128 * 1024, help="whole sequence N ('128k')")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D")
    p.add_argument("--heads", type=int, default=16, help="query heads H (16 x 128 = a 2048-wide model)")
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention); default: --heads")
    p.add_argument("--batch", type=int, default=1, help="batch B")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--layout", choices=LAYOUTS, default="head_tail")
    p.add_argument("--methods", default="ring,all_gather", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--no-one-gpu", action="store_true", help="skip the whole sequence on rank 0 alone")
    p.add_argument("--check-len", type=lambda s: size_list(s)[0], default=4096, help="N of the correctness check")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per method")
    p.add_argument("--rep", type=int, default=10, help="timed steps per method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write PREFIX.json (rank 0)")
    return p


def make_inputs(b, hq, hk, n, d, dtype, device, seed):
    """The whole sequence's q, k, v and dO, the same on every rank (one seed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(b, hq, n, d), (b, hk, n, d), (b, hk, n, d), (b, hq, n, d)]
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


def local_inputs(b, hq, hk, n, d, dtype, device, seed, world, rank):
    """This rank's slice of the sequence, drawn here from its own seed: the whole sequence never exists on one
    rank (the timings do not depend on the values)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    nl = n // world
    shapes = [(b, hq, nl, d), (b, hk, nl, d), (b, hk, nl, d), (b, hq, nl, d)]
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


def forward_backward(fn, q, k, v, do, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def check_method(name, args, world, rank, device) -> dict:
    """Errors of one method at ``--check-len`` on this rank, worst over the ranks: o against float64 on sampled
    rows and against one-process flash_attention, and each gradient against one-process flash_attention."""
    dtype, causal, n = DTYPES[args.dtype], args.causal == "yes", args.check_len
    hk = args.kv_heads or args.heads
    whole = make_inputs(args.batch, args.heads, hk, n, args.head_dim, dtype, device, args.seed)
    mine = [shard_sequence(x, world, rank, args.layout) for x in whole]
    out = forward_backward(METHODS[name], *mine, causal=causal, layout=args.layout)
    ref = forward_backward(flash_attention, *whole, causal=causal)
    errors = {}
    for key, got, want in zip(("o", "dq", "dk", "dv"), out, ref, strict=True):
        errors[key] = relative_error(got.float().cpu().numpy(), shard_sequence(want, world, rank, args.layout)
                                     .float().cpu().numpy())  # fmt: skip
    positions = shard_sequence(torch.arange(n).view(1, 1, n, 1), world, rank, args.layout).flatten()
    sample = positions[torch.linspace(0, len(positions) - 1, min(CHECK_ROWS, len(positions))).long()]
    o64, _ = attention_float64(whole[0], whole[1], whole[2], causal, rows=sample.to(device))
    local_rows = torch.linspace(0, len(positions) - 1, len(sample)).long().to(device)
    errors["o_float64"] = relative_error(out[0][:, :, local_rows].double().cpu().numpy(), o64.cpu().numpy())
    worst = torch.tensor([errors[k] for k in sorted(errors)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    errors = dict(zip(sorted(errors), worst.tolist(), strict=True))
    allowed = {k: tolerance(dtype) if k.startswith("o") else grad_tolerance(dtype) for k in errors}
    return {"errors": errors, "ok": all(errors[k] <= allowed[k] for k in errors)}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, warmup, rep, device, together=True) -> float:
    """Median seconds of ``step()`` over ``rep`` runs; ``together``: every rank starts each run at once, and a
    run's time is the slowest rank's."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(rep):
        if together:
            dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if together:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def measure(args, device) -> list[dict]:
    """Every method's row (and the one-GPU baseline's), the same on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype, causal, n, d = DTYPES[args.dtype], args.causal == "yes", args.seq_len, args.head_dim
    hk = args.kv_heads or args.heads
    flops = args.batch * args.heads * (attention_flops(n, d, causal) + attention_backward_flops(n, d, causal))
    base = dict(world=world, seq_len=n, batch=args.batch, heads=args.heads, kv_heads=hk, head_dim=d,
                dtype=args.dtype, causal=causal, layout=args.layout, flops=flops)  # fmt: skip
    rows = []
    one_gpu_s = None
    if not args.no_one_gpu:
        t = math.nan
        if rank == 0:
            q, k, v, do = make_inputs(args.batch, args.heads, hk, n, d, dtype, device, args.seed)
            step = functools.partial(forward_backward, flash_attention, q, k, v, do, causal=causal)
            t = time_steps(step, args.warmup, args.rep, device, together=False)
            del q, k, v, do
        shared = torch.tensor([t], dtype=torch.float64, device=device)
        dist.broadcast(shared, src=0)
        one_gpu_s = float(shared)
        rows.append({**base, "method": "one_gpu", "world": 1, "time_ms": one_gpu_s * 1e3, "speedup": 1.0,
                     "tflops": flops / one_gpu_s / 1e12, "check": None})  # fmt: skip
    for name in [m for m in args.methods.split(",") if m]:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
        check = check_method(name, args, world, rank, device)
        row = {**base, "method": name, "check": check, "time_ms": None, "speedup": None, "tflops": None}
        if check["ok"]:
            q, k, v, do = local_inputs(args.batch, args.heads, hk, n, d, dtype, device, args.seed, world, rank)
            step = functools.partial(forward_backward, METHODS[name], q, k, v, do, causal=causal, layout=args.layout)
            t = time_steps(step, args.warmup, args.rep, device)
            row.update(time_ms=t * 1e3, tflops=flops / t / 1e12)
            if one_gpu_s is not None:
                row["speedup"] = one_gpu_s / t
        rows.append(row)
    return rows


def summary(rows) -> str:
    lines = [f"{'method':<11} {'GPUs':>4} {'ms':>10} {'TFLOP/s':>8} {'speedup':>8}  check"]
    for r in rows:
        ms = "-" if r["time_ms"] is None else f"{r['time_ms']:.2f}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        check = "" if r["check"] is None else ("ok " if r["check"]["ok"] else "FAILED ") + ", ".join(
            f"{k} {v:.1e}" for k, v in r["check"]["errors"].items())  # fmt: skip
        lines.append(f"{r['method']:<11} {r['world']:>4} {ms:>10} {tf:>8} {sp:>8}  {check}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    started_here = not dist.is_initialized()
    if started_here and "RANK" not in os.environ:
        raise SystemExit(
            "context-parallel runs one process per GPU: launch it with torchrun, e.g. torchrun --nproc-per-node 2 "
            "-m flashlab.bench.context_parallel --seq-len 128k"
        )
    if started_here:  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        rows = measure(args, device)
        if dist.get_rank() == 0:
            print(summary(rows))
            if args.out:
                meta = environment_stamp(device.type)
                mode = [] if "--mode" in argv else ["--mode", "context-parallel"]
                meta["command"] = " ".join(["python", "-m", "flashlab.bench", *mode, *argv])
                path = Path(f"{args.out}.json")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                print(f"wrote {path}")
        return rows
    finally:
        if started_here:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
