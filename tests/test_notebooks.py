"""Every notebook is committed without outputs, and executes top to bottom on a CPU within its time budget.

"Committed" means what git tracks: the check reads each notebook from git's index (what the next commit holds),
so a notebook opened and saved in place does not fail it until its outputs are staged. Learners work in their own
copies (``make lab``, ``my-notebooks/``), which git ignores. Outside a git checkout the files themselves are read.

A notebook states its CPU budget in its metadata (``metadata.flashlab.cpu_budget_s``; 60 s if absent). The
executed copies are kept under ``test-artifacts/notebooks/`` for anyone who wants to look at what ran. What the
executed copy says about speed is checked against the recordings it drew (``notebook_claims``), in the same run.
"""

from __future__ import annotations

import subprocess
import time

import nbformat
import notebook_claims
import pytest

from conftest import ARTIFACTS, NOTEBOOKS, ROOT

NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
DEFAULT_BUDGET_S = 60


def tracked_notebook(path, root=ROOT):
    """The notebook as git tracks it (its staged version); the file on disk if git does not track it."""
    rel = path.relative_to(root).as_posix()
    try:
        shown = subprocess.run(["git", "-C", str(root), "show", f":{rel}"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):  # no git, not a checkout, or a notebook not yet added
        return nbformat.read(path, as_version=4)
    return nbformat.reads(shown.stdout, as_version=4)


def test_there_are_notebooks():
    assert NOTEBOOK_PATHS, f"no notebooks found in {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=[p.name for p in NOTEBOOK_PATHS])
def test_notebook_committed_without_outputs(path):
    nb = tracked_notebook(path)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=[p.name for p in NOTEBOOK_PATHS])
def test_notebook_names_the_newest_recordings_and_types_no_ratio(path):
    notebook_claims.check_source(path.name, tracked_notebook(path))


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
    notebook_claims.check_executed(path.name, nb)
