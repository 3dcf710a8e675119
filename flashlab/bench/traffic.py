"""Bytes moved, measured: the HBM and L2 traffic of every attention kernel, read from the GPU's own counters.

    python -m flashlab.bench --mode traffic            # the grid below, under Nsight Compute (ncu), on a GPU
    python -m flashlab.bench --mode traffic --quick    # two lengths, one head dim: a smoke test

The lesson's claim is that attention is slow because of the bytes it moves. ``flashlab.calculators.roofline``
counts those bytes; this command measures them. For each backend -- naive attention run kernel by kernel in eager
PyTorch, flashlab's forward (and its backward, ``flashlab.kernels.backward``), SDPA pinned to
FLASH_ATTENTION and to CUDNN_ATTENTION -- and each case (N in 1K..16K, D in 64 and 128, causal and not; batch 1
and H = 2048 / D heads, so every case holds the same 2048-wide model; ``--heads`` fixes the head count instead),
it records per kernel:

- HBM bytes read and written (``dram__bytes_read.sum``, ``dram__bytes_write.sum``),
- L2 traffic (``lts__t_bytes.sum``; and its read and write sectors, 32 bytes each, ``lts__t_sectors_op_read.sum``,
  ``lts__t_sectors_op_write.sum``),
- duration (``gpu__time_duration.sum``) and the kernel's name.

How it works. The command starts itself again under ``ncu --profile-from-start off --clock-control none
--replay-mode kernel`` with a hidden child flag. The child warms every case up (compilation, autotuning, cuDNN's
plan) and checks its output against the float64 reference on a sample of rows, all outside the profiled range;
then it brackets exactly one call with ``cudaProfilerStart`` / ``cudaProfilerStop``, preceded by a one-element
marker kernel (``flashlab_case_marker``). The parent reads ncu's report as CSV and gives every kernel between one
marker and the next to that marker's case, in the order the child's manifest lists them.

Decode has its own backends, run when named: ``paged16``, ``paged256`` (one query token a sequence against a
cache of N tokens in shuffled 16- or 256-token blocks, ``--kv-heads`` K/V heads) and their 8-bit twins
``paged16_fp8``, ``paged256_fp8`` (the same cache in float8 e4m3, checked against float64 of the dequantised
cache). There the count to match is the cache read once; the summary prints each 8-bit case's HBM bytes read over
its 16-bit twin's, whose cache part alone is 0.5x::

    python -m flashlab.bench --mode traffic --backends paged256,paged256_fp8 --heads 64 --kv-heads 8 \
        --batch 8 --seq-lens 32k,128k --head-dims 128 --causal no

Naive attention at N = 16K holds its score matrix three times over at its peak (the matmul's output, the scaled
copy and P): 3 x 32 heads x 16384^2 x 2 B = 52 GB at D = 64, which fits in an H200's 141 GB. A case whose
workspace would not fit in free memory is recorded as ``oom`` and not run.

Results go to ``data/results/<gpu>-traffic-<dtype>-<date>.json`` (meta, cases, kernels) and ``.csv`` (kernels),
stamped like every result of ``flashlab.bench`` plus the ncu version and the metrics. Without a GPU, or without
ncu, the command says which is missing and exits non-zero.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import triton
import triton.language as tl

from flashlab.bench.args import name_list, size_list
from flashlab.bench.implementations import BACKENDS, FP8_SUFFIX
from flashlab.bench.results import gpu_slug, json_row, save_tables
from flashlab.calculators import roofline

# ----------------------------------------------------------------------------------------------------------------
# What is measured

METRICS = (
    "dram__bytes_read.sum",  # bytes read from HBM
    "dram__bytes_write.sum",  # bytes written to HBM
    "lts__t_bytes.sum",  # bytes through the L2 cache, every client, reads and writes
    "lts__t_sectors_op_read.sum",  # L2 read sectors (32 B each)
    "lts__t_sectors_op_write.sum",  # L2 write sectors (32 B each)
    "gpu__time_duration.sum",  # the kernel's duration, ns
)
# What is kept if ncu rejects one of the sector metrics: HBM bytes, L2 bytes, duration.
CORE_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum", "gpu__time_duration.sum")
L2_SECTOR_BYTES = 32
MARKER = "flashlab_case_marker"  # the kernel that opens each profiled case
TRAFFIC_BACKENDS = ("naive", "flashlab", "sdpa_flash", "sdpa_cudnn", "flashlab_backward")
# Decode: one query token a sequence against a paged KV cache of seq_len tokens, 16-bit or 8-bit (e4m3); run when
# named (``--backends paged256,paged256_fp8``), the grid above being prefill's
DECODE_BACKENDS = ("paged16", "paged256", "paged16_fp8", "paged256_fp8")
DEFAULT_L2_BYTES = 60 * 10**6  # an H200's L2 as torch reports it, for recordings that lack the figure

CASE_COLUMNS = (
    "backend", "dtype", "head_dim", "seq_len", "causal", "batch", "heads", "kv_heads", "status", "reason",
    "rel_err",
    "kernels", "dram_read_bytes", "dram_write_bytes", "hbm_bytes", "l2_bytes", "l2_read_bytes", "l2_write_bytes",
    "duration_ns", "io_bytes", "score_bytes", "lesson_bytes", "model_bytes", "tiled_bytes", "ratio",
)  # fmt: skip
KERNEL_COLUMNS = (
    "backend", "dtype", "head_dim", "seq_len", "causal", "batch", "heads", "kv_heads", "case", "position", "kernel",
    "pass",
    "dram_read_bytes", "dram_write_bytes", "l2_bytes", "l2_read_bytes", "l2_write_bytes", "duration_ns",
    "device_name", "torch", "triton", "cuda", "date", "ncu",
)  # fmt: skip


class TrafficUnavailable(RuntimeError):
    """The traffic measurement cannot run here (no GPU, no ncu, or ncu cannot read the counters)."""


@dataclass(frozen=True)
class TrafficCase:
    """One measured call: q, k, v are ``(batch, heads, seq_len, head_dim)`` of ``dtype``; for a decode backend
    (``DECODE_BACKENDS``) q is one token a sequence, ``(batch, heads, 1, head_dim)``, and the cache holds seq_len
    tokens of ``kv_heads`` heads (0: as many as q's)."""

    backend: str
    dtype: str
    head_dim: int
    seq_len: int
    causal: bool
    batch: int
    heads: int
    kv_heads: int = 0

    @property
    def decode(self) -> bool:
        return self.backend in DECODE_BACKENDS

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads

    @property
    def cache_bytes_per_element(self) -> int:
        """The K/V bytes per element a call reads: the backend's cache width (an 8-bit cache's 1), else the dtype's."""
        return (BACKENDS[self.backend].kv_bytes_per_element if self.decode else None) or self.dtype_bytes

    @property
    def dtype_bytes(self) -> int:
        return {"bf16": 2, "fp16": 2, "fp32": 4}[self.dtype]

    @property
    def copies(self) -> int:
        """How many (batch, head) pairs: every per-head count is multiplied by this."""
        return self.batch * self.heads

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        heads = f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads else "")
        return f"{self.backend} {self.dtype} D={self.head_dim} N={self.seq_len} {mask} B={self.batch} {heads}"

    def fields(self) -> dict:
        return asdict(self)


