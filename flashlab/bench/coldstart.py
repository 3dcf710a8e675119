"""The first call of 40 assorted shapes, timed in a fresh process whose Triton cache starts empty.

    python -m flashlab.bench --mode coldstart             # on a GPU: the 40 first calls, then again after warm-up
    python -m flashlab.bench --mode coldstart --dry-run   # list the calls, run nothing

What a new user meets first is not the kernel's speed but its first calls: each new kind of call compiles
kernels (Triton's JIT, flashlab's own launcher) and autotunes them before it returns. This mode measures that. A
child process (``python -c``, ``CHILD``) starts with ``TRITON_CACHE_DIR`` set to an empty
temporary folder, imports torch and flashlab (timed), and makes each call of ``CALLS`` once: its inputs are made
and the GPU synchronised first, so a call's time is that call alone, from the Python call to its result on the
device. The same call is then made a second time (a warm call, for contrast) and its output checked against the
float64 reference (``flashlab.reference.torch_float64``) on a sample of query rows.

Then, where the package has a ``flashlab.warmup`` module, the same is done again after ``python -m
flashlab.warmup`` has run in its own process against a second empty cache folder (its flags are read from its
``--help`` and recorded; ``--warmup-args`` passes it flags): what a warm-up ahead of time saves the first calls.
Without that module the second phase is skipped, and the results say so.

``CALLS`` is a fixed list, in the order made: prefill and decode, head dims 16 to 256 (powers of two and not),
float16, bfloat16 and float32, full and causal masks, sliding windows, grouped-query heads, chunked prefill
(fewer queries than keys), lengths from 1 to 70,000 keys, and two paged-cache decode calls. Every call is a
*first* of its kind in the process except where the list says it shares a compiled kernel with an earlier one.

Results: ``PREFIX.json`` (meta, rows), ``PREFIX.csv`` and ``PREFIX.txt`` (the printed table); by default
``data/results/<gpu>-coldstart-<date>`` on a GPU, ``test-artifacts/bench/cpu-coldstart-<date>`` on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from flashlab.bench.args import output_prefix, whole_number
from flashlab.bench.grid import STAMP_COLUMNS
from flashlab.bench.results import default_folder, folder_problem, output_problem, recording_prefix, save_tables

CHECK_ROWS = 16  # query rows per call checked against float64


@dataclass(frozen=True)
class FirstCall:
    """One call: q ``(batch, q_heads, nq, head_dim)``, k and v ``(batch, kv_heads, nk, head_dim)``; ``window`` as
    ``flashlab.core.masking`` (bottom-right aligned); ``block_size``: the keys in a shuffled paged pool of blocks
    this size, called through ``flash_attention_with_kvcache`` (decode), else ``flash_attention``."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    nq: int
    nk: int
    head_dim: int
    dtype: str
    causal: bool = False
    window: tuple | None = None
    block_size: int | None = None

    @property
    def kind(self) -> str:
        if self.block_size:
            return "paged decode"
        return "decode" if self.nq <= 16 and self.nq < self.nk else "prefill"


