"""Finding exercise cells in a notebook, which notebook it is, and the code the grader runs from each cell.

An exercise cell carries the tag ``exercise`` and, in its metadata, ``flashlab.exercise = "NN.name"``; a cell whose
metadata is lost or malformed is matched by the name of the function it defines, and a cell that cannot be read
at all costs only its own exercise. Which notebook a submission is comes from the notebook itself (its metadata
``flashlab.notebook``, else the exercises its tagged cells name), never from the file name, so an LMS that renames
files changes nothing; the expected exercises are that notebook's in the registry.

From a cell the grader keeps imports, function and class definitions and plain assignments; it drops everything
else (calls, prints, IPython magics), so a learner's own trial run at the bottom of the cell is not graded.

A submission is read and parsed in a process of its own under a memory and CPU limit (``read_submission``, the
grader's side, and ``main``, the reader's), so a notebook built to exhaust the parser costs that submission only.
This module imports only the standard library (flashlab's registry is imported where it is asked for), so the
reader starts with nothing else.
"""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import sys
from collections import Counter
from dataclasses import dataclass

EXERCISE_TAG = "exercise"
CHECK_TAG = "exercise-check"
MAX_NOTEBOOK_BYTES = 32 * 2**20  # a submitted notebook larger than this is not read
MAX_CELL_CHARS = 200_000  # an exercise cell longer than this is not parsed (an answer is a few thousand)
READER_MEMORY_BYTES = 1 << 30  # the reader's address space
READER_CPU_SECONDS = 30


def _registry() -> tuple[dict[str, str], list[str]]:
    """Exercise function names by id, and the notebook numbers, from flashlab's registry."""
    from flashlab.exercises import MODULES, all_exercises

    return {ex_id: ex.name for ex_id, ex in all_exercises().items()}, list(MODULES)


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
        tree = ast.parse(strip_magics(source[:MAX_CELL_CHARS]))
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # found by the text of its def, then
        return re.findall(r"^def\s+(\w+)\s*\(", source[:MAX_CELL_CHARS], flags=re.M)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _cells(nb) -> list:
    cells = _dict(nb).get("cells")
    return cells if isinstance(cells, list) else []


def find_exercise_cells(nb, known: dict[str, str] | None = None) -> dict[str, ExerciseCell]:
    """The exercise cells of a notebook by exercise id (the last cell wins if a learner duplicated one).

    ``known`` maps each exercise id to its function's name (default: flashlab's registry).
    """
    known = _registry()[0] if known is None else known
    by_name = {name: ex_id for ex_id, name in known.items()}
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


def notebook_id(nb, fallback_name: str | None = None, notebooks=None) -> str | None:
    """Which notebook this is ("NN"): its metadata, else the exercises its tagged cells name, else the file name.

    ``notebooks`` are the notebook numbers there are (default: flashlab's registry).
    """
    MODULES = _registry()[1] if notebooks is None else notebooks
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
    return [ex_id for ex_id in _registry()[0] if notebook is not None and ex_id.split(".")[0] == notebook]


def parse_notebook(data: bytes) -> dict:
    """The notebook's JSON, as plain dicts and lists; ValueError if it is not a notebook."""
    nb = json.loads(data.decode("utf-8"))
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("not a Jupyter notebook (no list of cells)")
    return nb


def not_a_submission(path) -> str | None:
    """Why ``path`` is skipped (a link, a FIFO, a device, a folder), or None for a regular file. Never follows it."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as e:
        return f"skipped: cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(mode):
        return "skipped: a symbolic link (links are not followed)"
    if not stat.S_ISREG(mode):
        return f"skipped: not a regular file (a {_kind(mode)})"
    return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "socket" if stat.S_ISSOCK(mode) else "folder" if stat.S_ISDIR(mode) else "special file"


def open_submission(path) -> int:
    """A descriptor on the regular file at ``path``, opened without following a link or waiting on a FIFO and no
    larger than ``MAX_NOTEBOOK_BYTES``; ValueError naming what it is otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(not_a_submission(path) or f"cannot be read ({e.strerror or e})") from None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"skipped: not a regular file (a {_kind(st.st_mode)})"
    elif st.st_size > MAX_NOTEBOOK_BYTES:
        why = f"the notebook is {st.st_size:,} bytes, over the grader's limit of {MAX_NOTEBOOK_BYTES:,}"
    if why:
        os.close(fd)
        raise ValueError(why)
    return fd


