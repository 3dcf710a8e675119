"""A sweep's results: its rows and stamp, CSV/JSON files, and the summaries (speedup ratios, geo-means, the table
printed at the end)."""

from __future__ import annotations

import csv
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashlab.bench.grid import STAMP_COLUMNS

# ----------------------------------------------------------------------------------------------------------------
# A sweep's rows, its stamp, and files

ROW_COLUMNS = (
    "backend", "dtype", "head_dim", "seq_len", "causal", "batch", "heads", "kv_heads", "q_len", "status", "reason",
    "rel_err", "max_abs_err", "tol", "time_ms", "tflops", "bandwidth_gbps", "peak_extra_mb", "flops", "io_bytes",
    "host_us", "host_us_median", "time_spread",
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
        return dict(meta=self.meta, ceilings=self.ceilings, rows=[json_row(r) for r in self.rows])

    def save(self, prefix, overwrite: bool = False) -> tuple[Path, Path]:
        """Write ``PREFIX.json`` (meta, ceilings, rows) and ``PREFIX.csv`` (rows, stamp columns in each); files
        already there are kept unless ``overwrite`` (see ``save_tables``). Returns the paths written."""
        return save_tables(prefix, self.to_json(), self.rows, ROW_COLUMNS, overwrite=overwrite)

    @classmethod
    def load(cls, path) -> BenchResults:
        """Read a ``.json`` written by ``save`` (missing numbers, stored as null, come back as NaN)."""
        data = json.loads(Path(path).read_text())
        rows = [{k: (float("nan") if v is None else v) for k, v in r.items()} for r in data["rows"]]
        return cls(meta=data["meta"], rows=rows, ceilings=data.get("ceilings", {}))


def _is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def json_row(r: dict) -> dict:
    """A result row JSON can hold: a number not measured (NaN) becomes null."""
    return {k: (None if _is_nan(v) else v) for k, v in r.items()}


def table_paths(prefix) -> tuple[Path, Path]:
    """``PREFIX.json`` and ``PREFIX.csv``."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".csv")


def unused_prefix(prefix) -> Path:
    """``prefix`` if neither ``PREFIX.json`` nor ``PREFIX.csv`` exists, else the first of ``PREFIX-2``,
    ``PREFIX-3``, ... for which neither does (a second run on the same day keeps the first one's files)."""
    prefix = Path(prefix)
    candidate, n = prefix, 1
    while any(p.exists() or p.is_symlink() for p in table_paths(candidate)):
        n += 1
        candidate = prefix.with_name(f"{prefix.name}-{n}")
    return candidate


def output_problem(prefix, overwrite: bool = False) -> str | None:
    """Why the tables cannot be written as ``PREFIX.json`` and ``PREFIX.csv``, or None if they can: a folder of
    that name, files there already (unless ``overwrite``), or a folder that cannot be made or written to. Asked
    before a run, so that a run's results are never lost at its end; the folder is created."""
    prefix = Path(prefix)
    if prefix.is_dir():
        return f"{prefix} is a folder; --out takes a path PREFIX and writes PREFIX.json and PREFIX.csv"
    for path in table_paths(prefix):
        if path.is_dir():
            return f"{path} is a folder"
        if (path.exists() or path.is_symlink()) and not overwrite:
            return f"{path} already exists; pass --overwrite to replace it, or choose another --out"
    return folder_problem(prefix.parent)


def folder_problem(folder) -> str | None:
    """Why no file can be written in ``folder``, or None if one can (the folder is created if missing)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        return f"cannot write to {folder}/: {e.strerror or e}"
    return None


def save_tables(prefix, payload: dict, rows, columns, overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``PREFIX.json`` (``payload``) and ``PREFIX.csv`` (``rows`` under ``columns``, a cell left blank where a
    number was not measured: None or NaN), creating the folder; returns both paths.

    Files already there are replaced only with ``overwrite``; otherwise the tables go to ``unused_prefix(prefix)``
    (``PREFIX-2.json``, ...), and the paths returned say where."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    while True:
        target = prefix if overwrite else unused_prefix(prefix)
        json_path, csv_path = table_paths(target)
        mode = "w" if overwrite else "x"  # "x": never replace a file another process wrote meanwhile
        try:
            with json_path.open(mode) as f:
                f.write(json.dumps(payload, indent=1) + "\n")
        except FileExistsError:
            continue
        try:
            f = csv_path.open(mode, newline="")
        except FileExistsError:
            json_path.unlink()
            continue
        with f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                writer.writerow({k: ("" if r.get(k) is None or _is_nan(r.get(k)) else r.get(k)) for k in columns})
        return json_path, csv_path


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


def ratio_text(x: float, digits: int = 3) -> str:
    """A speed ratio to ``digits`` significant digits, never in exponent form: 0.00123, 0.456, 1.23, 12.3, 1234
    (a CPU run puts flashlab on the interpreter at a thousandth of PyTorch's speed: two decimals would say 0.00)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


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
    hosts = [n for n in names if decode and any(not _is_nan(r.get("host_us", float("nan"))) for r in results.rows
                                                if r["backend"] == n and r["status"] == "ok")]  # fmt: skip
    head += [f"{n} host us" for n in hosts]
    lines = []
    for c in cells:
        line = [c[0], str(c[1]), "decode" if decode else "causal" if c[2] else "full", str(c[3]), str(c[4])]
        for name in names:
            r = status.get(c + (name,))
            if r is None or r["status"] != "ok":
                line.append("-" if r is None else r["status"])
            else:
                line.append(f"{r['bandwidth_gbps'] / 1e3:.3g}" if decode else f"{r['tflops']:.3g}")
        line += [ratio_text(vs_fa2[c]) if c in vs_fa2 else "-", ratio_text(vs_cudnn[c]) if c in vs_cudnn else "-"]
        for name in hosts:  # host time per eager call (decode: the launch cost the GPU work must hide)
            r = status.get(c + (name,))
            line.append(f"{r['host_us']:.0f}" if r is not None and r["status"] == "ok" else "-")
        lines.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    what = "decode, Q/K/V/O bandwidth in TB/s (or why not)" if decode else "forward TFLOP/s (or why not)"
    if results.meta.get("config", {}).get("mode") == "backward":
        what = "backward (dq, dk, dv from dO) TFLOP/s, 2.5x the forward's FLOPs (or why not)"
    out = [f"{results.meta['device_name']}, torch {results.meta['torch']}, triton {results.meta['triton']}, "
           f"{results.meta['date']} -- {what}"]  # fmt: skip
    out += [fmt.format(*head)] + [fmt.format(*line) for line in lines]
    for name, ratios in (("FA2 (sdpa_flash)", vs_fa2), ("cuDNN (sdpa_cudnn)", vs_cudnn)):
        if ratios:
            out.append(
                f"flashlab vs {name}: geo-mean {ratio_text(geomean(ratios.values()))}x over {len(ratios)} cells "
                f"(min {ratio_text(min(ratios.values()))}x, max {ratio_text(max(ratios.values()))}x)"
            )
        else:
            out.append(f"flashlab vs {name}: no cell where both ran")
    for paged in (n for n in names if n.startswith("paged")):  # the paged cache against the contiguous one
        ratios = speedups(results, paged, "flashlab")
        if ratios:
            out.append(
                f"{paged} vs flashlab (contiguous): geo-mean {ratio_text(geomean(ratios.values()))}x, "
                f"min {ratio_text(min(ratios.values()))}x; "
                + ", ".join(f"N={c[3]} B={c[4]} {ratio_text(x)}x" for c, x in ratios.items())
            )
    for eight in (n for n in names if n.startswith("paged") and n.endswith("_fp8")):  # 8-bit against 16-bit
        ratios = speedups(results, eight, eight.removesuffix("_fp8"))
        if ratios:
            sixteen = eight.removesuffix("_fp8")
            out.append(
                f"{eight} vs {sixteen} (16-bit cache): geo-mean {ratio_text(geomean(ratios.values()))}x (half the "
                "bytes: 2x where the cache's read is the step); "
                + ", ".join(f"N={c[3]} B={c[4]} {ratio_text(x)}x" for c, x in ratios.items())
            )
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
    if meta["config"].get("mode") in ("decode", "backward"):
        dtypes = meta["config"]["mode"] + "-" + dtypes
    return recording_prefix(meta, dtypes)


def gpu_slug(meta: dict) -> str:
    """The GPU's name as recordings are named after it: ``NVIDIA H200`` -> ``h200``."""
    return meta["device_name"].lower().replace("nvidia", "").strip().replace(" ", "-")


def recording_prefix(meta: dict, kind: str) -> Path:
    """``data/results/<gpu>-<kind>-<date>`` for a GPU run, ``test-artifacts/bench/cpu-<kind>-<date>`` on the CPU:
    the default name of every benchmark mode's files."""
    date = meta["date"][:10]
    if meta["is_cuda_gpu"]:
        return default_folder(True) / f"{gpu_slug(meta)}-{kind}-{date}"
    return default_folder(False) / f"cpu-{kind}-{date}"


def default_folder(is_cuda_gpu: bool) -> Path:
    """Where a run without ``--out`` writes: ``data/results/`` for a GPU's recordings, ``test-artifacts/bench/``
    (ignored by git, kept by ``make clean``) for CPU runs. A name taken already gets ``-2``, ``-3``, ...
    (``unused_prefix``)."""
    return Path("data/results") if is_cuda_gpu else Path("test-artifacts/bench")


def newest_gpu_results(directory="data/results", mode: str = "prefill", kv_dtype: str | None = None) -> Path | None:
    """The newest ``*.json`` in ``directory`` whose stamp says a CUDA GPU produced it in ``mode`` (by stamp date),
    or None. Decode recordings of an 8-bit cache (``--kv-dtype fp8``) are only found when ``kv_dtype`` names it:
    their grid is the paged backends' alone."""
    found = []
    for path in Path(directory).glob("*.json"):
        try:
            meta = json.loads(path.read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        file_mode = meta.get("mode") or (meta.get("config") or {}).get("mode", "prefill")  # traffic files: "traffic"
        kv_matches = (meta.get("config") or {}).get("kv_dtype") == kv_dtype
        if meta.get("tool") == "flashlab.bench" and meta.get("is_cuda_gpu") and file_mode == mode and kv_matches:
            found.append((meta.get("date", ""), path.name, path))
    return max(found)[2] if found else None
