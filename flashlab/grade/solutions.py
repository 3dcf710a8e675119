"""Exercise cells for the notebooks, and solved copies of the notebooks for instructors and the grader's tests.

- ``exercise_cells("01")`` -- the cells appended at the end of a learner notebook: an "Exercises" heading (tag
  ``exercise-intro``), then per exercise the stub (tag ``exercise``) and its inline check (tag ``exercise-check``).
- ``load_solutions(directory)`` -- the reference solutions in ``DIRECTORY/NN_*.py``, by exercise id. In those files
  each ``# %% exercise ID`` section is the whole text of that exercise's cell in a solved notebook. They are not
  part of the package (learners install it too): the folder is an argument, ``instructor/solutions`` of the
  repository by default on the command line.
- ``python -m flashlab.grade.solutions NOTEBOOK... --out DIR`` -- writes solved copies (exercise cells replaced by
  the reference solutions), e.g. to check that the grader gives them full marks. It never writes over an input,
  never writes two inputs to one file, and replaces an existing file only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

from flashlab.exercises import exercises_of
from flashlab.grade.cells import CHECK_TAG, EXERCISE_TAG, cell_tags, find_exercise_cells, not_a_submission
from flashlab.grade.runner import expand

DEFAULT_SOLUTIONS = Path("instructor") / "solutions"  # relative to the repository root, where instructors run it
MARKER = re.compile(r"^# %% exercise (\S+)\s*$", re.M)


def exercise_cells(notebook: str) -> list:
    """The cells to append at the end of notebook ``"NN"``."""
    exs = exercises_of(notebook)
    intro = (
        "## Exercises\n\n"
        "Each exercise is a function to write in the cell marked `# YOUR CODE HERE`; its docstring says what to "
        "compute and which shapes come in and go out. The cell after it runs the grader's own tests on your "
        "function and prints, per test, whether it passed and its points. The tests use fresh random inputs as "
        "well as the lesson's examples. The grader sees only the exercise cell, and runs it without flashlab: "
        "import what you use there and write the computation yourself. After changing an exercise, run its cell "
        "again, then its check cell.\n\n" + "\n".join(f"{i}. `{ex.name}` -- {ex.title}" for i, ex in enumerate(exs, 1))
    )
    cells = [nbformat.v4.new_markdown_cell(intro, metadata={"tags": ["exercise-intro"]})]
    for ex in exs:
        cells.append(
            nbformat.v4.new_code_cell(
                ex.stub_source(), metadata={"tags": [EXERCISE_TAG], "flashlab": {"exercise": ex.id}}
            )
        )
        cells.append(
            nbformat.v4.new_code_cell(
                ex.check_source(), metadata={"tags": [CHECK_TAG], "flashlab": {"exercise": ex.id}}
            )
        )
    return cells


def has_exercises(nb) -> bool:
    return any(any(t.startswith("exercise") for t in cell_tags(c)) for c in nb.cells)


def append_exercises(path: Path, replace: bool = False) -> bool:
    """Append the exercise cells to the notebook at ``path`` unless it has them. Returns True if it wrote.

    With ``replace=True`` any exercise cells already there are dropped first and fresh stubs appended.
    """
    nb = nbformat.read(str(path), as_version=4)
    if has_exercises(nb):
        if not replace:
            return False
        nb.cells = [c for c in nb.cells if not any(t.startswith("exercise") for t in cell_tags(c))]
    notebook = Path(path).name[:2]
    nb.metadata.setdefault("flashlab", {})["notebook"] = notebook  # the grader reads which notebook it is here
    for cell in exercise_cells(notebook):
        if nb.nbformat_minor < 5:
            cell.pop("id", None)  # cell ids exist from nbformat 4.5 on
        nb.cells.append(cell)
    nbformat.write(nb, str(path))
    return True


def load_solutions(directory) -> dict[str, str]:
    """Reference solution cell sources by exercise id, from the ``NN_*.py`` files in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no solutions folder at {directory}")
    out = {}
    for f in sorted(directory.glob("[0-9][0-9]_*.py")):
        text = f.read_text()
        parts = MARKER.split(text)
        for ex_id, body in zip(parts[1::2], parts[2::2], strict=True):
            out[ex_id] = body.strip() + "\n"
    return out


