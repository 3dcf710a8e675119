"""The grader is honest and hard to fool: stubs score 0, reference solutions score full marks, bad answers lose
exactly their own exercise's points, and nothing a submission does crashes the grader.

Submissions are generated here from the exercise registry and ``instructor/solutions`` (no fixtures to go stale):
every bad submission is a solved notebook with one exercise cell replaced, so the other exercise in the same
notebook shows that it is still graded correctly. Everything is graded in a few batched runs, in parallel.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import NOTEBOOKS, ROOT
from flashlab import exercises
from flashlab.exercises import MODULES, all_exercises, exercises_of
from flashlab.exercises._checks import expect_array, expect_int, expect_number
from flashlab.grade import check, grade
from flashlab.grade.cells import find_exercise_cells, runnable_code
from flashlab.grade.solutions import exercise_cells, has_exercises, load_solutions

LEARNER_NOTEBOOKS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = load_solutions()
BAD_TIME_LIMIT_S = 10

# -- bad answers: (name, notebook, exercise replaced, its cell) ---------------------------------------------------
BAD = {
    "wrong": (
        "01",
        "01.online_softmax_update",
        """
import numpy as np

def online_softmax_update(m, l, block):
    m_new = max(m, float(np.max(block)))
    return m_new, l + float(np.exp(np.asarray(block) - m_new).sum()), 1.0  # forgot to rescale the old sum
""",
    ),
    "hardcoded": (
        "01",
        "01.streaming_attention",
        """
def streaming_attention(scores, values, block_size):
    return 2.471  # the lesson's answer, whatever the input
""",
    ),
    "raises": (
        "01",
        "01.streaming_attention",
        """
def streaming_attention(scores, values, block_size):
    raise ValueError("I give up")
""",
    ),
    "hangs": (
        "01",
        "01.online_softmax_update",
        """
def online_softmax_update(m, l, block):
    while True:
        pass
""",
    ),
    "mutates": (
        "01",
        "01.streaming_attention",
        """
import numpy as np

def streaming_attention(scores, values, block_size):
    scores -= scores.max()  # in place: the caller's array changes
    p = np.exp(scores)
    return p @ values / p.sum()
""",
    ),
    "calls_reference": (
        "01",
        "01.streaming_attention",
        """
from flashlab.reference import online_attention

def streaming_attention(scores, values, block_size):
    out, _ = online_attention(scores, values, block_size)
    return out
""",
    ),
    "calls_reference_06": (
        "06",
        "06.merge_split_kv",
        """
import flashlab.reference

def merge_split_kv(outs, lses):
    return flashlab.reference.merge_partials(list(outs), list(lses))
""",
    ),
    "prints_megabytes": (
        "01",
        "01.online_softmax_update",
        SOLUTIONS["01.online_softmax_update"].replace(
            "    block = np.asarray", "    print('x' * 3_000_000)\n    block = np.asarray"
        ),
    ),
    "syntax_error": (
        "01",
        "01.online_softmax_update",
        """
def online_softmax_update(m, l, block)
    return m, l, 1.0
""",
    ),
    "exits": (
        "02",
        "02.attention_traffic",
        """
import os

def attention_traffic(n, d, dtype_bytes=2):
    os._exit(3)
