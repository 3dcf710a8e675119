"""Grading: an exercise's tests run here, in the grader, against the learner's function in a walled-in process.

``run_exercise`` grades one exercise cell (it is also what the notebook's inline ``check`` runs, so a learner sees
exactly what the grader will see). ``grade(paths, out_dir)`` is what ``python -m flashlab.grade`` runs: it finds
each notebook's exercises, grades them ``jobs`` at a time, and writes the reports atomically; ``interrupt()`` (the
command's SIGINT/SIGTERM handler) kills every submission process and makes ``grade`` write a report marked
incomplete.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from flashlab import exercises
from flashlab.grade import cells
from flashlab.grade.cells import expected_exercises, not_a_submission, open_submission
from flashlab.grade.records import ExerciseResult, Outcome, Submission, TestRecord
from flashlab.grade.worker import (
    Answer,
    AnswerRaised,
    Crashed,
    InputMutated,
    Timeout,
    Worker,
    kill_all,
    raised,
    stdlib_dirs,
)

LOCK_NAME = ".flashlab-grade.lock"
_STOP = threading.Event()  # set by interrupt(): start no new process, record what is left as not graded


class Interrupted(Exception):
    """Grading was interrupted before this exercise finished."""


class Busy(RuntimeError):
    """Another grading run holds the lock on this output folder."""


def interrupt() -> None:
    """Stop grading now: no new submission process starts, every live one is killed."""
    _STOP.set()
    kill_all()


# -- one exercise ------------------------------------------------------------------------------------------------


def _test_name(fn) -> str:
    return (fn.__doc__ or fn.__name__).strip().splitlines()[0]


def _all(tests, outcome: Outcome, message: str) -> list[TestRecord]:
    return [TestRecord(fn.__name__, _test_name(fn), fn.flashlab_points, outcome, message) for fn in tests]


# -- reading a submission, in a process of its own ------------------------------------------------------------


class ReaderFailed(Exception):
    """The limited process that reads a submission did not answer (out of memory or time, or it crashed)."""


def _reader(request: dict, stdin=None, data: bytes | None = None) -> dict:
    """Run ``cells.main`` in a new interpreter under ``cells``' memory and CPU limits, reading ``stdin`` (a
    descriptor) or ``data``; its JSON answer."""
    here = Path(cells.__file__).resolve().parent
    limits = f"({cells.READER_MEMORY_BYTES}, {cells.READER_MEMORY_BYTES})"
    cpu = f"({cells.READER_CPU_SECONDS}, {cells.READER_CPU_SECONDS})"
    boot = (
        f"import sys, resource; sys.path[:] = {[str(here), *stdlib_dirs()]!r}; "
        f"resource.setrlimit(resource.RLIMIT_AS, {limits}); resource.setrlimit(resource.RLIMIT_CPU, {cpu}); "
        "import cells; sys.exit(cells.main())"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", boot, json.dumps(request)],
            stdin=stdin,
            input=data,
            capture_output=True,
            timeout=2 * cells.READER_CPU_SECONDS,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
        )
    except subprocess.TimeoutExpired:
        raise ReaderFailed("reading it took too long") from None
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise ReaderFailed(f"reading it failed ({tail[0][:200]})")
    return json.loads(done.stdout)


def _registry() -> tuple[dict[str, str], list[str]]:
    return {ex_id: ex.name for ex_id, ex in exercises.all_exercises().items()}, list(exercises.MODULES)


def read_submission(path: Path) -> dict:
    """``cells.read_submission_data`` of the notebook at ``path``, computed in the limited reader process; the
    file is opened here (a regular file, no link followed, no larger than ``cells.MAX_NOTEBOOK_BYTES``)."""
    known, notebooks = _registry()
    try:
        fd = open_submission(path)
    except ValueError as e:
        return {"error": str(e), "notebook": None, "skipped": str(e).startswith("skipped")}
    try:
        return _reader({"known": known, "notebooks": notebooks, "name": Path(path).name}, fd)
    except ReaderFailed as e:
        return {"error": f"could not read the notebook: {e}", "notebook": None}
    finally:
        os.close(fd)


def parse_cell(source: str, function: str) -> dict:
    """``cells.parse_cell`` of one cell's text, computed in the limited reader process."""
    if len(source) > cells.MAX_CELL_CHARS:
        return cells.parse_cell(source, function)  # refused by its length, unparsed
    try:
        return _reader({"cell": function}, data=source.encode("utf-8", "replace"))
    except ReaderFailed as e:
        return {"kind": "unreadable", "problem": f"the grader could not parse the exercise cell: {e}"}


