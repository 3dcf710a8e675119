"""Finding exercise cells in a notebook, which notebook it is, and the code the grader runs from each cell.

An exercise cell carries the tag ``exercise`` and, in its metadata, ``flashlab.exercise = "NN.name"``; a cell whose
metadata is lost or malformed is matched by the name of the function it defines, and a cell that cannot be read
at all costs only its own exercise. Which notebook a submission is comes from the notebook itself (its metadata
``flashlab.notebook``, else the exercises its tagged cells name), never from the file name, so an LMS that renames
files changes nothing; the expected exercises are that notebook's in the registry.

From a cell the grader keeps imports, function and class definitions and plain assignments; it drops everything
else (calls, prints, IPython magics), so a learner's own trial run at the bottom of the cell is not graded.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from flashlab.exercises import MODULES, all_exercises

EXERCISE_TAG = "exercise"
CHECK_TAG = "exercise-check"


@dataclass
class ExerciseCell:
    exercise_id: str
    source: str
    index: int  # cell index in the notebook


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def cell_tags(cell) -> list[str]:
    tags = _dict(_dict(cell).get("metadata")).get("tags")
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def cell_source(cell) -> str | None:
    """The cell's text (nbformat stores it as a string or a list of lines), or None if it is neither."""
    src = _dict(cell).get("source")
    if isinstance(src, str):
        return src
    if isinstance(src, list) and all(isinstance(s, str) for s in src):
        return "".join(src)
    return None


def _tagged_id(cell) -> str | None:
    ex_id = _dict(_dict(_dict(cell).get("metadata")).get("flashlab")).get("exercise")
    return ex_id if isinstance(ex_id, str) else None


def strip_magics(source: str) -> str:
    """Comment out IPython-only lines (``%magic``, ``!shell``) so the cell parses as Python."""
    return "\n".join(("# " + ln) if re.match(r"\s*[%!]", ln) else ln for ln in source.splitlines())


def defined_functions(source: str) -> list[str]:
    try:
        tree = ast.parse(strip_magics(source))
    except SyntaxError:
        return re.findall(r"^def\s+(\w+)\s*\(", source, flags=re.M)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _cells(nb) -> list:
    cells = _dict(nb).get("cells")
    return cells if isinstance(cells, list) else []


def find_exercise_cells(nb) -> dict[str, ExerciseCell]:
    """The exercise cells of a notebook by exercise id (the last cell wins if a learner duplicated one)."""
    known = all_exercises()
    by_name = {ex.name: ex.id for ex in known.values()}
    found: dict[str, ExerciseCell] = {}
    for i, cell in enumerate(_cells(nb)):
        if _dict(cell).get("cell_type") != "code" or EXERCISE_TAG not in cell_tags(cell):
            continue
        source = cell_source(cell)
        ex_id = _tagged_id(cell)
        if ex_id not in known and source is not None:
            names = [by_name[n] for n in defined_functions(source) if n in by_name]
            ex_id = names[0] if names else None
        if ex_id in known:
            found[ex_id] = ExerciseCell(ex_id, source if source is not None else "", i)
    return found


def notebook_id(nb, fallback_name: str | None = None) -> str | None:
    """Which notebook this is ("NN"): its metadata, else the exercises its tagged cells name, else the file name."""
    meta = _dict(_dict(_dict(nb).get("metadata")).get("flashlab")).get("notebook")
    if isinstance(meta, str) and meta in MODULES:
        return meta
    named = Counter()
    for cell in _cells(nb):
        tags = cell_tags(cell)
        ex_id = _tagged_id(cell)
        if ex_id and (EXERCISE_TAG in tags or CHECK_TAG in tags) and ex_id.split(".")[0] in MODULES:
            named[ex_id.split(".")[0]] += 1
    if named:
        return named.most_common(1)[0][0]
    if fallback_name and fallback_name[:2] in MODULES:
        return fallback_name[:2]
    return None


def expected_exercises(notebook: str | None) -> list[str]:
    """The exercises a notebook of this number must hold, in registry order."""
    return [ex_id for ex_id in all_exercises() if notebook is not None and ex_id.split(".")[0] == notebook]


def read_notebook(path: Path) -> dict:
    """The notebook's JSON, as plain dicts and lists; ValueError if it is not a notebook."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("not a Jupyter notebook (no list of cells)")
    return nb


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
