"""``python -m flashlab.grade.solutions``: solved copies never replace an input, never replace each other, and
replace an existing file only when told to; nothing is written when anything is refused."""

from __future__ import annotations

import nbformat
import pytest

from conftest import NOTEBOOKS, ROOT
from flashlab.grade.cells import find_exercise_cells
from flashlab.grade.solutions import main

SOLUTIONS_DIR = ROOT / "instructor" / "solutions"


@pytest.fixture
def learner(tmp_path):
    """A learner's notebook 07 with an answer of their own in the exercise cell."""
    folder = tmp_path / "mine"
    folder.mkdir()
    nb = nbformat.read(NOTEBOOKS / next(p.name for p in NOTEBOOKS.glob("07_*.ipynb")), as_version=4)
    cell = find_exercise_cells(nb)["07.kv_cache_bytes_per_token"]
    nb.cells[cell.index].source = "def kv_cache_bytes_per_token(*a, **k):\n    return 42  # my own work\n"
    nbformat.write(nb, folder / "07_mine.ipynb")
    return folder / "07_mine.ipynb"


def _run(*args):
    return main([*map(str, args), "--solutions", str(SOLUTIONS_DIR)])


def test_out_pointed_at_its_input_is_refused(learner, capsys):
    before = learner.read_bytes()
    for out in (learner.parent, learner.parent / "." / ""):
        with pytest.raises(SystemExit) as e:
            _run(learner, "--out", out)
        assert e.value.code == 2 and "would replace the learner's exercise cells" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            _run(learner, "--out", out, "--overwrite")  # not even when told to overwrite
        capsys.readouterr()
    assert learner.read_bytes() == before


def test_same_named_inputs_are_refused_not_written_over_each_other(learner, tmp_path, capsys):
    other = tmp_path / "theirs"
    other.mkdir()
    (other / learner.name).write_bytes(learner.read_bytes())
    out = tmp_path / "solved"
    with pytest.raises(SystemExit) as e:
        _run(learner, other / learner.name, "--out", out)
    assert e.value.code == 2 and "would both be written to" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_an_existing_file_is_replaced_only_with_overwrite(learner, tmp_path, capsys):
    out = tmp_path / "solved"
    out.mkdir()
    (out / learner.name).write_text("my notes")
    with pytest.raises(SystemExit) as e:
        _run(learner, "--out", out)
    assert e.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    assert (out / learner.name).read_text() == "my notes"
    assert _run(learner, "--out", out, "--overwrite") == 0
    solved = find_exercise_cells(nbformat.read(out / learner.name, as_version=4))["07.kv_cache_bytes_per_token"]
    assert "my own work" not in solved.source and "def kv_cache_bytes_per_token" in solved.source
    assert "my own work" in learner.read_text()  # the input is as it was
