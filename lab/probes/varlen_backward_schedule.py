"""The packed varlen forward + backward on the varlen bar's cells (log-normal batches of 32 documents, H = 16 over
4 K/V heads, bf16) under several schedules of the backward's two kernels, beside torch's varlen_attn:

- ``TILE_MAJOR``: the grid walks every sequence's first tile, then every second, ... (the causal band's heaviest
  dK/dV tiles start first, instead of one sequence's tiles after another's);
- ``FROM_END``: dQ's tiles counted from each sequence's end (causal: its heaviest tile first);
- ``GROUP_SPLIT``: 2 or 4 programs share a K/V head's group of query heads, each writing a float32 part of dK, dV
  (4x the programs where 32 sequences x 4 K/V heads leave the GPU's 132 SMs unevenly loaded).

Then where the time goes: each kernel's GPU time (torch.profiler) and the host's time to issue a step.

Last, the bench's varlen grid (``--mode varlen``, the log-normal mixes) runs under the schedule with the best
geo-mean speedup here, writing to BENCH_OUT (when given).

python lab/probes/varlen_backward_schedule.py OUT_FILE [BENCH_OUT]"""

import math
import sys
import time

import torch
from probe_log import log_to
from varlen_batch import TrainingCell, issue_and_finish, tile_config

from flashlab.bench.varlen import torch_varlen_attn
from flashlab.host import varlen as host_varlen

say = log_to(sys.argv[1])
default_config = host_varlen.backward_config

SCHEDULES = {
    "default": ({}, {}),
    "tile-major": ({"TILE_MAJOR": True}, {"TILE_MAJOR": True}),
    "tile-major+from-end": ({"TILE_MAJOR": True}, {"TILE_MAJOR": True, "FROM_END": True}),
    "split2": ({"GROUP_SPLIT": 2}, {}),
    "split4": ({"GROUP_SPLIT": 4}, {}),
    "split2+tm+fe": ({"GROUP_SPLIT": 2, "TILE_MAJOR": True}, {"TILE_MAJOR": True, "FROM_END": True}),
    "split4+tm+fe": ({"GROUP_SPLIT": 4, "TILE_MAJOR": True}, {"TILE_MAJOR": True, "FROM_END": True}),
    "dkdv32x64+tm+fe": ({"TILE_MAJOR": True, "tiles": (32, 64, 4, 3)}, {"TILE_MAJOR": True, "FROM_END": True}),
    "split2+dkdv32x64+tm+fe": ({"GROUP_SPLIT": 2, "TILE_MAJOR": True, "tiles": (32, 64, 4, 3)},
                               {"TILE_MAJOR": True, "FROM_END": True}),
}  # fmt: skip
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def use(schedule):
    def config(kernel, q):
        base = default_config(kernel, q)
        extra = dict(schedule[0] if kernel == "dkdv" else schedule[1])
        tiles = extra.pop("tiles", None)
        if tiles is not None:
            base = tile_config(tiles)
        return {**base, **extra}

    host_varlen.backward_config = config


def run_cell(tokens, d, causal, profile=False):
    cell = TrainingCell(theirs, tokens, d, causal)
    step, step_theirs, ms_ref = cell.step, cell.step_theirs, cell.ms_ref
    row = [f"{cell.label}: varlen_attn {ms_ref * 1e3:6.0f}"]
    speedups = {}
    for name, schedule in SCHEDULES.items():
        use(schedule)
        err = cell.error()
        ms = cell.time(step)
        row.append(f"{name} {ms * 1e3:6.0f} x{ms_ref / ms:.2f} e{err:.0e}")
        speedups[name] = ms_ref / ms if err < 0.05 else 0.0
    say(" | ".join(row))
    if not profile:
        return speedups
    for label, fn in (("flashlab default", step), ("varlen_attn", step_theirs)):
        use(SCHEDULES["default"])
        for _ in range(3):
            fn()
        issued, done = issue_and_finish(fn, 20)
        say(f"  {label}: host issues a step in {issued:.0f} us, a step takes {done:.0f} us back to back")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            say(f"    {ev.key[:60]:60s} {ev.device_time_total / 5:8.1f} us/step  x{ev.count // 5}")
    return speedups


cells = [run_cell(tokens, d, causal, profile=(tokens == 16384 and d == 64))
         for tokens, d, causal in ((16384, 64, True), (16384, 64, False), (16384, 128, True), (16384, 128, False),
                                   (65536, 64, True), (65536, 128, True))]  # fmt: skip
geo = {name: math.prod(c[name] for c in cells) ** (1 / len(cells)) for name in SCHEDULES}
lowest = {name: min(c[name] for c in cells) for name in SCHEDULES}
for name in SCHEDULES:
    say(f"{name:24s} geo-mean x{geo[name]:.3f} over varlen_attn, lowest x{lowest[name]:.3f}")
best = max(SCHEDULES, key=lambda name: geo[name])
say(f"best: {best}")
if len(sys.argv) > 2:
    from flashlab.bench.cli import main

    use(SCHEDULES[best])
    main(["--mode", "varlen", "--mixes", "log-normal", "--tokens", "16384,65536", "--head-dim", "64,128",
          "--kv-heads", "4", "--no-progress", "--out", sys.argv[2]])  # fmt: skip
