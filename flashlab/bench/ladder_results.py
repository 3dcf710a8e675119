"""The kernel ladder in a benchmark's results: every rung's TFLOP/s against sequence length, and what each step from
one rung to the next bought.

One sweep that names the rungs' backends times every rung of flashlab's forward kernel on the same cells, each
checked against the float64 reference first, with PyTorch's kernels beside them for scale::

    python -m flashlab.bench --backends flashlab_lesson_loop,flashlab_skip_split,sdpa_flash,sdpa_cudnn

- ``rung_backends(results)``: the rungs a file holds, slowest first (the ladder's order, ``flashlab.kernels.ladder``;
  a rung this copy of flashlab does not know comes after the known ones, in the file's order).
- ``steps(results)``: for each pair of neighbouring rungs in the file and each panel (head dim x mask), the speed
  ratio of the upper rung over the lower one per sequence length, and its geometric mean. Both rungs ran the same
  cells, so a time ratio is a TFLOP/s ratio. ``against(results, other)`` sets the fastest rung beside another
  backend the same way (PyTorch's FlashAttention-2 or cuDNN).
- ``plot_ladder(results)``: TFLOP/s against N, one panel per head dim and mask, one line per rung (PyTorch's kernels
  dashed); a backend missing from the file is simply not drawn.
- ``notebook_ladder(recording)``: what notebook 05 shows -- a short live sweep on a GPU, else the recording, else a
  tiny sweep through Triton's interpreter on the CPU (whose times say nothing about a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from flashlab.bench.config import BenchConfig
from flashlab.bench.implementations import RUNG_PREFIX
from flashlab.bench.results import BenchResults, geomean, speedups
from flashlab.kernels import ladder

COMPARATORS = {"sdpa_flash": "PyTorch SDPA FlashAttention-2", "sdpa_cudnn": "PyTorch SDPA cuDNN"}


def rung_backends(results: BenchResults) -> list[str]:
    """The ``flashlab_<rung>`` backends present in ``results``, slowest rung first."""
    present = list(dict.fromkeys(r["backend"] for r in results.rows if r["backend"].startswith(RUNG_PREFIX)))
    known = [RUNG_PREFIX + n for n in ladder.names()]
    return [b for b in known if b in present] + [b for b in present if b not in known]


def removes(results: BenchResults, backend: str) -> str:
    """What a rung removes against the rung below it: the ladder's own line, else the file's backend description."""
    name = backend.removeprefix(RUNG_PREFIX)
    if name in ladder.names():
        return ladder.rung_named(name).removes
    described = results.meta.get("backends", {}).get(backend, "(not described)")
    return described.split("the ladder's rung that removes ", 1)[-1]  # as rung_backend describes a rung


def panels(results: BenchResults) -> list[tuple[str, int, bool]]:
    """``(dtype, head_dim, causal)`` of every panel where some backend was checked and timed."""
    return sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in results.ok_rows()})


def curve(results: BenchResults, backend: str, dtype: str, head_dim: int, causal: bool):
    """``(N, TFLOP/s)`` arrays of one backend in one panel, by sequence length (checked-and-timed rows only)."""
    rows = sorted(results.ok_rows(backend=backend, dtype=dtype, head_dim=head_dim, causal=causal),
                  key=lambda r: r["seq_len"])  # fmt: skip
    return np.array([r["seq_len"] for r in rows]), np.array([r["tflops"] for r in rows], dtype=float)


@dataclass(frozen=True)
class Step:
    """How much faster ``upper`` ran than ``lower`` in one panel: ``ratios`` maps sequence length to time of
    ``lower`` / time of ``upper`` (above 1: ``upper`` is faster)."""

    lower: str
    upper: str
    dtype: str
    head_dim: int
    causal: bool
    ratios: dict

    @property
    def geomean(self) -> float:
        return geomean(self.ratios.values())

    @property
    def lowest(self) -> float:
        return min(self.ratios.values())

    @property
    def highest(self) -> float:
        return max(self.ratios.values())

    def line(self) -> str:
        mask = "causal" if self.causal else "no mask"
        lengths = sorted(self.ratios)
        return (
            f"{self.upper} / {self.lower}, {self.dtype} D = {self.head_dim}, {mask}: {self.geomean:.2f}x geo-mean "
            f"over N = {lengths[0]:,}..{lengths[-1]:,} ({len(lengths)} lengths; {self.lowest:.2f}x to "
            f"{self.highest:.2f}x)"
        )


def _step(results, lower, upper) -> list[Step]:
    by_panel: dict = {}
    for (dtype, d, causal, n, _batch), x in speedups(results, upper, lower).items():
        by_panel.setdefault((dtype, d, causal), {})[n] = x
    return [Step(lower, upper, *panel, ratios) for panel, ratios in sorted(by_panel.items())]


def steps(results: BenchResults) -> list[Step]:
    """Each step up the ladder the file holds: neighbouring rungs, every panel where both ran."""
    rungs = rung_backends(results)
    return [s for lower, upper in zip(rungs, rungs[1:], strict=False) for s in _step(results, lower, upper)]


def against(results: BenchResults, other: str) -> list[Step]:
    """The fastest rung in the file (the top one) over ``other`` (e.g. ``sdpa_flash``), per panel."""
    rungs = rung_backends(results)
    return _step(results, other, rungs[-1]) if rungs else []


def step_lines(results: BenchResults) -> list[str]:
    """The steps and the comparison with PyTorch's kernels as text (the benchmark prints them after its table)."""
    lines = [s.line() for s in steps(results)]
    for other in COMPARATORS:
        lines += [s.line() for s in against(results, other)]
    return lines


