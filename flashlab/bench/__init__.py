"""The benchmark harness: naive attention, flashlab's kernel and PyTorch's SDPA backends, side by side.

    python -m flashlab.bench                        # the GPU grid: bf16, D 64/128, N 1K..16K, 16K tokens
    python -m flashlab.bench --device cpu --quick   # a tiny grid on the CPU (flashlab runs in Triton's interpreter)
    python -m flashlab.bench --mode traffic         # HBM and L2 bytes per kernel, from Nsight Compute (traffic.py)

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

The package, one concept a module: ``grid`` (one cell, its FLOPs and bytes, the tolerances), ``implementations``
(what is timed, and the reference rows it is checked against), ``config`` (which cells a sweep runs), ``measure``
(one cell: check, memory, time; the ceilings), ``stamp`` (device, versions, date), ``sweep`` (run them all),
``results`` (rows, files, summaries) and ``cli``.

Once per GPU run the two ceilings of the roofline are measured too: device-to-device copy bandwidth and an
8192^3 bf16 matmul. Results go to ``PREFIX.csv`` and ``PREFIX.json`` stamped with the device, torch / triton /
CUDA versions, the date and the exact command; ``data/results/README.md`` describes the columns.
"""

from flashlab.bench.cli import build_parser, config_from_args, main
from flashlab.bench.config import BenchConfig
from flashlab.bench.grid import CAUSAL_CHOICES, DTYPES, STAMP_COLUMNS, TOLERANCE, Cell, attention_flops
from flashlab.bench.implementations import BACKENDS, DEFAULT_BACKENDS, Backend, naive_attention, reference_rows
from flashlab.bench.measure import bench_cell, check_rows, measure_ceilings, peak_extra_bytes, time_ms
from flashlab.bench.results import (
    ROW_COLUMNS,
    BenchResults,
    default_prefix,
    geomean,
    newest_gpu_results,
    speedups,
    summary_table,
)
from flashlab.bench.stamp import environment_stamp
from flashlab.bench.sweep import run_sweep

__all__ = [
    "BACKENDS", "DEFAULT_BACKENDS", "Backend", "naive_attention", "reference_rows",
    "build_parser", "config_from_args", "main",
    "CAUSAL_CHOICES", "DTYPES", "STAMP_COLUMNS", "TOLERANCE", "BenchConfig", "Cell", "attention_flops",
    "bench_cell", "check_rows", "measure_ceilings", "peak_extra_bytes", "time_ms",
    "ROW_COLUMNS", "BenchResults", "default_prefix", "environment_stamp", "geomean", "newest_gpu_results",
    "run_sweep", "speedups", "summary_table",
]  # fmt: skip
