"""Every notebook is committed without outputs, and executes top to bottom on a CPU within its time budget.

A notebook states its CPU budget in its metadata (``metadata.flashlab.cpu_budget_s``; 60 s if absent). The
executed copies are kept under ``test-artifacts/notebooks/`` for anyone who wants to look at what ran.
"""

from __future__ import annotations

import time

import nbformat
import pytest

from conftest import ARTIFACTS, NOTEBOOKS

NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
DEFAULT_BUDGET_S = 60


def test_there_are_notebooks():
    assert NOTEBOOK_PATHS, f"no notebooks found in {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=[p.name for p in NOTEBOOK_PATHS])
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=[p.name for p in NOTEBOOK_PATHS])
def test_notebook_executes_on_cpu(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    budget = nb.metadata.get("flashlab", {}).get("cpu_budget_s", DEFAULT_BUDGET_S)
    client = NotebookClient(
        nb, timeout=max(budget, 60), kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        out = ARTIFACTS / "notebooks"
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / path.name)
    elapsed = time.perf_counter() - start
    assert elapsed < budget, f"{path.name} took {elapsed:.0f} s on CPU; its budget is {budget} s"