def plot_ladder(results: BenchResults, title: str | None = None):
    """TFLOP/s against sequence length: one panel per (dtype, head dim, mask), one line per rung, slowest the
    lightest, and PyTorch's kernels dashed. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rungs = rung_backends(results)
    shown = panels(results)
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(3.8 * max(1, len(shown)), 3.6), sharey=True,
                             squeeze=False)  # fmt: skip
    shades = plt.get_cmap("Blues")(np.linspace(0.45, 1.0, max(1, len(rungs))))  # one shade per rung, darker up
    styles = [(b, b.removeprefix(RUNG_PREFIX), dict(color=shades[i], marker="o", ls="-")) for i, b in enumerate(rungs)]
    colours = {"sdpa_flash": "tab:orange", "sdpa_cudnn": "tab:green"}
    styles += [(b, label, dict(color=colours[b], marker="^", ls="--", lw=1)) for b, label in COMPARATORS.items()]
    for ax, (dtype, d, causal) in zip(axes[0], shown, strict=False):
        for backend, label, style in styles:
            n, tflops = curve(results, backend, dtype, d, causal)
            if len(n):
                ax.plot(n, tflops, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype}, D = {d}, {'causal' if causal else 'no mask'}", fontsize=10)
        ax.set_xlabel("sequence length N")
    axes[0, 0].set_ylabel("TFLOP/s")
    legend = {}  # label -> line, over every panel (a backend may be missing from some)
    for ax in axes[0]:
        legend.update({line.get_label(): line for line in ax.get_lines()})
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 5), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# The sweeps a notebook runs when it has no recording to show: on a GPU a short one of the recorded kind; on a CPU
# a tiny one through Triton's interpreter (its times follow the NumPy work of each rung -- the tiles it computes
# and the masks it applies -- not a GPU's speed).
LIVE_GPU = BenchConfig(device="cuda", seq_lens=(512, 1024, 2048, 4096, 8192), head_dims=(128,), dtypes=("bf16",),
                       warmup=10, rep=40, ceilings=False)  # fmt: skip
LIVE_CPU = BenchConfig(device="cpu", seq_lens=(32, 64), head_dims=(16,), dtypes=("fp32",), tokens=64, model_dim=16,
                       warmup=0.0, rep=1.0)  # fmt: skip


def notebook_ladder(recording, live="auto", cuda=None) -> tuple[BenchResults | None, str]:
    """What a notebook shows, and where it came from: ``(results, source)``, source one of "live GPU", "recorded
    GPU", "recorded CPU", "live CPU" (or why there is nothing).

    ``live="auto"``: a live sweep (``LIVE_GPU``) when this machine has a GPU, else the ``recording`` (a path to a
    sweep's ``.json``) if it exists, else a tiny CPU sweep (``LIVE_CPU``). ``live=False``: the recording or
    nothing (``(None, why)``). Every sweep runs every rung of this copy's ladder and PyTorch's kernels. ``cuda``
    overrides whether a GPU is used (None: whether torch sees one)."""
    import torch

    from flashlab.bench.sweep import run_sweep

    backends = tuple(RUNG_PREFIX + n for n in ladder.names())
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if live and cuda:
        config = replace(LIVE_GPU, backends=backends + tuple(COMPARATORS))
        return run_sweep(config, progress=False), "live GPU"
    recording = Path(recording)
    if recording.exists():
        results = BenchResults.load(recording)
        return results, f"recorded {'GPU' if results.meta.get('is_cuda_gpu') else 'CPU'}"
    if not live:
        return None, f"no recording at {recording}"
    config = replace(LIVE_CPU, backends=backends + ("sdpa_flash",))
    return run_sweep(config, progress=False), "live CPU"


__all__ = [
    "COMPARATORS",
    "LIVE_CPU",
    "LIVE_GPU",
    "Step",
    "against",
    "curve",
    "notebook_ladder",
    "panels",
    "plot_ladder",
    "removes",
    "rung_backends",
    "step_lines",
    "steps",
]