def read_notebook(path) -> dict:
    """The notebook at ``path`` (a regular file, not followed through a link), parsed in this process."""
    fd = open_submission(path)
    with os.fdopen(fd, "rb") as f:
        return parse_notebook(f.read(MAX_NOTEBOOK_BYTES + 1))


def runnable_code(source: str, keep_assignments: bool = True) -> str:
    """The part of a cell the grader executes: imports, defs, classes (and assignments). Raises SyntaxError."""
    source = strip_magics(source)
    tree = ast.parse(source)  # SyntaxError; MemoryError or RecursionError for a cell nested too deeply
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


def _params(code: str, function: str) -> list[str]:
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return [a.arg for a in node.args.posonlyargs + node.args.args]
    return []


def parse_cell(source: str, function: str) -> dict:
    """What the grader runs of one exercise cell: ``{"code", "params"}``, or ``{"kind", "problem"}`` saying why it
    cannot be run (``kind``: ``"syntax"``, or ``"unreadable"`` for a cell too long or too deep for the parser)."""
    if len(source) > MAX_CELL_CHARS:
        why = f"the exercise cell is {len(source):,} characters, over the grader's limit of {MAX_CELL_CHARS:,}"
        return {"kind": "unreadable", "problem": why}
    try:
        code = runnable_code(source)
        return {"code": code, "params": _params(code, function)}
    except SyntaxError as e:
        return {"kind": "syntax", "problem": f"the exercise cell has a syntax error at line {e.lineno}: {e.msg}"[:500]}
    except (ValueError, MemoryError, RecursionError) as e:
        why = f"the parser gave up on the exercise cell ({type(e).__name__}: nested too deeply, or too long)"
        return {"kind": "unreadable", "problem": why}


def read_submission_data(data: bytes, request: dict) -> dict:
    """A submission as the grader needs it: ``notebook``, and per exercise cell its ``source`` and ``parse_cell``'s
    answer; or ``error`` saying why the notebook cannot be read. ``request`` holds ``known`` (exercise id ->
    function name), ``notebooks`` and the file's ``name``."""
    known, notebooks, name = request["known"], request["notebooks"], request.get("name")
    if len(data) > MAX_NOTEBOOK_BYTES:
        return {"error": f"the notebook is over the grader's limit of {MAX_NOTEBOOK_BYTES:,} bytes", "notebook": None}
    try:
        nb = parse_notebook(data)
    except (ValueError, MemoryError, RecursionError) as e:
        return {
            "error": f"could not read the notebook: {type(e).__name__}: {str(e)[:300]}",
            "notebook": notebook_id({}, name, notebooks),
        }
    cells = {}
    for ex_id, cell in find_exercise_cells(nb, known).items():
        parsed = parse_cell(cell.source, known[ex_id])
        cells[ex_id] = {"source": cell.source if len(cell.source) <= MAX_CELL_CHARS else "", **parsed}
    return {"notebook": notebook_id(nb, name, notebooks), "cells": cells}


def main() -> int:
    """The reader: the request as JSON in ``sys.argv[1]``, the notebook (or, with ``"cell"``, the cell's text) on
    standard input; the answer as JSON on standard output."""
    request = json.loads(sys.argv[1])
    data = sys.stdin.buffer.read(MAX_NOTEBOOK_BYTES + 1)
    if "cell" in request:
        answer = parse_cell(data.decode("utf-8", "replace"), request["cell"])
    else:
        answer = read_submission_data(data, request)
    sys.stdout.write(json.dumps(answer))
    return 0