def _setup_failure(reply: dict, function: str) -> tuple[Outcome, str] | None:
    """What went wrong running the cell, from the child's start-up reply; None if the function is ready."""
    if reply.get("ready") is True:
        return None
    if reply.get("setup") == "no function":
        return Outcome.CELL_FAILED, f"the exercise cell must define a function named `{function}`"
    if reply.get("setup") == "cell raised":
        err = raised(reply.get("raised"))
        return Outcome.CELL_FAILED, f"running the exercise cell failed: {err.describe()}"
    return Outcome.CRASHED, "the submission's process did not start properly"


def _run_test(fn, answer: Answer) -> TestRecord:
    """One test against the answer; every way it can end becomes a record (Timeout and Interrupted propagate)."""
    name, points = _test_name(fn), fn.flashlab_points

    def rec(outcome, message="passed"):
        return TestRecord(fn.__name__, name, points, outcome, message)

    try:
        fn(answer)
    except (Timeout, Interrupted):
        raise
    except Crashed as e:
        return rec(Outcome.CRASHED, str(e))
    except InputMutated as e:
        return rec(Outcome.MUTATED, str(e))
    except AnswerRaised as e:
        outcome = Outcome.NOT_IMPLEMENTED if e.kind == "NotImplementedError" else Outcome.RAISED
        return rec(outcome, e.describe())
    except AssertionError as e:
        return rec(Outcome.WRONG, str(e) or "a check failed")
    except Exception as e:  # the test could not read what the answer returned
        return rec(Outcome.WRONG, f"the grader could not use what your function returned ({type(e).__name__}: {e})")
    return rec(Outcome.PASSED)


def run_exercise(
    exercise_id: str,
    source: str,
    time_limit: float | None = None,
    function: str | None = None,
    memory_mib: int | None = None,
    parsed: dict | None = None,
) -> ExerciseResult:
    """Grade one exercise cell; never raises for anything the learner's code does.

    ``function`` names the function to grade if it is not the exercise's own name; ``parsed`` is the cell as
    ``cells.parse_cell`` read it, where the caller has it already (else it is read here, in a limited process).
    """
    ex = exercises.get(exercise_id)
    tests = exercises.tests_of(ex.id)
    function = function or ex.name
    limit = ex.time_limit_s if time_limit is None else float(time_limit)
    start = time.monotonic()
    parsed = parse_cell(source, function) if parsed is None else parsed
    if "code" not in parsed:
        outcome = Outcome.SYNTAX_ERROR if parsed.get("kind") == "syntax" else Outcome.CELL_FAILED
        return ExerciseResult(ex.id, _all(tests, outcome, str(parsed.get("problem", "the cell cannot be read"))))
    code, params = parsed["code"], parsed["params"]
    deadline = start + limit
    records: list[TestRecord] = []
    worker, walls = None, {}
    try:
        for i, fn in enumerate(tests):
            if _STOP.is_set():
                raise Interrupted()
            if worker is None or worker.proc is None:  # first test, or the process died in the last one
                worker = Worker(ex, code, source, function, deadline, memory_mib)
                reply = worker.start()
                walls = worker.walls
                failure = _setup_failure(reply, function)
                if failure is not None:
                    records += _all(tests[i:], *failure)
                    break
            records.append(_run_test(fn, Answer(worker, params)))
    except Timeout:
        if _STOP.is_set():
            raise Interrupted() from None
        msg = (
            f"timed out: the exercise did not finish within {limit:g} s (a loop that never ends, or far too slow); "
            "this test and any after it score 0"
        )
        records += _all(tests[len(records) :], Outcome.TIMEOUT, msg)
    except Crashed as e:  # the process died while starting
        if _STOP.is_set():
            raise Interrupted() from None
        records += _all(tests[len(records) :], Outcome.CRASHED, str(e))
    finally:
        if worker is not None:
            worker.kill()
    if _STOP.is_set() and any(r.outcome in (Outcome.CRASHED, Outcome.TIMEOUT) for r in records):
        raise Interrupted()
    return ExerciseResult(ex.id, _apply_gates(tests, records), time.monotonic() - start, walls)


def _apply_gates(tests, records: list[TestRecord]) -> list[TestRecord]:
    """If a gate test failed, the others' passes are voided: right values computed the wrong way earn nothing."""
    failed = [r for fn, r in zip(tests, records, strict=True) if fn.flashlab_gate and r.outcome is not Outcome.PASSED]
    if not failed or all(r.outcome is Outcome.NOT_IMPLEMENTED for r in records):
        return records
    why = (
        f"voided: the test of how this exercise computes failed ({failed[0].name}), so right values earn nothing; "
        f"see that test's message"
    )
    return [
        TestRecord(r.test, r.name, r.max_score, Outcome.VOIDED, why) if r.outcome is Outcome.PASSED else r
        for r in records
    ]