""",
    ),
}


def notebook_of(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# a submission"), *cells]
    return nb


def solved_notebook(nb_id: str, replace: dict[str, str] | None = None) -> nbformat.NotebookNode:
    nb = notebook_of(exercise_cells(nb_id))
    for ex_id, cell in find_exercise_cells(nb).items():
        nb.cells[cell.index].source = (replace or {}).get(ex_id, SOLUTIONS[ex_id])
    return nb


def by_path(subs):
    return {Path(s.path).name: {r.exercise_id: r for r in s.results} for s in subs}


@pytest.fixture(scope="module")
def stubs_and_solutions(tmp_path_factory):
    """The learner notebooks as committed, and a solved notebook per notebook number, graded in one run."""
    root = tmp_path_factory.mktemp("graded")
    solved = root / "solved"
    solved.mkdir()
    for nb_id in MODULES:
        nbformat.write(solved_notebook(nb_id), solved / f"{nb_id}_solved.ipynb")
    learner = [p for p in LEARNER_NOTEBOOKS if has_exercises(nbformat.read(p, as_version=4))]
    subs = grade([*learner, solved], out_dir=root / "out", progress=False)
    return by_path(subs), root / "out"


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    """The bad submissions, graded through the command line with a short time limit."""
    root = tmp_path_factory.mktemp("bad")
    subs = root / "subs"
    subs.mkdir()
    for name, (nb_id, ex_id, code) in BAD.items():
        nbformat.write(solved_notebook(nb_id, {ex_id: code.strip() + "\n"}), subs / f"{nb_id}_{name}.ipynb")
    (subs / "01_not_a_notebook.ipynb").write_text("{ this is not JSON")
    out = root / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "flashlab.grade", str(subs), "--out", str(out), "--time-limit", str(BAD_TIME_LIMIT_S)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    rows = {Path(r["submission"]).name: r for r in csv.DictReader(open(out / "grades.csv"))}
    report = json.loads((out / "results.json").read_text())
    return proc, rows, report


# -- the registry ------------------------------------------------------------------------------------------------


def test_every_notebook_number_has_exercises_and_solutions():
    for nb_id in MODULES:
        exs = exercises_of(nb_id)
        assert exs, f"notebook {nb_id} has no exercises"
        for ex in exs:
            assert ex.id in SOLUTIONS, f"{ex.id} has no reference solution in instructor/solutions"
            assert exercises.max_points(ex.id) > 0
            assert len(exercises.tests_of(ex.id)) >= 3, f"{ex.id}: too few tests to tell a guess from an answer"
            stub = ex.stub_source()
            assert "raise NotImplementedError" in stub and f"def {ex.name}(" in stub
            runnable_code(stub)  # parses


def test_every_learner_notebook_has_its_exercises():
    assert LEARNER_NOTEBOOKS
    for path in LEARNER_NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        found = find_exercise_cells(nb)
        want = [ex.id for ex in exercises_of(path.name[:2])]
        assert sorted(found) == sorted(want), f"{path.name}: exercise cells {sorted(found)}, expected {want}"
        tags = [t for c in nb.cells for t in c.get("metadata", {}).get("tags", []) if t.startswith("exercise")]
        first = next(i for i, c in enumerate(nb.cells) if "exercise-intro" in c.get("metadata", {}).get("tags", []))
        assert all(
            any(t.startswith("exercise") for t in c.get("metadata", {}).get("tags", [])) for c in nb.cells[first:]
        ), f"{path.name}: the exercise cells must be the last cells of the notebook"
        assert tags.count("exercise") == tags.count("exercise-check") == len(want)
        for ex_id, cell in found.items():  # the stubs learners get are the registry's current ones
            assert cell.source == exercises.get(ex_id).stub_source(), f"{path.name}: {ex_id}'s stub is out of date"


# -- stubs and solutions -----------------------------------------------------------------------------------------


def test_untouched_learner_notebooks_score_zero_with_not_implemented(stubs_and_solutions):
    graded, _ = stubs_and_solutions
    learner = [p.name for p in LEARNER_NOTEBOOKS if p.name in graded]
    assert learner, "no learner notebook has exercise cells yet"
    for name in learner:
        for ex_id, r in graded[name].items():
            assert r.score == 0, f"{name} {ex_id}: the stub scored {r.score}"
            assert r.label == "not implemented", f"{name} {ex_id}: {r.label}: {r.tests[0]['output']}"
            assert all(t["output"].startswith("not implemented yet") for t in r.tests)


def test_reference_solutions_score_full_marks(stubs_and_solutions):
    graded, _ = stubs_and_solutions
    seen = set()
    for nb_id in MODULES:
        for ex_id, r in graded[f"{nb_id}_solved.ipynb"].items():
            seen.add(ex_id)
            failed = [f"{t['name']}: {t['output']}" for t in r.tests if t["score"] != t["max_score"]]
            assert r.score == r.max_score == exercises.max_points(ex_id), f"{ex_id}: {failed}"
    assert seen == set(all_exercises())


def test_reports_have_the_promised_shape(stubs_and_solutions):
    _, out = stubs_and_solutions
    rows = list(csv.DictReader(open(out / "grades.csv")))
    assert rows and set(all_exercises()) <= set(rows[0]) and {"submission", "total", "max_total"} <= set(rows[0])
    solved01 = next(r for r in rows if r["submission"].endswith("01_solved.ipynb"))
    assert (
        int(solved01["total"])
        == int(solved01["max_total"])
        == sum(exercises.max_points(e.id) for e in exercises_of("01"))
    )
    assert solved01["02.attention_traffic"] == ""  # not part of that notebook
    report = json.loads((out / "results.json").read_text())
    entry = next(s for s in report["submissions"] if s["submission"].endswith("06_solved.ipynb"))
    assert entry["score"] == entry["max_score"] > 0
    for t in entry["tests"]:
        assert {"name", "score", "max_score", "output"} <= set(t)


# -- bad submissions ---------------------------------------------------------------------------------------------


def _result(report, name, ex_id):
    sub = next(s for s in report["submissions"] if Path(s["submission"]).name == name)
    tests = [t for t in sub["tests"] if t["name"].startswith(ex_id + ":")]
    return sum(t["score"] for t in tests), sum(t["max_score"] for t in tests), tests


@pytest.mark.parametrize("name", list(BAD))
def test_bad_submission_loses_only_its_own_exercise(bad_run, name):
    proc, rows, report = bad_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    nb_id, bad_ex, _ = BAD[name]
    fname = f"{nb_id}_{name}.ipynb"
    score, max_score, tests = _result(report, fname, bad_ex)
    outputs = " | ".join(t["output"] for t in tests)
    if name == "prints_megabytes":
        assert score == max_score, outputs  # printing is allowed; it just must not break anything
        assert len(json.dumps(report)) < 2_000_000, "printed output must be cut short in the report"
    elif name in ("wrong", "hardcoded"):
        assert 0 < score < max_score, f"{name}: {score}/{max_score}: {outputs}"
    else:
        assert score == 0, f"{name}: {score}/{max_score}: {outputs}"
    expected_words = {
        "raises": "raised ValueError",
        "hangs": "timed out",
        "mutates": "changed its input `scores`",
        "calls_reference": "flashlab.reference.online_softmax",
        "calls_reference_06": "flashlab.reference.merge",
        "syntax_error": "syntax error",
        "exits": "stopped unexpectedly",
        "wrong": "rescale",
    }
    if name in expected_words:
        assert expected_words[name] in outputs, outputs
    for other in exercises_of(nb_id):  # every other exercise in the same notebook is still graded right
        if other.id != bad_ex:
            s, m, t = _result(report, fname, other.id)
            assert s == m > 0, f"{name}: {other.id} scored {s}/{m}: {[x['output'] for x in t]}"
    assert int(rows[fname]["total"]) == sum(_result(report, fname, e.id)[0] for e in exercises_of(nb_id))


def test_bad_run_prints_a_grade_table_and_survives_garbage(bad_run):
    proc, rows, report = bad_run
    assert "submission" in proc.stdout and "timeout" in proc.stdout and "calls flashlab" in proc.stdout
    garbage = next(s for s in report["submissions"] if s["submission"].endswith("01_not_a_notebook.ipynb"))
    assert garbage["score"] == 0 and "could not read the notebook" in garbage["output"]
    assert rows["01_not_a_notebook.ipynb"]["total"] == "0"


# -- the inline check --------------------------------------------------------------------------------------------


def _an_answer_with_a_bug(scores, values, block_size):
    import numpy as np

    p = np.exp(np.asarray(scores) - np.max(scores))
    return float(p @ np.asarray(values) / p.sum()) * 1.01


def test_check_prints_per_test_results_and_never_raises(capsys):
    check("01.streaming_attention", _an_answer_with_a_bug)
    out = capsys.readouterr().out
    assert "FAIL" in out and "01.streaming_attention: 0/" in out and "Traceback" not in out
    assert "got 2.4957, expected 2.471" in out or "got 2.496, expected 2.471" in out or "expected 2.471" in out
    check("99.no_such_exercise", _an_answer_with_a_bug)
    assert "could not check 99.no_such_exercise" in capsys.readouterr().out
    check("01.streaming_attention", None)
    assert "could not check" in capsys.readouterr().out


# -- the messages a learner reads --------------------------------------------------------------------------------


def test_messages_name_shape_index_and_factor():
    import numpy as np

    want = np.arange(1.0, 7.0).reshape(2, 3)
    with pytest.raises(AssertionError, match=r"wrong shape \(3, 2\); expected \(2, 3\)"):
        expect_array(want.T, want, "o")
    bad = want.copy()
    bad[1, 2] = 0.5
    with pytest.raises(AssertionError, match=r"worst at index \(1, 2\): got 0\.5, expected 6"):
        expect_array(bad, want, "o")
    with pytest.raises(AssertionError, match=r"same factor 0\.3679.*rescale"):
        expect_array(want * np.exp(-1), want, "o", hints={"the rescale factor was applied twice": np.exp(-1)})
    with pytest.raises(AssertionError, match="NaN or inf, first at index"):
        expect_array(np.full((2, 3), np.nan), want, "o")
    with pytest.raises(AssertionError, match=r"off by a factor of 8: counted bits"):
        expect_int(8 * 134_217_728, 134_217_728, "bytes", hints={"counted bits": 8.0})
    with pytest.raises(AssertionError, match="should be one number"):
        expect_number("2.471", 2.471, "output")


# -- what the grader takes from a cell ---------------------------------------------------------------------------


def test_runnable_code_keeps_definitions_and_drops_trial_runs():
    cell = "%matplotlib inline\nimport numpy as np\nX = 3\n\ndef f(a):\n    return a + X\n\nprint(f(1))\nf(2)\n"
    code = runnable_code(cell)
    namespace: dict = {}
    exec(code, namespace)
    assert namespace["f"](1) == 4
    assert "print" not in code and "matplotlib" not in code
    assert code.splitlines()[4] == "def f(a):"  # line numbers kept, so messages point at the learner's lines
    with pytest.raises(SyntaxError):
        runnable_code("def f(:\n    pass")


def test_append_exercises_is_idempotent(tmp_path):
    from flashlab.grade.solutions import append_exercises

    path = tmp_path / "05_something.ipynb"
    nbformat.write(notebook_of([nbformat.v4.new_code_cell("x = 1")]), path)
    assert append_exercises(path) is True
    assert append_exercises(path) is False  # already there: never appended twice
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[1].source == "x = 1"  # the notebook's own cells are untouched
    assert sorted(find_exercise_cells(nb)) == sorted(ex.id for ex in exercises_of("05"))