@dataclass
class TrafficConfig:
    """Which cases to measure and how. ``None`` fields take the defaults in ``resolve``."""

    seq_lens: Sequence[int] | None = None
    head_dims: Sequence[int] | None = None
    dtype: str = "bf16"
    causal: str = "both"
    backends: Sequence[str] | None = None
    heads: int | None = None  # None: model_dim // head_dim
    kv_heads: int | None = None  # decode backends: the cache's heads (None: as many as the query heads)
    model_dim: int = 2048
    batch: int = 1
    quick: bool = False
    seed: int = 0
    check_rows: int = 64
    metrics: Sequence[str] = METRICS
    ncu: str | None = None  # path to ncu; None: search for it
    timeout_s: float = 540.0

    def resolve(self) -> TrafficConfig:
        seq_lens = self.seq_lens or ((1024, 4096) if self.quick else (1024, 2048, 4096, 8192, 16384))
        head_dims = self.head_dims or ((128,) if self.quick else (128, 64))
        causal = self.causal if self.seq_lens or not self.quick else "no"
        backends = tuple(self.backends) if self.backends else TRAFFIC_BACKENDS
        unknown = [b for b in backends if b not in TRAFFIC_BACKENDS + DECODE_BACKENDS]
        if unknown:
            raise ValueError(f"unknown traffic backend(s) {unknown}; choose from "
                             f"{list(TRAFFIC_BACKENDS + DECODE_BACKENDS)}")  # fmt: skip
        if self.kv_heads is not None:
            heads = self.heads
            if self.kv_heads < 1 or (heads is not None and heads % self.kv_heads):
                raise ValueError(f"kv_heads must be a positive int dividing heads; got {self.kv_heads} for {heads}")
            if not any(b in DECODE_BACKENDS for b in backends):
                raise ValueError(f"kv_heads is for the decode backends ({', '.join(DECODE_BACKENDS)})")
        if causal not in ("both", "yes", "no"):
            raise ValueError(f"causal must be 'both', 'yes' or 'no'; got {causal!r}")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be 'bf16', 'fp16' or 'fp32'; got {self.dtype!r}")
        for name, values in (("seq_lens", seq_lens), ("head_dims", head_dims)):
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of positive ints; got {list(values)}")
        for name in ("model_dim", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int; got {getattr(self, name)}")
        if self.heads is not None and self.heads < 1:
            raise ValueError(f"heads must be a positive int; got {self.heads}")
        return replace(
            self,
            seq_lens=tuple(int(n) for n in seq_lens),
            head_dims=tuple(int(d) for d in head_dims),
            causal=causal,
            backends=backends,
            metrics=tuple(self.metrics),
        )

    def cases(self) -> list[TrafficCase]:
        """Every case, in the order the child runs them: head dim, mask, length, then backend."""
        c = self.resolve()
        masks = {"both": (False, True), "yes": (True,), "no": (False,)}[c.causal]
        return [
            TrafficCase(
                b,
                c.dtype,
                d,
                n,
                causal,
                c.batch,
                c.heads or max(1, c.model_dim // d),
                (c.kv_heads or 0) if b in DECODE_BACKENDS else 0,
            )
            for d in c.head_dims
            for causal in masks
            for n in c.seq_lens
            for b in c.backends
        ]

    def to_argv(self) -> list[str]:
        """The command-line flags that reproduce this configuration."""
        c = self.resolve()
        argv = [
            "--mode", "traffic",
            "--seq-lens", ",".join(map(str, c.seq_lens)),
            "--head-dims", ",".join(map(str, c.head_dims)),
            "--dtype", c.dtype,
            "--causal", c.causal,
            "--backends", ",".join(c.backends),
            "--model-dim", str(c.model_dim),
            "--batch", str(c.batch),
            "--seed", str(c.seed),
            "--check-rows", str(c.check_rows),
            "--metrics", ",".join(c.metrics),
            "--timeout", f"{c.timeout_s:g}",
        ]  # fmt: skip
        if c.heads is not None:
            argv += ["--heads", str(c.heads)]
        if c.kv_heads is not None:
            argv += ["--kv-heads", str(c.kv_heads)]
        return argv


# ----------------------------------------------------------------------------------------------------------------
# Finding ncu, and whether this machine can measure at all


def find_ncu(explicit: str | None = None) -> str | None:
    """The path of Nsight Compute's command line: ``explicit``, else ``$NCU``, else ``ncu`` on the PATH, else the
    usual install places (/usr/local/cuda/bin, /opt/nvidia/nsight-compute/*); None if there is none."""
    for candidate in (explicit, os.environ.get("NCU")):
        if candidate:
            return candidate if (os.path.isfile(candidate) and os.access(candidate, os.X_OK)) else None
    found = shutil.which("ncu")
    if found:
        return found
    places = ["/usr/local/cuda/bin/ncu"] + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    places += sorted(glob.glob("/usr/local/cuda-*/bin/ncu"), reverse=True)
    return next((p for p in places if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def ncu_version(ncu: str) -> str:
    """ncu's own version line, e.g. 'Version 2025.3.1.0 (build ...)'; '' if it does not answer."""
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    return next((x for x in lines if x.lower().startswith("version")), lines[-1] if lines else "")


def unavailable_reason(ncu: str | None = None, cuda_available: bool | None = None) -> str | None:
    """Why the traffic measurement cannot run on this machine, in one line; None if it can."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "no CUDA GPU: the hardware counters are read from a GPU; the notebooks use the recorded file instead"
    if find_ncu(ncu) is None:
        where = f"{ncu} is not an executable" if ncu else "no ncu on the PATH, in $NCU or in /usr/local/cuda/bin"
        return f"Nsight Compute is not available ({where}); install it or pass --ncu PATH"
    return None


def ncu_command(ncu: str, metrics: Sequence[str], report: str | Path, child: Sequence[str]) -> list[str]:
    """The profiling command: only ``metrics``, one kernel replayed at a time, clocks left alone, nothing profiled
    until the child calls cudaProfilerStart."""
    return [
        ncu,
        "--profile-from-start", "off",
        "--clock-control", "none",
        "--target-processes", "all",
        "--replay-mode", "kernel",
        "--metrics", ",".join(metrics),
        "--export", str(report),
        "--force-overwrite",
        *child,
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Reading ncu's CSV

_UNIT_SCALE = {
    "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
    "kibyte": 2.0**10, "mibyte": 2.0**20, "gibyte": 2.0**30, "tibyte": 2.0**40,
    "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,  # durations are kept in ns
    "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9,
    "sector": 1.0, "ksector": 1e3, "msector": 1e6, "gsector": 1e9,  # counts of 32-byte sectors
}  # fmt: skip


def _number(text: str, unit: str = "") -> float:
    """'1,234,567' in ``unit`` -> 1234567.0 in the base unit (bytes, ns, sectors); 'n/a' or '' -> NaN."""
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A", "-"):
        return float("nan")
    try:
        value = float(text)
    except ValueError:
        return float("nan")
    return value * _UNIT_SCALE.get(unit.strip().lower(), 1.0)


def _csv_start(text: str) -> str:
    """The CSV part of ncu's output: from the header line (the one starting with "ID") on, without ==PROF== lines."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the text; was it made with --csv?')
    return "\n".join(line for line in lines[start:] if not line.startswith("=="))


def parse_ncu_csv(text: str) -> list[dict]:
    """The kernels in ncu's CSV output, in profiling order: ``[{"id", "kernel", <metric>: value, ...}]``.

    Reads both layouts ncu writes: ``--page raw`` (one row per kernel, one column per metric, the second row
    holding the units) and the default ``--page details`` (one row per kernel and metric, with "Metric Name",
    "Metric Unit" and "Metric Value" columns). Values are converted to bytes, nanoseconds and sector counts
    whatever unit ncu printed them in; thousands separators are dropped.
    """
    reader = csv.reader(io.StringIO(_csv_start(text)))
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    name_col = col.get("Kernel Name", col.get("Function Name"))
    if name_col is None:
        raise ValueError(f"ncu CSV has no 'Kernel Name' column; columns: {header}")
    kernels: dict[int, dict] = {}
    if "Metric Name" in col:  # details layout: one row per (kernel, metric)
        for row in reader:
            if len(row) < len(header):
                continue
            kid = int(_number(row[col["ID"]]))
            k = kernels.setdefault(kid, {"id": kid, "kernel": row[name_col]})
            k[row[col["Metric Name"]]] = _number(row[col["Metric Value"]], row[col.get("Metric Unit", -1)])
        return [kernels[i] for i in sorted(kernels)]
    metric_cols = [i for i, name in enumerate(header) if "__" in name]  # metric names look like unit__counter.sum
    units = [""] * len(header)
    out = []
    for row in reader:
        if len(row) < len(header):
            continue
        if row[col["ID"]].strip() == "":  # the units row
            units = row
            continue
        k = {"id": int(_number(row[col["ID"]])), "kernel": row[name_col]}
        for i in metric_cols:
            k[header[i]] = _number(row[i], units[i])
        out.append(k)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Giving each kernel to its case


def naive_pass_names(kernels: Sequence[str]) -> list[str]:
    """Which pass of naive attention each kernel of one eager call is, from its name and its place in the launch
    order: the first matrix multiply is "QK^T", the last "PV"; "softmax" by name; building the causal mask
    (``torch.ones``' fill, ``tril``, the ``~``) is "mask build"; between Q K^T and softmax, a ``masked_fill`` /
    ``where`` is the causal "mask" and an elementwise multiply the "scale" (PyTorch splits one elementwise
    operator over more than 2^31 elements into several kernels: each is named for the pass it is part of);
    anything else "other". Names may be ncu's full ones (``void at::vectorized_elementwise_kernel<8,
    ...MulFunctor<float>>...``) or bare function names, where the first kernel after Q K^T is the scale."""
    lowered = [k.lower() for k in kernels]
    gemms = [i for i, k in enumerate(lowered) if any(w in k for w in ("gemm", "nvjet", "cutlass", "xmma", "matmul"))]
    softmax = [i for i, k in enumerate(lowered) if "softmax" in k]
    first, last = (gemms[0], gemms[-1]) if len(gemms) >= 2 else (-1, len(kernels))
    names = []
    for i, k in enumerate(lowered):
        if i in (first, last):
            names.append("QK^T" if i == first else "PV")
        elif i in softmax:
            names.append("softmax")
        elif i < first or any(w in k for w in ("fillfunctor", "tril", "triu", "bitwise_not")):
            names.append("mask build")  # the causal mask is made by ones(), tril() and ~ before masked_fill
        elif first < i < (softmax[0] if softmax else last):
            if "masked_fill" in k or "where" in k:
                names.append("mask")
            elif "scale" not in names or "mul" in k:
                names.append("scale")
            else:
                names.append("mask")
        else:
            names.append("other")
    return names


def _metric(k: dict, name: str) -> float:
    return float(k.get(name, float("nan")))


def attribute_kernels(kernels: Sequence[dict], profiled: Sequence[dict], meta: dict | None = None) -> list[dict]:
    """Kernel rows (``KERNEL_COLUMNS``): every kernel after the i-th marker and before the next belongs to the i-th
    profiled case of the child's manifest. ValueError if the markers and the manifest disagree."""
    meta = meta or {}
    starts = [i for i, k in enumerate(kernels) if MARKER in k["kernel"]]
    if len(starts) != len(profiled):
        raise ValueError(
            f"ncu saw {len(starts)} case markers ({MARKER}) but the child profiled {len(profiled)} cases: "
            "the report cannot be matched to the cases (was ncu's run cut short?)"
        )
    if starts and starts[0] != 0:
        raise ValueError(f"{starts[0]} kernel(s) were profiled before the first case marker; cannot attribute them")
    rows = []
    for case_index, (start, case) in enumerate(zip(starts, profiled, strict=True)):
        end = starts[case_index + 1] if case_index + 1 < len(starts) else len(kernels)
        own = kernels[start + 1 : end]
        passes = naive_pass_names([k["kernel"] for k in own]) if case["backend"] == "naive" else [""] * len(own)
        for position, (k, pass_name) in enumerate(zip(own, passes, strict=True)):
            reads, writes = _metric(k, "lts__t_sectors_op_read.sum"), _metric(k, "lts__t_sectors_op_write.sum")
            rows.append(
                case_of(case).fields()
                | dict(
                    case=case_index,
                    position=position,
                    kernel=k["kernel"],
                    **{"pass": pass_name},
                    dram_read_bytes=_metric(k, "dram__bytes_read.sum"),
                    dram_write_bytes=_metric(k, "dram__bytes_write.sum"),
                    l2_bytes=_metric(k, "lts__t_bytes.sum"),
                    l2_read_bytes=reads * L2_SECTOR_BYTES,
                    l2_write_bytes=writes * L2_SECTOR_BYTES,
                    duration_ns=_metric(k, "gpu__time_duration.sum"),
                )
                | {c: meta.get(c) for c in ("device_name", "torch", "triton", "cuda", "date", "ncu")}
            )
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Predictions beside measurements


def case_of(row: dict) -> TrafficCase:
    """The ``TrafficCase`` a case or kernel row describes (a recording made before decode cases has no
    ``kv_heads``: 0, as many as the query heads)."""
    return TrafficCase(**{name: row.get(name, 0) if name == "kv_heads" else row[name]
                          for name in TrafficCase.__dataclass_fields__})  # fmt: skip


def predictions(case: TrafficCase, sram_bytes: int | None = None) -> dict:
    """The calculators' counts for a case, whole case (every batch entry and head), in bytes.

    ``io_bytes``: Q, K, V read and O written once; ``score_bytes``: one S for every head; ``lesson_bytes``: the
    lesson's count for the backend (naive: four passes over S plus Q, K, V, O; flash: Q, K, V, O once; backward:
    Q, K, V, O, dO read and dQ, dK, dV written once); ``model_bytes``: the count the measurement should match
    (naive: ``eager_naive_attention_traffic``, the passes eager PyTorch makes; the others as ``lesson_bytes``);
    ``tiled_bytes``: the FlashAttention paper's Algorithm 1 count for ``sram_bytes`` of SRAM (the H200's
    228 KiB per SM by default), for comparison.
    """
    n, d, b, copies = case.seq_len, case.head_dim, case.dtype_bytes, case.copies
    if case.decode:  # one token's q and o, and the cache read once: seq_len keys and values of every K/V head
        cache = 2 * case.batch * case.hk * n * d * case.cache_bytes_per_element
        io = 2 * copies * d * b + cache
        return dict(io_bytes=io, score_bytes=copies * n * b, lesson_bytes=io, model_bytes=io, tiled_bytes=io)
    sram = sram_bytes or roofline.GPUS["h200-sxm"].smem_per_sm
    flash = roofline.flash_attention_traffic(n, d, b)
    if case.backend == "naive":
        lesson = roofline.naive_attention_traffic(n, d, b, include_qkvo=True)
        model = roofline.eager_naive_attention_traffic(n, d, b, causal=case.causal)
    elif case.backend == "flashlab_backward":
        lesson = model = roofline.flash_attention_backward_traffic(n, d, b)
    else:
        lesson = model = flash
    return dict(
        io_bytes=flash * copies,
        score_bytes=roofline.score_matrix_bytes(n, b) * copies,
        lesson_bytes=lesson * copies,
        model_bytes=model * copies,
        tiled_bytes=roofline.flash_io_accesses(n, d, sram, b) * copies,
    )


def case_rows(cases: Sequence[dict], kernel_rows: Sequence[dict]) -> list[dict]:
    """One row per case (``CASE_COLUMNS``): its kernels' counters summed, the predictions and measured / model."""
    by_case: dict[int, list[dict]] = {}
    for k in kernel_rows:
        by_case.setdefault(k["case"], []).append(k)
    out = []
    profiled_index = 0
    for c in cases:
        row = case_of(c).fields()
        row.update(status=c.get("status", "ok"), reason=c.get("reason", ""), rel_err=c.get("rel_err", float("nan")))
        row.update(predictions(case_of(c)))
        sums = dict.fromkeys(
            ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "l2_read_bytes", "l2_write_bytes", "duration_ns"),
            float("nan"),
        )
        row["kernels"] = 0
        if c.get("profiled", row["status"] == "ok"):  # its kernels are the next case's in the report
            own = by_case.get(profiled_index, [])
            profiled_index += 1
            if row["status"] == "ok":
                row["kernels"] = len(own)
                sums = {key: float(sum(k[key] for k in own)) for key in sums}
        row.update(sums)
        row["hbm_bytes"] = row["dram_read_bytes"] + row["dram_write_bytes"]
        row["ratio"] = row["hbm_bytes"] / row["model_bytes"]
        out.append({k: row.get(k) for k in CASE_COLUMNS})
    return out


def _gb(x: float) -> str:
    return roofline.format_bytes(x) if math.isfinite(x) else "n/a"


def gap_explanations(
    row: dict, rows: Sequence[dict] = (), l2_bytes: float = DEFAULT_L2_BYTES, kernels: Sequence[dict] = ()
) -> list[str]:
    """Why one case's measured HBM bytes differ from the model, each reason computed from the counters.

    ``rows`` are the other cases of the same recording (for the causal-against-unmasked comparison); ``l2_bytes``
    is the GPU's L2 size; ``kernels`` the case's kernel rows (for the kernels the model leaves out).
    """
    why = []
    read, write, hbm = row["dram_read_bytes"], row["dram_write_bytes"], row["hbm_bytes"]
    if row.get("status") != "ok" or not math.isfinite(hbm):
        return [f"not measured: {row.get('status')} {row.get('reason', '')}".strip()]
    qkvo, s = row["io_bytes"], row["score_bytes"]
    if row["backend"] == "naive":
        passes = (hbm - qkvo) / s
        why.append(f"{passes:.1f} passes over S measured; the lesson counts 4, eager PyTorch's kernels make "
                   f"{(row['model_bytes'] - qkvo) / s:.1f}")  # fmt: skip
        extra = [k for k in kernels if k.get("pass") in ("mask build", "other")]
        if extra:
            moved = sum(k["dram_read_bytes"] + k["dram_write_bytes"] for k in extra)
            names = ", ".join(sorted({k["pass"] for k in extra}))
            why.append(f"{len(extra)} kernel(s) the model leaves out ({names}): {_gb(moved)}")
        if s <= l2_bytes:
            why.append(f"S ({_gb(s)}) fits in the {_gb(l2_bytes)} L2: what one kernel writes is partly still there "
                       "when it ends, and never reaches HBM")  # fmt: skip
        return why
    if row["backend"] == "flashlab_backward":
        why.append(f"{hbm / row['model_bytes']:.2f}x the simplified count (Q, K, V, O, dO read once, dQ, dK, dV "
                   "written once)")  # fmt: skip
        return why
    o = qkvo / 4
    held = o - write
    if held > 0.02 * o:
        tail = "within the L2's size" if held <= l2_bytes else "more than the L2 holds"
        why.append(f"{_gb(held)} of O's {_gb(o)} not yet written back when the kernel ended ({tail})")
    why.append(f"Q, K, V read from HBM {read / (3 * o):.2f} times (1 = once)")
    l2_read = row.get("l2_read_bytes", float("nan"))
    if math.isfinite(l2_read) and l2_read > 0:
        kv_reread = (l2_read - o) / (2 * o)
        why.append(f"K and V pass through L2 {kv_reread:.1f} times ({_gb(l2_read)} read from L2 against {_gb(read)} "
                   "from HBM): re-read by every query tile, served by L2")  # fmt: skip
    if row["causal"]:
        full = next((r for r in rows if r["status"] == "ok" and not r["causal"] and all(
            r[k] == row[k] for k in ("backend", "dtype", "head_dim", "seq_len", "batch", "heads"))), None)  # fmt: skip
        if full is not None and full.get("l2_bytes") and math.isfinite(full["l2_bytes"]):
            why.append(f"causal: {row['l2_bytes'] / full['l2_bytes']:.2f}x the unmasked run's L2 bytes (tiles above "
                       f"the diagonal skipped), {hbm / full['hbm_bytes']:.2f}x its HBM bytes")  # fmt: skip
    return why


_CASE_KEYS = ("backend", "dtype", "head_dim", "seq_len", "causal", "batch", "heads")


def predicted_vs_measured(results: TrafficResults, backends: Sequence[str] | None = None) -> list[dict]:
    """The table the notebooks show: per measured case, the lesson's count, the model, the measurement, their
    ratio, and the reasons for the gap (``gap_explanations``)."""
    l2 = float(results.meta.get("l2_bytes") or DEFAULT_L2_BYTES)
    out = []
    for r in results.cases:
        if r["status"] != "ok" or (backends and r["backend"] not in backends):
            continue
        out.append(
            dict(
                backend=r["backend"],
                head_dim=r["head_dim"],
                seq_len=r["seq_len"],
                causal=r["causal"],
                lesson_bytes=r["lesson_bytes"],
                model_bytes=r["model_bytes"],
                tiled_bytes=r["tiled_bytes"],
                measured_bytes=r["hbm_bytes"],
                read_bytes=r["dram_read_bytes"],
                write_bytes=r["dram_write_bytes"],
                l2_bytes=r["l2_bytes"],
                ratio=r["hbm_bytes"] / r["model_bytes"],
                lesson_ratio=r["hbm_bytes"] / r["lesson_bytes"],
                why=gap_explanations(r, results.cases, l2, results.kernels_of(**{k: r[k] for k in _CASE_KEYS})),
            )  # fmt: skip
        )
    return out


def growth_with_n(results: TrafficResults, column: str = "hbm_bytes") -> dict:
    """How a measured column grows with N, per (backend, head dim, causal): the slope of log(bytes) against
    log(N) by least squares (2: as N^2, like the score matrix; 1: as N, like Q, K, V and O)."""
    import numpy as np

    groups: dict[tuple, list[tuple[int, float]]] = {}
    for r in results.cases:
        if r["status"] == "ok" and math.isfinite(r[column]) and r[column] > 0:
            groups.setdefault((r["backend"], r["head_dim"], r["causal"]), []).append((r["seq_len"], r[column]))
    out = {}
    for key, points in groups.items():
        if len({n for n, _ in points}) >= 2:
            n, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
            out[key] = float(np.polyfit(n, y, 1)[0])
    return out


# ----------------------------------------------------------------------------------------------------------------
# A recording: its stamp, cases and kernels, and its files


@dataclass
class TrafficResults:
    """A traffic recording: the stamp ``meta``, one row per case and one row per kernel."""

    meta: dict
    cases: list[dict]
    kernels: list[dict] = field(default_factory=list)

    def ok_cases(self, **match) -> list[dict]:
        return [r for r in self.cases if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]

    def kernels_of(self, **match) -> list[dict]:
        return [k for k in self.kernels if all(k[key] == v for key, v in match.items())]

    def to_json(self) -> dict:
        return dict(
            meta=self.meta, cases=[json_row(r) for r in self.cases], kernels=[json_row(r) for r in self.kernels]
        )

    def save(self, prefix) -> tuple[Path, Path]:
        """``PREFIX.json`` (meta, cases, kernels) and ``PREFIX.csv`` (one row per kernel, the stamp in each)."""
        return save_tables(prefix, self.to_json(), self.kernels, KERNEL_COLUMNS)

    @classmethod
    def load(cls, path) -> TrafficResults:
        """Read a ``.json`` written by ``save``: missing numbers come back as NaN, and naive attention's kernels
        are named for their pass again by ``naive_pass_names`` (a label derived from the names, not a counter)."""
        data = json.loads(Path(path).read_text())

        def nan(rows):  # and kv_heads 0 (as many as the query heads) in recordings made before decode cases
            return [{"kv_heads": 0} | {k: (float("nan") if v is None and k not in ("reason",) else v)
                                       for k, v in r.items()} for r in rows]  # fmt: skip

        kernels = nan(data.get("kernels", []))
        by_case: dict[tuple, list[dict]] = {}
        for k in kernels:
            if k.get("backend") == "naive":
                by_case.setdefault((k.get("case"), k.get("seq_len"), k.get("head_dim"), k.get("causal")), []).append(k)
        for own in by_case.values():
            for k, name in zip(own, naive_pass_names([k["kernel"] for k in own]), strict=True):
                k["pass"] = name
        return cls(meta=data["meta"], cases=nan(data["cases"]), kernels=kernels)


def default_prefix(meta: dict) -> Path:
    """``data/results/<gpu>-traffic-<dtype>-<date>``."""
    return Path("data/results") / f"{gpu_slug(meta)}-traffic-{meta['config']['dtype']}-{meta['date'][:10]}"


def newest_traffic_results(directory="data/results") -> Path | None:
    """The newest ``*-traffic-*.json`` in ``directory`` whose stamp says a CUDA GPU and ncu produced it (by stamp
    date), or None."""
    found = []
    for path in Path(directory).glob("*-traffic-*.json"):
        try:
            meta = json.loads(path.read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if meta.get("tool") == "flashlab.bench" and meta.get("mode") == "traffic" and meta.get("is_cuda_gpu"):
            found.append((meta.get("date", ""), path.name, path))
    return max(found)[2] if found else None


# The live measurement a notebook takes on a GPU with ncu: the lesson's head dim, two lengths, no mask, naive and
# flashlab; the child stops starting cases after 80 % of the time limit, so the cell ends within about a minute.
NOTEBOOK_LIVE = TrafficConfig(seq_lens=(1024, 4096), head_dims=(128,), causal="no", backends=("naive", "flashlab"),
                              timeout_s=75)  # fmt: skip


def notebook_traffic(directory="data/results", live="auto") -> tuple[TrafficResults | None, str]:
    """What a notebook shows, and where it came from: ``(results, source)``.

    ``live=True``: measure here (``NOTEBOOK_LIVE``) when this machine has a GPU and ncu, else read the newest
    recording in ``directory``. ``live="auto"``: the recording if there is one, else a live measurement where
    possible. ``live=False``: the recording only. ``(None, why)`` when there is neither.
    """
    recorded = newest_traffic_results(directory)
    why_not_live = unavailable_reason()
    if why_not_live is None and (live is True or (live == "auto" and recorded is None)):
        try:
            return measure_traffic(NOTEBOOK_LIVE), "live (ncu on this machine)"
        except (TrafficUnavailable, ValueError) as e:
            why_not_live = str(e)
    if recorded is not None:
        return TrafficResults.load(recorded), f"recorded ({Path(recorded).name})"
    return None, f"no traffic recording in {directory} yet, and no live measurement here ({why_not_live})"


def bytes_per_head(results: TrafficResults, column: str = "hbm_bytes") -> dict:
    """Measured bytes of one (batch entry, head) per ``(backend, head_dim, seq_len, causal)``: the case's counter
    divided by batch x heads, so it can be set beside per-head counts or scaled to another batch and head count
    (heads are independent work; only the L2's share differs)."""
    return {(r["backend"], r["head_dim"], r["seq_len"], r["causal"]): r[column] / (r["batch"] * r["heads"])
            for r in results.ok_cases()}  # fmt: skip


def summary_table(results: TrafficResults) -> str:
    """Per case: kernels, HBM read and written, L2, the model's count and measured / model."""
    m = results.meta
    lines = [f"{m['device_name']}, torch {m['torch']}, triton {m['triton']}, {m.get('ncu', '')}, {m['date']} -- "
             "HBM and L2 bytes per call, measured by ncu"]  # fmt: skip
    head = ("backend", "D", "mask", "N", "H", "kernels", "HBM read", "HBM write", "L2", "model", "measured/model")
    body = []
    for r in results.cases:
        mask = "causal" if r["causal"] else "full"
        cell = [r["backend"], str(r["head_dim"]), mask, str(r["seq_len"]), str(r["heads"])]
        if r["status"] != "ok":
            body.append(cell + [r["status"], (r["reason"] or "")[:60], "", "", "", ""])
            continue
        body.append(cell + [str(r["kernels"]), _gb(r["dram_read_bytes"]), _gb(r["dram_write_bytes"]),
                            _gb(r["l2_bytes"]), _gb(r["model_bytes"]), f"{r['ratio']:.2f}"])  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines += [fmt.format(*head)] + [fmt.format(*b) for b in body]
    lines.append(headline(results))
    lines += [f"{name} / {name.removesuffix(FP8_SUFFIX)}, {label}: HBM read {ratio:.3f}x (the cache's bytes alone: "
              "0.5x)" for (name, label), ratio in eight_bit_read_ratios(results).items()]  # fmt: skip
    return "\n".join(lines)


def eight_bit_read_ratios(results: TrafficResults) -> dict:
    """For each decode case measured with both an 8-bit cache and the same 16-bit one: ``{(8-bit backend, cell
    label): HBM bytes read by the 8-bit call / by the 16-bit call}``."""
    measured = {case_of(r): r for r in results.cases if r["status"] == "ok"}
    out = {}
    for case, r in measured.items():
        sixteen = measured.get(replace(case, backend=case.backend.removesuffix(FP8_SUFFIX)))
        if case.backend.endswith(FP8_SUFFIX) and sixteen is not None and sixteen["dram_read_bytes"] > 0:
            label = f"D={case.head_dim} N={case.seq_len} B={case.batch} H={case.heads}/{case.hk}"
            out[(case.backend, label)] = r["dram_read_bytes"] / sixteen["dram_read_bytes"]
    return out


def headline(results: TrafficResults, seq_len: int = 8192, head_dim: int = 128) -> str:
    """Predicted and measured HBM bytes of naive attention and flashlab at one cell (no mask), and their ratio."""
    naive = results.ok_cases(backend="naive", seq_len=seq_len, head_dim=head_dim, causal=False)
    flash = results.ok_cases(backend="flashlab", seq_len=seq_len, head_dim=head_dim, causal=False)
    if not (naive and flash):
        return f"N = {seq_len}, D = {head_dim}, no mask: naive and flashlab were not both measured"
    n, f = naive[0], flash[0]
    return (
        f"N = {seq_len}, D = {head_dim}, no mask, {n['batch']} x {n['heads']} heads: naive predicted "
        f"{_gb(n['model_bytes'])} (eager kernels; the lesson's 4 passes: {_gb(n['lesson_bytes'])}), measured "
        f"{_gb(n['hbm_bytes'])}; flashlab predicted {_gb(f['model_bytes'])}, measured {_gb(f['hbm_bytes'])}; "
        f"naive / flashlab: predicted {n['model_bytes'] / f['model_bytes']:.0f}x, measured "
        f"{n['hbm_bytes'] / f['hbm_bytes']:.0f}x"
    )


# ----------------------------------------------------------------------------------------------------------------
# The child: runs under ncu, warms up, then profiles one call per case


def _case_call(case: TrafficCase, q, k, v):
    """What one profiled call runs, and the output it is checked with (None: checked another way)."""
    import torch

    from flashlab.bench.implementations import BACKENDS
    from flashlab.host import flash_attention

    if case.backend != "flashlab_backward":
        run = BACKENDS[case.backend].run
        return lambda: run(q, k, v, case.causal)
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = flash_attention(qg, kg, vg, causal=case.causal)
    if o.grad_fn is None:
        raise NotImplementedError("flash_attention's output has no grad_fn: the backward is not wired into autograd")
    do = torch.randn_like(o)
    return lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)


@triton.jit
def flashlab_case_marker(x_ptr):
    """A one-element kernel launched just before each profiled call: its name in ncu's report opens a case."""
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _marker():
    import torch

    x = torch.zeros(1, device="cuda", dtype=torch.int32)
    return lambda: flashlab_case_marker[(1,)](x)


def _workspace_bytes(case: TrafficCase) -> int:
    """Memory a case needs beyond q, k, v: naive holds about three score matrices at once, plus the causal mask."""
    if case.decode:  # the paged pool (and its 8-bit copy) beside k and v
        return 4 * case.batch * case.hk * case.seq_len * case.head_dim * case.dtype_bytes
    if case.backend != "naive":
        return 8 * case.copies * case.seq_len * case.head_dim * case.dtype_bytes
    return 3 * case.copies * case.seq_len**2 * case.dtype_bytes + case.seq_len**2


def _profiler(torch, what: str) -> None:
    """cudaProfilerStart / cudaProfilerStop: what ncu's --profile-from-start off waits for."""
    cudart = torch.cuda.cudart() if hasattr(torch.cuda, "cudart") else None
    if cudart is not None and hasattr(cudart, f"cudaProfiler{what}"):
        getattr(cudart, f"cudaProfiler{what}")()
    else:
        getattr(torch.cuda.profiler, what.lower())()


def run_child(config: TrafficConfig, manifest: Path, device: str = "cuda") -> None:
    """Under ncu: every case warmed up and checked outside the profiled range, then one call profiled after a
    marker kernel. The manifest lists every case with its status, in order. ``device="cpu"`` runs the same steps
    without a profiler or marker (flashlab in Triton's interpreter), to test them."""
    import torch

    from flashlab.bench.grid import DTYPES, TOLERANCE
    from flashlab.bench.implementations import reference_rows
    from flashlab.bench.measure import check_rows

    config = config.resolve()
    cases = config.cases()
    gpu = device == "cuda"
    marker = _marker() if gpu else (lambda: None)
    marker()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    done = []
    start = time.perf_counter()
    budget_s = 0.8 * config.timeout_s  # stop starting cases in time for ncu to write its report
    for i, case in enumerate(cases):
        entry = case.fields() | dict(status="ok", reason="", rel_err=float("nan"), profiled=False)
        done.append(entry)
        shape = (case.batch, case.heads, case.seq_len, case.head_dim)  # (B, H, N, D)
        kv_shape = (case.batch, case.hk, case.seq_len, case.head_dim)  # decode: the cache's (B, Hk, N, D)
        q_shape = (case.batch, case.heads, 1, case.head_dim) if case.decode else shape
        try:
            if time.perf_counter() - start > budget_s:
                raise TimeoutError(f"not run: the recording's time limit ({config.timeout_s:.0f} s) is near")
            if gpu:
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info()[0]
                inputs = 2 * math.prod(q_shape) + 2 * math.prod(kv_shape)  # q and o, k and v
                if _workspace_bytes(case) + inputs * case.dtype_bytes > 0.9 * free:
                    raise MemoryError(f"needs about {_gb(_workspace_bytes(case))}, {_gb(free)} free")
            gen = torch.Generator(device=device).manual_seed(config.seed)
            q, k, v = (torch.randn(s_, generator=gen, device=device).to(DTYPES[case.dtype])
                       for s_ in (q_shape, kv_shape, kv_shape))  # fmt: skip
            call = _case_call(case, q, k, v)
            out = call()  # warm-up 1: compile, autotune, build plans
            if case.backend != "flashlab_backward":
                rows = check_rows(q.shape[2], config.check_rows).to(device)
                stands_for = BACKENDS[case.backend].stands_for  # an 8-bit cache: the float64 K/V it stands for
                qr, kr, vr = (q[:1], k[:1], v[:1]) if stands_for is None else stands_for(q[:1], k[:1], v[:1])
                ref = reference_rows(qr, kr, vr, case.causal, rows)  # (1, H, R, D) float64
                got = out[:1][:, :, rows].double()
                entry["rel_err"] = (torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref)).item()
                if not entry["rel_err"] <= TOLERANCE[case.dtype]:
                    raise ArithmeticError(f"relative error {entry['rel_err']:.3g} > {TOLERANCE[case.dtype]:g}")
            del out
            call()  # warm-up 2: flashlab builds its direct relaunch (flashlab.host.launcher.FastLaunch) ...
            call()  # warm-up 3: ... and checks it against a JIT launch: only now is a call the steady state
            sync()
            entry.update(profiled=True, status="running")  # on disk before profiling: a crash still lines up
            manifest.write_text(json.dumps(done))
            if gpu:
                _profiler(torch, "Start")
            try:
                marker()
                result = call()
                sync()
            finally:
                if gpu:
                    _profiler(torch, "Stop")
            entry["status"] = "ok"
            del result, call, q, k, v
        except LookupError as e:
            entry.update(status="unavailable", reason=str(e))
        except TimeoutError as e:
            entry.update(status="skipped", reason=str(e))
        except ArithmeticError as e:
            entry.update(status="wrong", reason=f"{e}; not profiled")
        except (MemoryError, torch.cuda.OutOfMemoryError) as e:
            entry.update(status="oom", reason=" ".join(str(e).split())[:200])
        except Exception as e:  # noqa: BLE001 -- one failing case must not end the recording
            entry.update(status="error", reason=f"{e.__class__.__name__}: {' '.join(str(e).split())[:200]}")
        manifest.write_text(json.dumps(done))
        print(f"[{i + 1}/{len(cases)} {time.perf_counter() - start:5.0f} s] {case.label()}: {entry['status']}"
              f"{' -- ' + entry['reason'] if entry['reason'] else ''}", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The parent: start the child under ncu, read the report, write the files


def _import_csv(ncu: str, report: Path) -> str:
    """The report as CSV: the raw page (one row per kernel) with values in base units, or the details page."""
    attempts = (  # full (demangled) kernel names where this ncu can print them, else its default names
        [
            ncu,
            "--import",
            str(report),
            "--page",
            "raw",
            "--csv",
            "--print-units",
            "base",
            "--print-kernel-base",
            "demangled",
        ],
        [ncu, "--import", str(report), "--page", "raw", "--csv", "--print-units", "base"],
        [ncu, "--import", str(report), "--page", "raw", "--csv"],
        [ncu, "--import", str(report), "--csv"],
    )
    errors = []
    for cmd in attempts:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 and '"ID"' in proc.stdout:
            return proc.stdout
        errors.append(f"{shlex.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    raise TrafficUnavailable("ncu could not read its own report back: " + " | ".join(errors))


def measure_traffic(config: TrafficConfig | None = None, command: str | None = None, keep_report=None):
    """Run every case under ncu and return the ``TrafficResults``. Raises ``TrafficUnavailable`` (one line) if
    this machine has no GPU or no ncu, or if ncu cannot read the counters."""
    config = (config or TrafficConfig()).resolve()
    reason = unavailable_reason(config.ncu)
    if reason:
        raise TrafficUnavailable(reason)
    import torch

    from flashlab.bench.stamp import environment_stamp

    ncu = find_ncu(config.ncu)
    meta = environment_stamp("cuda")
    props = torch.cuda.get_device_properties(0)
    meta.update(
        mode="traffic",
        ncu=ncu_version(ncu),
        ncu_path=ncu,
        l2_bytes=getattr(props, "L2_cache_size", None),
        metrics=list(config.metrics),
        command=command or "python -m flashlab.bench " + shlex.join(config.to_argv()),
        config={"mode": "traffic"} | {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        profiler="ncu --profile-from-start off --clock-control none --replay-mode kernel --target-processes all",
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashlab-traffic-") as tmp:
        manifest, report = Path(tmp) / "cases.json", Path(tmp) / "traffic"
        metrics = list(config.metrics)
        for attempt in range(2):
            child = [sys.executable, "-m", "flashlab.bench", *replace(config, metrics=metrics).to_argv()]
            child += ["--traffic-child", str(manifest)]
            cmd = ncu_command(ncu, metrics, report, child)
            print("profiling:", shlex.join(cmd), flush=True)
            remaining = max(30.0, config.timeout_s - (time.perf_counter() - start))
            text = _stream(cmd, remaining)
            if "Failed to find metric" in text and attempt == 0 and metrics != list(CORE_METRICS):
                print(f"ncu rejected a metric; measuring again with {','.join(CORE_METRICS)}", flush=True)
                metrics = list(CORE_METRICS)
                continue
            break
        meta["metrics"] = metrics
        rep = report.with_suffix(".ncu-rep")
        if "LibraryNotLoaded" in text or "ERR_NVGPUCTRPERM" in text:
            raise TrafficUnavailable("ncu cannot read this GPU's performance counters here: " + _last_error(text))
        if not rep.exists():
            raise TrafficUnavailable("ncu wrote no report: " + _last_error(text))
        cases = json.loads(manifest.read_text()) if manifest.exists() else []
        csv_text = _import_csv(ncu, rep)
        if keep_report:  # the report, its CSV and the child's manifest, to check the attribution by hand
            keep = Path(keep_report)
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(rep, keep)
            keep.with_name(keep.name + ".csv").write_text(csv_text)
            keep.with_name(keep.name + ".cases.json").write_text(json.dumps(cases, indent=1))
        kernels = parse_ncu_csv(csv_text)
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    cases = complete_manifest(cases, config)
    profiled = [c for c in cases if c.get("profiled", c["status"] == "ok")]
    kernel_rows = attribute_kernels(kernels, profiled, meta)
    return TrafficResults(meta=meta, cases=case_rows(cases, kernel_rows), kernels=kernel_rows)


def complete_manifest(cases: Sequence[dict], config: TrafficConfig) -> list[dict]:
    """The child's manifest with every case of ``config``: a case the child was profiling when it ended is an
    ``error``, and cases it never reached are ``skipped``."""
    out = [dict(c) for c in cases]
    for c in out:
        if c["status"] == "running":
            c.update(status="error", reason="the profiled program ended during this case (see ncu's log)")
    for case in config.cases()[len(out) :]:
        out.append(case.fields() | dict(status="skipped", reason="not reached: the profiled program ended first"))
    return out


def _stream(cmd: list[str], timeout: float) -> str:
    """Run ``cmd``, printing its output as it comes (the child's progress, ncu's ==PROF== lines); return it."""
    lines = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})  # fmt: skip
    timer = threading.Timer(timeout, proc.kill)  # a child that hangs silently is stopped too
    timer.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith("==PROF== Profiling") or len(lines) % 25 == 0:
                print(line, end="", flush=True)
    finally:
        timer.cancel()
        proc.stdout.close()
    if proc.wait() in (-9, 137):
        lines.append(f"==ERROR== stopped after {timeout:.0f} s (the time limit)\n")
    return "".join(lines)


def _last_error(text: str) -> str:
    errors = [x.strip() for x in text.splitlines() if "==ERROR==" in x or "Error" in x]
    return (errors[-1] if errors else (text.strip().splitlines() or ["no output"])[-1])[:300]


# ----------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashlab.bench --mode traffic",
        description="HBM and L2 bytes of every attention kernel, measured with Nsight Compute (ncu) on a GPU. "
        "Defaults: bf16, N 1k..16k, D 128,64, causal and not, batch 1, H = 2048 / D heads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=["traffic"], default="traffic")
    p.add_argument("--seq-lens", type=size_list, help="sequence lengths N, comma-separated ('2k' = 2048)")
    p.add_argument("--head-dims", type=size_list, help="head dims D, comma-separated")
    p.add_argument("--dtype", "--dtypes", default="bf16", choices=["bf16", "fp16"], help="dtype of q, k, v")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="causal mask: yes, no or both")
    p.add_argument(
        "--backends",
        type=name_list,
        help=f"comma-separated, from {','.join(TRAFFIC_BACKENDS)} (default all), "
        f"and the decode backends {','.join(DECODE_BACKENDS)} (one query token against a paged cache, 16- or 8-bit)",
    )
    p.add_argument("--heads", type=int, help="a fixed number of heads for every D (default: model dim // D)")
    p.add_argument("--kv-heads", type=int, help="decode backends: the cache's K/V heads (default: --heads)")
    p.add_argument("--model-dim", type=int, default=2048, help="H * D when --heads is not given")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--quick", action="store_true", help="N 1k,4k, D 128, no mask: a smoke test")
    p.add_argument("--metrics", type=name_list, default=list(METRICS), help="ncu metrics, comma-separated")
    p.add_argument("--ncu", help="path to ncu (default: $NCU, the PATH, /usr/local/cuda/bin/ncu)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds the whole ncu run may take")
    p.add_argument("--check-rows", type=int, default=64, help="query rows checked against float64 before profiling")
    p.add_argument("--seed", type=int, default=0, help="random seed for q, k, v")
    p.add_argument("--out", help="write PREFIX.json and PREFIX.csv (default data/results/<gpu>-traffic-<dtype>-<date>)")
    p.add_argument("--out-dir", help="write <gpu>-traffic-<dtype>-<date>.json and .csv in this folder instead")
    p.add_argument("--keep-report", help="also keep ncu's report (.ncu-rep) at this path")
    p.add_argument("--traffic-child", help=argparse.SUPPRESS)  # the profiled child writes its manifest here
    return p


def config_from_args(args: argparse.Namespace) -> TrafficConfig:
    return TrafficConfig(
        seq_lens=args.seq_lens,
        head_dims=args.head_dims,
        dtype=args.dtype,
        causal=args.causal,
        backends=args.backends,
        heads=args.heads,
        kv_heads=args.kv_heads,
        model_dim=args.model_dim,
        batch=args.batch,
        quick=args.quick,
        seed=args.seed,
        check_rows=args.check_rows,
        metrics=tuple(args.metrics),
        ncu=args.ncu,
        timeout_s=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> TrafficResults | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args).resolve()
    except ValueError as e:
        raise SystemExit(f"flashlab.bench --mode traffic: {e}") from None
    if args.traffic_child:
        run_child(config, Path(args.traffic_child))
        return None
    try:
        results = measure_traffic(
            config, command=shlex.join(["python", "-m", "flashlab.bench", *argv]), keep_report=args.keep_report
        )
    except TrafficUnavailable as e:
        print(f"flashlab.bench --mode traffic: cannot measure here: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    prefix = Path(args.out) if args.out else default_prefix(results.meta)
    if args.out_dir and not args.out:
        prefix = Path(args.out_dir) / prefix.name
    json_path, csv_path = results.save(prefix)
    print(summary_table(results))
    print(f"wrote {json_path} and {csv_path}")
    return results
