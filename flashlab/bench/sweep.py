"""Run a sweep: every cell of a configuration, every backend, with a progress bar."""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict

from flashlab.bench.backward_cell import bench_cell_backward
from flashlab.bench.config import BenchConfig
from flashlab.bench.implementations import BACKENDS, Backend, flashlab_variant
from flashlab.bench.measure import bench_cell, measure_ceilings
from flashlab.bench.results import BenchResults
from flashlab.bench.stamp import environment_stamp


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
    if (config.kernel_config, config.tile_order, config.tma) != (None, None, None):
        variant = flashlab_variant(config.kernel_config, config.tile_order, config.tma)
        backends = [variant if b.name == "flashlab" else b for b in backends]
    meta = environment_stamp(config.device)
    meta["command"] = command or "python -m flashlab.bench " + shlex.join(config.to_argv())
    meta["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()}
    meta["timing"] = (
        "triton.testing.do_bench, median" if config.device == "cuda" else "time.perf_counter per call, median"
    )
    if config.mode != "backward":
        meta["timing"] += f"; {config.rounds} round(s) per cell, the backends' order turning each round, median round"
    meta["backends"] = {b.name: b.description for b in backends}
    cells = config.cells()
    ceilings = measure_ceilings(config.device) if config.ceilings else {}
    rows = []
    start = time.perf_counter()
    bar = tqdm(total=len(cells) * len(backends), desc="flashlab.bench", unit="run", disable=not progress)
    for cell in cells:
        bar.set_postfix_str(cell.label())
        cell_rows = (bench_cell_backward if config.mode == "backward" else bench_cell)(cell, backends, config, meta)
        rows += cell_rows
        bar.update(len(cell_rows))
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return BenchResults(meta=meta, rows=rows, ceilings=ceilings)
