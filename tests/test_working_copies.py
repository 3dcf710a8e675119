"""`make lab` works in the learner's own copies of the notebooks; the committed notebooks stay as committed.

The Makefile's ``copies`` step (run by ``make lab``) copies each notebook missing from ``my-notebooks/`` and never
overwrites one that is there; ``make reset NB=03`` puts the committed version of one notebook back, keeping the
learner's old copy in ``my-notebooks/.before-reset/``. These tests run those steps in a throwaway git repository
made from this checkout's Makefile, .gitignore and notebooks, then check that git sees nothing to commit.
"""

from __future__ import annotations

import shutil
import subprocess

import nbformat
import pytest
from test_notebooks import tracked_notebook

from conftest import NOTEBOOKS, ROOT

WORK = "my-notebooks"
pytestmark = pytest.mark.skipif(not (shutil.which("make") and shutil.which("git")), reason="needs make and git")


def _git(repo, *args):
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _make(repo, *args, check=True):
    out = subprocess.run(["make", "--no-print-directory", "-C", str(repo), *args], capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture
def repo(tmp_path):
    """A fresh repository holding what the copy step needs, committed."""
    root = tmp_path / "flashlab"
    (root / "notebooks").mkdir(parents=True)
    for name in ("Makefile", ".gitignore"):
        shutil.copy(ROOT / name, root / name)
    for nb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        shutil.copy(nb, root / "notebooks" / nb.name)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "fresh")
    return root


def _answer(path, text):
    """What JupyterLab saves after a learner's work: a changed cell and an output."""
    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.source += f"\n{text}"
    code.outputs = [nbformat.v4.new_output("stream", text=text)]
    code.execution_count = 1
    nbformat.write(nb, path)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_working_folder_is_ignored_by_git():
    assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", f"{WORK}/01_x.ipynb"]).returncode == 0


def test_copies_are_made_once_and_kept(repo):
    names = sorted(p.name for p in (repo / "notebooks").glob("*.ipynb"))
    out = _make(repo, "copies").stdout
    work = repo / WORK
    assert sorted(p.name for p in work.glob("*.ipynb")) == names
    for name in names:
        assert (work / name).read_bytes() == (repo / "notebooks" / name).read_bytes()
        assert f"new working copy: {WORK}/{name}" in out
    assert f"{repo}/{WORK}/" in out  # the path is printed

    first, second = work / names[0], work / names[1]
    _answer(first, "my answer")
    second.unlink()
    out = _make(repo, "copies").stdout
    assert "my answer" in first.read_text()  # an existing copy is never overwritten
    assert second.read_bytes() == (repo / "notebooks" / names[1]).read_bytes()  # a missing one is copied again
    assert out.count("new working copy") == 1
    assert _git(repo, "status", "--porcelain") == ""  # the answers are invisible to git


def test_reset_restores_one_notebook_and_keeps_the_old_copy(repo):
    _make(repo, "copies")
    work = repo / WORK
    target = next(work.glob("03_*.ipynb"))
    other = next(work.glob("02_*.ipynb"))
    _answer(target, "answer to 03")
    _answer(other, "answer to 02")
    out = _make(repo, "reset", "NB=03").stdout
    assert target.read_bytes() == (repo / "notebooks" / target.name).read_bytes()
    assert "answer to 03" in (work / ".before-reset" / target.name).read_text()
    assert "answer to 02" in other.read_text()  # only the named notebook is reset
    assert f"reset: {WORK}/{target.name}" in out
    assert _git(repo, "status", "--porcelain") == ""


@pytest.mark.parametrize(
    "args,message",
    [((), "say which notebook"), (("NB=99",), "exactly one notebook"), (("NB=0",), "exactly one notebook")],
)
def test_reset_names_the_problem(repo, args, message):
    out = _make(repo, "reset", *args, check=False)
    assert out.returncode != 0 and message in out.stdout + out.stderr


def test_outputs_check_reads_what_git_tracks(repo):
    # a notebook saved in place with outputs is not committed until it is staged; the check reads the index
    path = next((repo / "notebooks").glob("01_*.ipynb"))
    _answer(path, "saved in place")
    assert any(c.get("outputs") for c in nbformat.read(path, as_version=4).cells)  # on disk: outputs
    tracked = tracked_notebook(path, root=repo)
    assert not any(c.get("outputs") for c in tracked.cells if c.cell_type == "code")
    _git(repo, "add", str(path))
    staged = tracked_notebook(path, root=repo)
    assert any(c.get("outputs") for c in staged.cells if c.cell_type == "code")
