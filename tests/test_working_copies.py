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


@pytest.mark.parametrize("nb", ["../notebooks/03", "notebooks/03", "/tmp/03", "03/..", "0*", "03 04", "03;true"])
def test_reset_takes_a_number_or_name_never_a_path(repo, nb):
    _make(repo, "copies")
    committed = {p.name: p.read_bytes() for p in (repo / "notebooks").glob("*.ipynb")}
    out = _make(repo, "reset", f"NB={nb}", check=False)
    assert out.returncode != 0 and "by its number or name only" in out.stdout + out.stderr
    assert {p.name: p.read_bytes() for p in (repo / "notebooks").glob("*.ipynb")} == committed
    assert not (repo / WORK / ".before-reset").exists()
    assert _git(repo, "status", "--porcelain") == ""


def test_every_reset_keeps_the_copy_it_replaces(repo):
    _make(repo, "copies")
    work = repo / WORK
    target = next(work.glob("03_*.ipynb"))
    kept = work / ".before-reset"
    _answer(target, "first answer")
    _make(repo, "reset", "NB=03")
    _answer(target, "second answer")
    out = _make(repo, "reset", "NB=03").stdout
    second = kept / target.name.replace(".ipynb", "-2.ipynb")
    assert "first answer" in (kept / target.name).read_text()
    assert "second answer" in second.read_text() and f"your previous copy: {WORK}/.before-reset/{second.name}" in out
    _answer(target, "third answer")
    _make(repo, "reset", "NB=03")
    assert "third answer" in (kept / target.name.replace(".ipynb", "-3.ipynb")).read_text()


def test_clean_keeps_the_cpu_benchmark_results(repo):
    bench = repo / "test-artifacts" / "bench"
    bench.mkdir(parents=True)
    (bench / "cpu-fp32-2026-12-03.json").write_text("{}")
    (repo / "test-artifacts" / "notebooks").mkdir()
    (repo / "test-artifacts" / "notebooks" / "01.ipynb").write_text("{}")
    (repo / "test-artifacts" / "explorer.png").write_text("png")
    (repo / ".pytest_cache").mkdir()
    _make(repo, "clean")
    assert (bench / "cpu-fp32-2026-12-03.json").read_text() == "{}"
    assert sorted(p.name for p in (repo / "test-artifacts").iterdir()) == ["bench"]
    assert not (repo / ".pytest_cache").exists()