# -- many submissions --------------------------------------------------------------------------------------------


def expand(paths) -> list[tuple[Path, str]]:
    """``(path, name)`` per submission: notebooks as given, folders expanded, named relative to the folder.

    A folder is walked without following links; every entry named ``*.ipynb`` in it is listed, links, FIFOs and
    devices too, so that grading can say it skipped them (``cells.not_a_submission``).
    """
    out = []
    for arg in paths:
        p = Path(arg)
        if p.is_dir() and not p.is_symlink():
            found = []
            for folder, dirs, files in os.walk(p):  # links to folders are listed in dirs, never entered
                dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints")
                found += [Path(folder) / f for f in files if f.endswith(".ipynb")]
                found += [Path(folder) / d for d in dirs if d.endswith(".ipynb")]
            out += [(q, q.relative_to(p).as_posix()) for q in sorted(found)]
        else:
            out.append((p, str(arg)))
    names = [n for _, n in out]
    dup = {n for n in names if names.count(n) > 1}
    return [(p, p.as_posix() if n in dup else n) for p, n in out]


def _foreign(ex_id: str, notebook: str | None) -> ExerciseResult:
    msg = f"this exercise belongs to notebook {ex_id.split('.')[0]}, not to notebook {notebook}; it earns nothing here"
    tests = exercises.tests_of(ex_id)
    return ExerciseResult(ex_id, [TestRecord(fn.__name__, _test_name(fn), 0, Outcome.FOREIGN, msg) for fn in tests])


def _read_or_skip(path: Path) -> dict:
    why = not_a_submission(path)
    return {"error": why, "notebook": None, "skipped": True} if why else read_submission(path)


def plan(paths) -> tuple[list[Submission], list[tuple[Submission, int, str, dict]]]:
    """The submissions, and the exercises to grade: (submission, slot in its results, exercise id, cell as read).

    A path that is not a regular file (a link, a FIFO, a device) is listed with ``skipped: ...`` as its error and
    nothing expected of it."""
    submissions, tasks = [], []
    found = expand(paths)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        read = list(pool.map(lambda p: _read_or_skip(p[0]), found))
    for (_, name), nb in zip(found, read, strict=True):
        sub = Submission(name)
        submissions.append(sub)
        sub.error = nb.get("error")
        if nb.get("skipped"):
            continue  # not a regular file: not a submission, nothing expected of it
        sub.notebook = nb.get("notebook")
        found_cells = nb.get("cells", {})
        if sub.notebook is None and sub.error is None:
            sub.error = "could not tell which notebook this is: no flashlab metadata and no tagged exercise cells"
        for ex_id in expected_exercises(sub.notebook):
            if ex_id not in found_cells:
                why = sub.error or "no exercise cell for this exercise in the notebook (tag `exercise`)"
                sub.results.append(ExerciseResult(ex_id, _all(exercises.tests_of(ex_id), Outcome.MISSING, why)))
                continue
            tasks.append((sub, len(sub.results), ex_id, found_cells[ex_id]))
            why = "not graded: grading was interrupted before this exercise ran"
            sub.results.append(ExerciseResult(ex_id, _all(exercises.tests_of(ex_id), Outcome.NOT_GRADED, why)))
        for ex_id in found_cells:
            if ex_id not in expected_exercises(sub.notebook):
                sub.results.append(_foreign(ex_id, sub.notebook))
    return submissions, tasks