# fmt: off
CALLS = (
    # prefill, one K/V head per query head: the common head dims and dtypes
    FirstCall("prefill bf16 D128", 1, 16, 16, 4096, 4096, 128, "bf16"),
    FirstCall("prefill bf16 D128 causal", 1, 16, 16, 4096, 4096, 128, "bf16", causal=True),
    FirstCall("prefill fp16 D64 causal", 2, 32, 32, 2048, 2048, 64, "fp16", causal=True),
    FirstCall("prefill fp16 D64 odd length", 1, 32, 32, 1000, 1000, 64, "fp16"),
    FirstCall("prefill bf16 D256 causal", 1, 8, 8, 2048, 2048, 256, "bf16", causal=True),
    FirstCall("prefill fp16 D256", 1, 8, 8, 777, 777, 256, "fp16"),
    FirstCall("prefill fp32 D32 causal", 1, 4, 4, 513, 513, 32, "fp32", causal=True),
    FirstCall("prefill fp32 D64", 1, 8, 8, 1024, 1024, 64, "fp32"),
    FirstCall("prefill bf16 D32 causal", 1, 16, 16, 8192, 8192, 32, "bf16", causal=True),
    FirstCall("prefill bf16 D96 causal", 1, 16, 16, 3000, 3000, 96, "bf16", causal=True),
    FirstCall("prefill fp16 D80", 1, 16, 16, 1500, 1500, 80, "fp16"),
    FirstCall("prefill bf16 D160 causal", 1, 8, 8, 1200, 1200, 160, "bf16", causal=True),
    FirstCall("prefill bf16 D192 causal", 1, 8, 8, 4096, 4096, 192, "bf16", causal=True),
    FirstCall("prefill bf16 D128 16K causal", 1, 16, 16, 16384, 16384, 128, "bf16", causal=True),
    FirstCall("prefill bf16 D128 70K causal", 1, 8, 8, 70000, 70000, 128, "bf16", causal=True),
    FirstCall("prefill fp16 D128 50K", 1, 4, 4, 50000, 50000, 128, "fp16"),
    FirstCall("prefill bf16 D64 short batch", 16, 32, 32, 128, 128, 64, "bf16", causal=True),
    FirstCall("prefill fp32 D16 length 17", 1, 2, 2, 17, 17, 16, "fp32"),
    FirstCall("prefill bf16 D128 length 1", 1, 16, 16, 1, 1, 128, "bf16"),
    # sliding windows
    FirstCall("prefill fp16 D64 32K window 4K", 1, 16, 16, 32768, 32768, 64, "fp16", causal=True,
              window=(4096, 0)),
    FirstCall("prefill bf16 D128 window 1K", 1, 16, 16, 8192, 8192, 128, "bf16", causal=True, window=(1024, 0)),
    FirstCall("prefill bf16 D128 local window", 1, 16, 16, 4096, 4096, 128, "bf16", window=(256, 256)),
    # grouped-query heads
    FirstCall("prefill bf16 D128 GQA 4", 1, 32, 8, 4096, 4096, 128, "bf16", causal=True),
    FirstCall("prefill fp16 D64 GQA 8", 1, 16, 2, 2048, 2048, 64, "fp16", causal=True),
    FirstCall("prefill bf16 D128 GQA 8", 2, 64, 8, 1024, 1024, 128, "bf16"),
    FirstCall("prefill fp32 D128 GQA 2 causal", 1, 8, 4, 2000, 2000, 128, "fp32", causal=True),
    FirstCall("prefill bf16 D256 GQA 4 16K", 1, 16, 4, 16384, 16384, 256, "bf16", causal=True),
    # chunked prefill: a chunk of new queries against every key so far
    FirstCall("chunk bf16 D128 512 of 8K", 1, 16, 16, 512, 8192, 128, "bf16", causal=True),
    FirstCall("chunk fp16 D64 GQA 4 333 of 4444", 1, 16, 4, 333, 4444, 64, "fp16", causal=True),
    # decode: a few query rows against a cache (the split-KV path)
    FirstCall("decode bf16 D128 4K", 1, 32, 8, 1, 4096, 128, "bf16"),
    FirstCall("decode bf16 D128 32K B8", 8, 32, 8, 1, 32768, 128, "bf16"),
    FirstCall("decode bf16 D128 70K", 1, 64, 8, 1, 70000, 128, "bf16"),
    FirstCall("decode fp16 D64 1000", 4, 16, 16, 1, 1000, 64, "fp16"),
    FirstCall("decode fp16 D256 MQA", 2, 8, 1, 1, 8192, 256, "fp16"),
    FirstCall("decode fp32 D128 2K", 1, 8, 8, 1, 2048, 128, "fp32"),
    FirstCall("decode bf16 D128 4 rows causal", 1, 32, 8, 4, 16384, 128, "bf16", causal=True),
    FirstCall("decode bf16 D96 5000", 1, 12, 4, 1, 5000, 96, "bf16"),
    FirstCall("decode bf16 D128 32K window 4K", 1, 32, 8, 1, 32768, 128, "bf16", causal=True, window=(4095, 0)),
    # paged decode: the cache in a shuffled pool of blocks
    FirstCall("paged decode bf16 D128 blocks 16", 8, 32, 8, 1, 32768, 128, "bf16", block_size=16),
    FirstCall("paged decode bf16 D128 blocks 256", 8, 32, 8, 1, 32768, 128, "bf16", block_size=256),
)
# fmt: on
# On the CPU (Triton's interpreter) the same calls at toy sizes: the code path, not a measurement.
QUICK_CAP = dict(batch=1, heads=2, length=48)