def solve(nb, solutions: dict[str, str]):
    """The notebook with every exercise cell's source replaced by its reference solution (in place)."""
    for ex_id, cell in find_exercise_cells(nb).items():
        if ex_id in solutions:
            nb.cells[cell.index].source = solutions[ex_id]
    return nb


def _targets(inputs, out: Path) -> list[tuple[Path, Path]]:
    """``(input, where its solved copy goes)``: a notebook given by path goes to ``OUT/its name``, one found in a
    folder to ``OUT/its path inside that folder``."""
    pairs = []
    for arg in inputs:
        if Path(arg).is_dir() and not Path(arg).is_symlink():
            pairs += [(path, out / name) for path, name in expand([arg])]
        else:
            pairs.append((Path(arg), out / Path(arg).name))
    return pairs


def plan_writes(inputs, out: Path, overwrite: bool = False) -> tuple[list[tuple[Path, Path]], list[str]]:
    """The ``(input, output)`` pairs to write, and what forbids writing (empty if nothing does).

    Never allowed: an output that is an input (it would replace the learner's exercise cells), two inputs with one
    output; an output that exists only with ``overwrite``. Links, FIFOs and devices are not read.
    """
    pairs, problems = [], []
    inputs_real = {}
    for path, target in _targets(inputs, out):
        why = not_a_submission(path)
        if why:
            problems.append(f"{path}: {why}")
            continue
        inputs_real[os.path.realpath(path)] = path
        pairs.append((path, target))
    seen: dict[str, Path] = {}
    for path, target in pairs:
        real = os.path.realpath(target)
        if real in inputs_real:
            problems.append(
                f"{target} is the input {inputs_real[real]}: its solved copy would replace the learner's exercise "
                "cells; give --out a folder of its own"
            )
        elif real in seen:
            problems.append(f"{seen[real]} and {path} would both be written to {target}; solve them in separate runs")
        elif os.path.lexists(target) and not overwrite:
            problems.append(f"{target} exists; pass --overwrite to replace it")
        seen.setdefault(real, path)
    return pairs, problems


def _write_atomically(nb, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flashlab.grade.solutions",
        description="Write solved copies of flashlab notebooks: exercise cells replaced by the reference solutions. "
        "Nothing is written if an output would be one of the inputs, two inputs would share an output, or an output "
        "exists (unless --overwrite).",
    )
    p.add_argument("notebooks", nargs="+", help="learner notebooks, or folders of them")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="folder for the solved notebooks (given explicitly; instructor/README.md uses grading/solved, which git "
        "ignores)",
    )
    p.add_argument(
        "--solutions", type=Path, default=DEFAULT_SOLUTIONS, help=f"solutions folder (default: {DEFAULT_SOLUTIONS})"
    )
    p.add_argument("--overwrite", action="store_true", help="replace solved notebooks already in --out")
    args = p.parse_args(argv)
    if not args.solutions.is_dir():
        p.error(f"no solutions folder at {args.solutions}; run from the repository root or pass --solutions DIR")
    missing = [s for s in args.notebooks if not os.path.lexists(s)]
    if missing:
        p.error(f"no such file or folder: {', '.join(missing)}")
    pairs, problems = plan_writes(args.notebooks, args.out, overwrite=args.overwrite)
    if problems:
        p.error("nothing was written:\n  " + "\n  ".join(problems))
    sols = load_solutions(args.solutions)
    for path, target in pairs:
        _write_atomically(solve(nbformat.read(str(path), as_version=4), sols), target)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