def grade(
    paths,
    out_dir=None,
    jobs: int | None = None,
    time_limit: float | None = None,
    memory_mib: int | None = None,
    progress: bool = True,
):
    """Grade every submission; write ``grades.csv`` and ``results.json`` to ``out_dir``. Returns the submissions.

    With ``out_dir`` the folder is locked for the run (``Busy`` if another run holds it), and a report is always
    left: complete, or marked incomplete if grading was interrupted.
    """
    from tqdm.auto import tqdm

    _STOP.clear()
    with _locked(Path(out_dir)) if out_dir is not None else contextlib.nullcontext():
        if out_dir is not None:
            write_reports([], Path(out_dir), complete=False, reason="grading in progress")
        submissions, tasks = plan(paths)
        jobs = jobs or max(1, os.cpu_count() or 1)
        bar = tqdm(total=len(tasks), desc="grading", unit="exercise", disable=not progress)

        def work(task):
            sub, slot, ex_id, cell = task
            try:
                res = run_exercise(ex_id, cell["source"], time_limit=time_limit, memory_mib=memory_mib, parsed=cell)
            except Interrupted:
                return
            except Exception as e:  # the grader's own failure: record it, grade the rest
                why = f"grader error: {type(e).__name__}: {e}"
                res = ExerciseResult(ex_id, _all(exercises.tests_of(ex_id), Outcome.GRADER_ERROR, why))
            sub.results[slot] = res
            bar.update(1)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            pending = {pool.submit(work, t) for t in tasks}
            while pending:  # short waits, so a signal handler runs promptly in this thread
                _, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                if _STOP.is_set():
                    for f in pending:
                        f.cancel()
        bar.close()
        complete = not _STOP.is_set() and all(s.complete for s in submissions)
        if out_dir is not None:
            reason = None if complete else "interrupted: some exercises were not graded"
            write_reports(submissions, Path(out_dir), complete=complete, reason=reason)
    return submissions


@contextlib.contextmanager
def _locked(out_dir: Path):
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    f = open(out_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise Busy(f"another grading run is writing to {out_dir}; wait for it to finish") from None
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


# -- reports -----------------------------------------------------------------------------------------------------


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_reports(submissions, out_dir: Path, complete: bool = True, reason: str | None = None) -> None:
    """``grades.csv`` (a row per submission, a column per exercise) and ``results.json`` (per test), atomically.

    An incomplete run leaves both marked: ``results.json`` says ``"complete": false`` and why, and every row of
    ``grades.csv`` whose exercises were not all graded says ``incomplete`` in its ``status`` column.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    graded_ids = {r.exercise_id for s in submissions for r in s.results}
    ids = [ex_id for ex_id in exercises.all_exercises() if ex_id in graded_ids]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["submission", "notebook", *ids, "total", "max_total", "status"])
    report = {"complete": complete, "submissions": []}
    if reason:
        report["reason"] = reason
    for s in submissions:
        by_id = {r.exercise_id: r for r in s.results}
        status = "complete" if s.complete else "incomplete"
        cols = [by_id[i].score if i in by_id else "" for i in ids]
        w.writerow([s.name, s.notebook or "", *cols, s.score, s.max_score, status])
        entry = {
            "submission": s.name,
            "notebook": s.notebook,
            "score": s.score,
            "max_score": s.max_score,
            "status": status,
            "tests": [t.as_dict(r.exercise_id, r.status) for r in s.results for t in r.tests],
            "sandbox": {r.exercise_id: r.walls for r in s.results if r.walls},
        }
        if s.error:
            entry["output"] = s.error
        report["submissions"].append(entry)
    if submissions:
        _atomic_write(out_dir / "grades.csv", buf.getvalue())
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out_dir / "grades.csv")  # a previous run's grades must not pass for this run's
    _atomic_write(out_dir / "results.json", json.dumps(report, indent=1))


def walls_summary(submissions) -> str:
    """One line on the walls that held around the submissions' processes, and what a missing one leaves open."""
    walls = [r.walls for s in submissions for r in s.results if r.walls]
    if not walls:
        return "sandbox: no submission's process ran"
    abi = min(int(w.get("landlock", 0)) for w in walls)
    parts = [f"Landlock ABI {abi}" if abi else "no Landlock: files are read and written as your user"]
    parts.append("seccomp" if all(w.get("no_new_processes") for w in walls) else "no seccomp: processes can start")
    bare = [w for w in walls if not w.get("private_view")]
    if bare:
        parts.append(
            f"no private mount namespace for {len(bare)} of {len(walls)} exercises "
            f"({bare[0].get('view_problem', 'not tried')}): stat() and listdir() outside a submission's folder are "
            "not hidden, so it can learn the names and sizes of files there"
        )
    else:
        parts.append(f"private view ({walls[0]['private_view']}): nothing outside what it may read is there to name")
    return "sandbox: " + "; ".join(parts)


def grade_table(submissions) -> str:
    """The table the command prints: one line per exercise, grouped by submission, with its total."""
    rows = [("submission", "exercise", "score", "result")]
    for s in submissions:
        for r in s.results:
            rows.append((s.name, r.exercise_id, f"{r.score}/{r.max_score}", r.status.value))
        rows.append((s.name, "total", f"{s.score}/{s.max_score}", s.error or ""))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
        if k == 0:
            lines.append("-" * (sum(widths) + 20))
    return "\n".join(line.rstrip() for line in lines)