ROW_COLUMNS = (
    "phase", "index", "name", "kind", "batch", "q_heads", "kv_heads", "nq", "nk", "head_dim", "dtype", "causal",
    "window", "block_size", "status", "reason", "first_ms", "second_ms", "rel_err", "tol",
) + STAMP_COLUMNS  # fmt: skip


def quick_call(call: FirstCall) -> FirstCall:
    """``call`` at toy sizes for the interpreter: batch 1, at most 2 K/V heads, lengths at most 48."""
    group = call.q_heads // call.kv_heads
    kv = min(call.kv_heads, QUICK_CAP["heads"])
    nk = min(call.nk, QUICK_CAP["length"])
    nq = min(call.nq, nk) if call.nq < call.nk else nk
    window = None if call.window is None else tuple(None if w is None else min(w, nk // 4) for w in call.window)
    return replace(call, batch=1, kv_heads=kv, q_heads=kv * min(group, 2), nq=nq, nk=nk, window=window)


def call_lines(calls: Sequence[FirstCall]) -> list[str]:
    lines = [f"{'#':>2} {'call':<36} {'kind':<12} {'B':>2} {'Hq':>3} {'Hk':>3} {'Nq':>6} {'Nk':>6} {'D':>4} "
             f"{'dtype':<5} mask"]  # fmt: skip
    for i, c in enumerate(calls):
        mask = "causal" if c.causal else "full"
        if c.window:
            mask += f" window {c.window}"
        if c.block_size:
            mask += f", blocks of {c.block_size}"
        lines.append(f"{i:>2} {c.name:<36} {c.kind:<12} {c.batch:>2} {c.q_heads:>3} {c.kv_heads:>3} {c.nq:>6} "
                     f"{c.nk:>6} {c.head_dim:>4} {c.dtype:<5} {mask}")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The child: one fresh process


def _inputs(call: FirstCall, device: str, seed: int):
    import torch

    from flashlab.bench.grid import DTYPES

    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[call.dtype]

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    q = randn(call.batch, call.q_heads, call.nq, call.head_dim)  # (B, Hq, Nq, D)
    k = randn(call.batch, call.kv_heads, call.nk, call.head_dim)  # (B, Hk, Nk, D)
    v = randn(call.batch, call.kv_heads, call.nk, call.head_dim)
    return q, k, v


def _make_call(call: FirstCall, q, k, v, seed: int):
    """The call itself, as a function of nothing: inputs (and a paged pool) made beforehand."""
    from flashlab.host import flash_attention, flash_attention_with_kvcache

    if call.block_size:
        from flashlab.kernels.decode.kvcache import paged_kv_cache

        kc, vc, table, seqlens = paged_kv_cache(k, v, call.block_size, seed=seed)  # (blocks, bs, Hk, D)
        return lambda: flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=call.causal,
                                                    window=call.window)  # fmt: skip
    return lambda: flash_attention(q, k, v, causal=call.causal, window=call.window)


# The child's first lines: the clock starts before torch and flashlab are imported.
CHILD = (
    "import sys, time; start = time.perf_counter(); import torch, flashlab.host; "
    "from flashlab.bench import coldstart; coldstart.child_main(start, *sys.argv[1:])"
)


def child_main(start: float, calls_path: str, out_path: str, device: str, seed: str) -> None:
    """The child process's work: read the calls, make them, write the results (``import_s`` from ``start``)."""
    import_s = time.perf_counter() - start
    cache = os.environ.get("TRITON_CACHE_DIR")
    files_at_start = sum(len(files) for _, _, files in os.walk(cache)) if cache else None
    calls = [FirstCall(**{**c, "window": tuple(c["window"]) if c["window"] else None})
             for c in json.loads(Path(calls_path).read_text())]  # fmt: skip
    head = dict(import_s=import_s, triton_cache_dir=cache, cache_files_at_start=files_at_start)

    def write(rows):  # after every call: a child stopped at its time limit leaves the calls it finished
        Path(out_path).write_text(json.dumps(dict(**head, rows=rows)))

    write([])
    child(calls, device, int(seed), write)


def child(calls: Sequence[FirstCall], device: str, seed: int, written=None) -> dict:
    """Make each call twice (first, then warm), timed, and check it: ``{"rows": [...]}``; ``written(rows)`` is
    called with the rows so far after each call."""
    import torch

    from flashlab.core.numerics import relative_error, tolerance
    from flashlab.reference.torch_float64 import attention_float64

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    rows = []
    for i, call in enumerate(calls):
        row = dict(index=i, **{k: v for k, v in asdict(call).items()}, kind=call.kind, status="ok", reason=None,
                   first_ms=None, second_ms=None, rel_err=None, tol=None)  # fmt: skip
        try:
            q, k, v = _inputs(call, device, seed + i)
            run = _make_call(call, q, k, v, seed + i)
            times = []
            for _ in range(2):  # the first call, then the same call warm
                sync()
                t0 = time.perf_counter()
                o = run()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            row["first_ms"], row["second_ms"] = times
            rows_checked = torch.unique(torch.linspace(0, call.nq - 1, min(call.nq, CHECK_ROWS)).round().long())
            ref, _ = attention_float64(q, k, v, causal=call.causal, window=call.window, rows=rows_checked.to(device))
            row["rel_err"] = relative_error(o[:, :, rows_checked.to(device)].double().cpu(), ref.cpu())
            row["tol"] = tolerance(q.dtype)
            if not row["rel_err"] <= row["tol"]:
                row.update(status="wrong", reason=f"relative error {row['rel_err']:.3g} > {row['tol']:g}")
            del q, k, v, o, run
        except Exception as e:  # noqa: BLE001 -- recorded in the row; the next call still runs
            row.update(status="error", reason=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if written is not None:
            written(rows)
    return dict(rows=rows)


def run_child(calls: Sequence[FirstCall], device: str, seed: int, cache_dir: str, timeout: float) -> dict:
    """``child`` in a fresh interpreter with ``TRITON_CACHE_DIR=cache_dir``; its JSON, plus its whole wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        calls_path, out_path = Path(tmp) / "calls.json", Path(tmp) / "out.json"
        calls_path.write_text(json.dumps([asdict(c) for c in calls]))
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        command = [sys.executable, "-c", CHILD, str(calls_path), str(out_path), device, str(seed)]
        start = time.perf_counter()
        stopped = None
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = f"the child process was stopped at its time limit, --timeout {timeout:g} s"
        wall_s = time.perf_counter() - start
        if stopped is None and done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"the coldstart child process failed (exit {done.returncode}): " + " | ".join(tail))
        if not out_path.exists():
            raise RuntimeError(f"{stopped} before it imported flashlab")
        result = json.loads(out_path.read_text())
    result.update(wall_s=wall_s, stopped=stopped)
    return result


def warmup_module_present() -> bool:
    """Whether this flashlab has ``flashlab.warmup`` (looked up, not imported)."""
    return importlib.util.find_spec("flashlab.warmup") is not None


def run_warmup(cache_dir: str, extra: Sequence[str], timeout: float) -> dict:
    """``python -m flashlab.warmup`` (its ``--help`` first, recorded) with ``TRITON_CACHE_DIR=cache_dir``."""
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
    helped = subprocess.run([sys.executable, "-m", "flashlab.warmup", "--help"], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    command = [sys.executable, "-m", "flashlab.warmup", *extra]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return dict(command=shlex.join(["python", "-m", "flashlab.warmup", *extra]), help=helped.stdout.strip(),
                returncode=done.returncode, wall_s=time.perf_counter() - start,
                output_tail=(done.stdout + done.stderr).strip().splitlines()[-10:])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The table


def summary(results: dict) -> str:
    m = results["meta"]
    out = [f"{m['device_name']}, torch {m['torch']}, triton {m['triton']}, {m['date']} -- first calls in a fresh "
           f"process, empty Triton cache"]  # fmt: skip
    for phase in m["phases"]:
        rows = [r for r in results["rows"] if r["phase"] == phase["phase"]]
        out += ["", f"{phase['phase']}: child process {phase['wall_s']:.1f} s, of which importing torch and flashlab "
                f"{phase['import_s']:.1f} s" + (f"; warm-up {phase['warmup_s']:.1f} s before it"
                                                if phase.get("warmup_s") is not None else "")]  # fmt: skip
        out.append(f"{'#':>2} {'call':<36} {'first ms':>10} {'second ms':>10}  status")
        for r in rows:
            first = "-" if r["first_ms"] is None else f"{r['first_ms']:.1f}"
            second = "-" if r["second_ms"] is None else f"{r['second_ms']:.2f}"
            status = "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            out.append(f"{r['index']:>2} {r['name']:<36} {first:>10} {second:>10}  {status}")
        timed = [r for r in rows if r["first_ms"] is not None]
        total = sum(r["first_ms"] for r in timed) / 1e3
        warm = sum(r["second_ms"] for r in timed) / 1e3
        out.append(
            f"   first calls together: {total:.1f} s over {len(timed)} calls (the same calls warm: {warm:.2f} s)"
        )
    for note in m.get("notes", []):
        out.append(f"note: {note}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.bench --mode coldstart", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--mode", default="coldstart", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="list the calls; run nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="the calls at toy sizes (batch 1, 2 K/V heads, <= 48 keys)")
    p.add_argument("--limit", type=whole_number(1, len(CALLS)), help="only the first LIMIT calls of the list")
    p.add_argument("--no-warmup", action="store_true", help="skip the second phase (after python -m flashlab.warmup)")
    p.add_argument("--warmup-args", default="", help="flags for python -m flashlab.warmup, as one string")
    p.add_argument("--timeout", type=whole_number(1), default=1800, help="seconds a child process may take")
    p.add_argument("--seed", type=whole_number(0), default=0, help="random seed for q, k, v")
    p.add_argument(
        "--out",
        type=output_prefix,
        help="write PREFIX.json, PREFIX.csv and PREFIX.txt (default: "
        "data/results/<gpu>-coldstart-<date> on a GPU, test-artifacts/bench/cpu-coldstart-<date> on the CPU)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the files of an --out that exist")
    return p


def default_prefix(meta: dict) -> Path:
    return recording_prefix(meta, "coldstart")


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    calls = [quick_call(c) for c in CALLS] if args.quick else list(CALLS)
    calls = calls[: args.limit] if args.limit else calls
    if args.dry_run:
        print("\n".join(call_lines(calls)))
        return None
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    problem = output_problem(args.out, args.overwrite) if args.out else folder_problem(default_folder(
        device == "cuda"))  # fmt: skip
    if problem:
        parser.error(f"--out {args.out}: {problem}" if args.out else f"{problem} (or pass --out)")
    from flashlab.bench.stamp import environment_stamp

    meta = environment_stamp(device)
    mode = [] if "--mode" in argv else ["--mode", "coldstart"]
    meta.update(mode="coldstart", command=shlex.join(["python", "-m", "flashlab.bench", *mode, *argv]),
                config=dict(mode="coldstart", quick=args.quick, calls=len(calls), seed=args.seed),
                timing="time.perf_counter around each call, the GPU synchronised before and after it",
                phases=[], notes=[])  # fmt: skip
    rows = []
    phases = [("cold", False)]
    if not args.no_warmup:
        if warmup_module_present():
            phases.append(("after warmup", True))
        else:
            meta["notes"].append("flashlab.warmup does not exist in this flashlab: the after-warmup phase is skipped")
    for phase, warm_first in phases:
        with tempfile.TemporaryDirectory(prefix="flashlab-coldstart-") as cache_dir:
            record = dict(phase=phase, warmup_s=None)
            if warm_first:
                warmed = run_warmup(cache_dir, shlex.split(args.warmup_args), args.timeout)
                record.update(warmup_s=warmed["wall_s"], warmup=warmed)
                if warmed["returncode"] != 0:
                    meta["notes"].append(f"{warmed['command']} exited {warmed['returncode']}: "
                                         + " | ".join(warmed["output_tail"][-3:]))  # fmt: skip
            result = run_child(calls, device, args.seed, cache_dir, args.timeout)
        record.update(wall_s=result["wall_s"], import_s=result["import_s"],
                      cache_files_at_start=result["cache_files_at_start"])  # fmt: skip
        if result.get("stopped"):
            meta["notes"].append(f"{phase}: {result['stopped']}, after {len(result['rows'])} of {len(calls)} calls")
        meta["phases"].append(record)
        for r in result["rows"]:
            rows.append({"phase": phase, **r, **{col: meta[col] for col in STAMP_COLUMNS}})
    results = dict(meta=meta, rows=rows)
    table = summary(results)
    prefix = args.out or default_prefix(meta)
    json_path, csv_path = save_tables(prefix, results, rows, ROW_COLUMNS, overwrite=args.overwrite)
    txt_path = json_path.with_suffix(".txt")
    txt_path.write_text(table + "\n")
    print(table)
    print(f"wrote {json_path}, {csv_path} and {txt_path}")
    return results


if __name__ == "__main__":
    main()
