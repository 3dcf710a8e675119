"""Finding exercise cells in a notebook, and keeping only the code the grader runs from them.

An exercise cell carries the tag ``exercise`` and, in its metadata, ``flashlab.exercise = "NN.name"``. If a learner's
notebook lost that metadata, the cell is matched by the name of the function it defines.

From a cell the grader keeps imports, function and class definitions and plain assignments; it drops everything
else (calls, prints, IPython magics), so a learner's own trial run at the bottom of the cell is not graded.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from flashlab.exercises import MODULES, all_exercises

EXERCISE_TAG = "exercise"


@dataclass
class ExerciseCell:
    exercise_id: str
    source: str
    index: int  # cell index in the notebook


def cell_tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []) or [])


def strip_magics(source: str) -> str:
    """Comment out IPython-only lines (``%magic``, ``!shell``) so the cell parses as Python."""
    return "\n".join(("# " + ln) if re.match(r"\s*[%!]", ln) else ln for ln in source.splitlines())


def defined_functions(source: str) -> list[str]:
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return re.findall(r"^def\s+(\w+)\s*\(", source, flags=re.M)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def find_exercise_cells(nb) -> dict[str, ExerciseCell]:
    """The exercise cells of a notebook by exercise id (the last cell wins if a learner duplicated one)."""
    known = all_exercises()
    by_name = {ex.name: ex.id for ex in known.values()}
    found: dict[str, ExerciseCell] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or EXERCISE_TAG not in cell_tags(cell):
            continue
        ex_id = (cell.get("metadata", {}).get("flashlab") or {}).get("exercise")
        if ex_id not in known:
            names = [by_name[n] for n in defined_functions(cell.source) if n in by_name]
            ex_id = names[0] if names else None
        if ex_id is not None:
            found[ex_id] = ExerciseCell(ex_id, cell.source, i)
    return found


def expected_exercises(path: Path, found: dict[str, ExerciseCell]) -> list[str]:
    """The exercises a submission should hold: its notebook's (from the ``NN_`` file name) plus any found."""
    known = all_exercises()
    nb = path.name[:2]
    ids = [ex_id for ex_id in known if ex_id.split(".")[0] == nb] if nb in MODULES else []
    ids += [ex_id for ex_id in known if ex_id in found and ex_id not in ids]
    return ids


def read_notebook(path: Path):
    import nbformat  # slow to import (its JSON schema validator); the worker never needs it

    return nbformat.read(str(path), as_version=4)


def runnable_code(source: str, keep_assignments: bool = True) -> str:
    """The part of a cell the grader executes: imports, defs, classes (and assignments). Raises SyntaxError."""
    source = strip_magics(source)
    tree = ast.parse(source)
    kinds = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    if keep_assignments:
        kinds += (ast.Assign, ast.AnnAssign)
    kept = [node for node in tree.body if isinstance(node, kinds)]
    lines = source.splitlines()
    # keep original line numbers so messages point at the learner's own lines: blank out what is dropped
    keep = [False] * len(lines)
    for node in kept:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for ln in range(start - 1, node.end_lineno):
            keep[ln] = True
    return "\n".join(line if k else "" for line, k in zip(lines, keep, strict=True))
