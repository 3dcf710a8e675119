"""Grading flashlab's exercises: inline checks for learners, batch grading for instructors.

- ``check(exercise_id, fn)`` -- the cell after each exercise calls this. It runs the exercise's tests on the
  learner's function exactly as the batch grader does and prints, per test, pass/fail, points and a readable
  message. It never raises, so a notebook with unfinished exercises still runs top to bottom.
- ``python -m flashlab.grade SUBMISSION... --out DIR`` -- grades notebooks (a folder expands to the notebooks in
  it) and writes ``DIR/grades.csv`` and ``DIR/results.json``.

How it is built: the learner's cell runs in a process of its own (``worker``, ``child``), walled in
(``sandbox``): resource limits, its own process group, no flashlab on its import path, and on Linux a private view
of the filesystem (a mount namespace holding only what it may read and its own folder), no reading outside the
Python installation, no capabilities, no new processes, no network. It only computes answers for the inputs the grader
sends and sends them back as plain data (``wire``); every test and every score runs here, in the grader's process
(``runner``), so nothing the learner's code does can change a score but its answers. What is graded where:
``cells`` (which cells are exercises, which notebook it is), ``records`` (test records and statuses).

The exercises and their tests live in ``flashlab.exercises``; reference solutions for instructors live outside the
package, in ``instructor/solutions/``.
"""

from __future__ import annotations

import ast
import inspect
import linecache

from flashlab.grade.records import ExerciseResult, Outcome, Status
from flashlab.grade.runner import grade, grade_table, run_exercise

__all__ = ["check", "grade", "grade_table", "run_exercise", "format_result", "ExerciseResult", "Outcome", "Status"]

RERUN = "change the exercise cell, run it again (so the notebook has your new function), then run this cell again"


def source_of(fn) -> str:
    """The code the grader would see for ``fn``: its whole notebook cell, or (from a file) its imports and itself."""
    fn = getattr(fn, "fn", fn)  # a @triton.jit function keeps the Python function in .fn
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise TypeError(f"expected the function you wrote; got {type(fn).__name__}")
    filename = code.co_filename
    lines = linecache.getlines(filename)
    if lines and (filename.startswith("<ipython-input") or "ipykernel_" in filename):
        return "".join(lines)  # a notebook cell: everything in it, as the grader reads the cell
    src = inspect.cleandoc("\n" + inspect.getsource(fn))
    try:  # the file's imports of names the function uses (a notebook cell would hold them)
        used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
        tree = ast.parse("".join(linecache.getlines(filename)))
        imports = []
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
                if names:
                    node.names = names
                    imports.append(ast.unparse(node))
    except (SyntaxError, ValueError):
        imports = []
    return "\n".join(imports) + "\n\n\n" + src if imports else src


def format_result(result: ExerciseResult) -> str:
    """Per test: PASS/FAIL, points, and what was wrong; then what to do next."""
    if result.status is Status.NOT_IMPLEMENTED:
        return (
            f"{result.exercise_id}: 0/{result.max_score} points -- not implemented yet: replace "
            "`raise NotImplementedError` in the exercise cell with your code, run the exercise cell, then run "
            "this cell again"
        )
    lines = []
    for t in result.tests:
        mark = "PASS" if t.outcome is Outcome.PASSED else "FAIL"
        lines.append(f"{mark}  {t.score}/{t.max_score}  {t.name}")
        if mark == "FAIL":
            lines.append(f"        {t.message}")
    lines.append(f"{result.exercise_id}: {result.score}/{result.max_score} points ({result.status.value})")
    if result.score < result.max_score:
        lines.append(f"To try again: {RERUN}.")
    return "\n".join(lines)


def check(exercise_id: str, fn, time_limit: float | None = None) -> None:
    """Run the grader's tests for ``exercise_id`` on ``fn`` and print the result. Never raises."""
    try:
        source = source_of(fn)
        name = getattr(getattr(fn, "fn", fn), "__name__", None)
        result = run_exercise(exercise_id, source, time_limit=time_limit, function=name)
        print(format_result(result))
    except Exception as e:  # the check must never stop the notebook
        print(f"could not check {exercise_id}: {type(e).__name__}: {e}")
