"""Shared test set-up: repository paths, skipping GPU tests where there is no GPU, and the parallel run.

The suite runs in parallel (pytest-xdist, ``-n auto`` in pyproject.toml's addopts; ``-n 0`` runs it in one
process). ``auto`` is this machine's usable CPUs (a container's CPU quota counts), at most ``MAX_WORKERS``. Each
worker, and every process it starts (notebook kernels, command-line runs, JupyterLab), gets its share of the CPUs
as its torch/BLAS thread count: two workers that each spin two OpenMP threads on two cores slow each other down
several times over (notebook 09's naive-attention training went from 2 s to 24 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Past this many workers the longest single tests (notebook 09, the browser test) set the wall time, and each
# worker holds its own torch and Triton (about 1 GB).
MAX_WORKERS = 8
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, lowered to a cgroup's CPU quota where one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):  # cgroup v2, v1
        try:
            fields = Path(path).read_text().split()
            if path.endswith("cpu.max"):
                quota, period = fields
            else:
                quota, period = fields[0], Path(path).with_name("cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1"):
                n = min(n, int(quota) // int(period))
        except (OSError, ValueError):
            continue
    return max(1, n)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own override
    return min(usable_cpus(), MAX_WORKERS)


def _share_the_cpus_between_workers():
    """In an xdist worker: torch, OpenMP and BLAS threads = this worker's share of the CPUs (unless already set)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return
    share = max(1, usable_cpus() // workers)
    for var in THREAD_VARS:
        os.environ.setdefault(var, str(share))  # before numpy and torch load, and inherited by child processes
    if "torch" in sys.modules:  # already loaded by a plugin: tell it directly
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cpus_between_workers()


# The notebook, grader and widget tests need the Jupyter packages the project's own install brings. On a machine
# that lacks them (a bare GPU image running ``pytest -m gpu``) their modules are left out of the collection, and the
# report's header says which and why, rather than nine import errors. None of them holds a GPU test.
JUPYTER_TESTS = {
    "nbformat": ("test_grader.py", "test_grader_cli.py", "test_grader_install.py", "test_grader_solutions.py",
                 "test_notebook_claims.py", "test_notebooks.py", "test_packing.py", "test_working_copies.py"),
    "ipywidgets": ("test_widgets.py",),
}  # fmt: skip


def _missing_packages() -> list[str]:
    import importlib.util

    return [name for name in JUPYTER_TESTS if importlib.util.find_spec(name) is None]


collect_ignore = [module for name in _missing_packages() for module in JUPYTER_TESTS[name]]


def pytest_report_header(config):
    missing = _missing_packages()
    if missing:
        left_out = ", ".join(module for name in missing for module in JUPYTER_TESTS[name])
        return f"left out (no {', '.join(missing)} here; `make install` brings them): {left_out}"
    return None


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
