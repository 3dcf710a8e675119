"""Grading submissions: one worker process per (submission, exercise), a time limit on each, reports at the end.

``grade(paths, out_dir)`` is what ``python -m flashlab.grade`` runs; ``run_exercise`` is also what the notebook's
inline ``check`` runs, so a learner sees exactly what the grader will see.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flashlab import exercises
from flashlab.grade.cells import expected_exercises, find_exercise_cells, read_notebook

LOG_TAIL_CHARS = 1500


@dataclass
class ExerciseResult:
    """The tests of one exercise in one submission."""

    exercise_id: str
    tests: list[dict]  # per test: name, score, max_score, status, output
    status: str  # graded | timeout | calls-flashlab | missing | crashed
    seconds: float = 0.0

    @property
    def score(self) -> int:
        return sum(t["score"] for t in self.tests)

    @property
    def max_score(self) -> int:
        return sum(t["max_score"] for t in self.tests)

    @property
    def label(self) -> str:
        """One word for the grade table."""
        if self.status != "graded":
            return self.status
        outputs = [t["output"] for t in self.tests]
        if outputs and all(o.startswith("not implemented") for o in outputs):
            return "not implemented"
        if self.score == self.max_score:
            return "full marks"
        if outputs and all(o.startswith("the exercise cell has a syntax error") for o in outputs):
            return "syntax error"
        if any(o.startswith("your function raised") for o in outputs) and self.score == 0:
            return "raises"
        if any("changed its input" in o for o in outputs):
            return "mutates input"
        return "partial" if self.score else "wrong"


@dataclass
class Submission:
    path: str
    results: list[ExerciseResult] = field(default_factory=list)
    error: str | None = None  # the notebook could not be read

    @property
    def score(self) -> int:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> int:
        return sum(r.max_score for r in self.results)


def _blank_tests(exercise_id: str, status: str, output: str) -> list[dict]:
    return [
        {
            "test": fn.__name__,
            "name": (fn.__doc__ or fn.__name__).strip().splitlines()[0],
            "score": 0,
            "max_score": fn.flashlab_points,
            "status": status,
            "output": output,
        }
        for fn in exercises.tests_of(exercise_id)
    ]


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_exercise(
    exercise_id: str, code: str, time_limit: float | None = None, function: str | None = None
) -> ExerciseResult:
    """Grade one exercise cell in a fresh process; never raises for anything the learner's code does.

    ``function`` names the function to grade if it is not the exercise's own name.
    """
    ex = exercises.get(exercise_id)
    limit = ex.time_limit_s if time_limit is None else float(time_limit)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashlab-grade-") as tmp:
        tmp = Path(tmp)
        spec, out, log = tmp / "spec.json", tmp / "results.jsonl", tmp / "log.txt"
        spec.write_text(json.dumps({"exercise": ex.id, "code": code, "function": function}))
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
        if ex.triton:
            env["TRITON_INTERPRET"] = "1"  # Triton's interpreter: the kernel runs on the CPU, no GPU needed
        with open(log, "wb") as log_f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashlab.grade.worker", str(spec), str(out)],
                stdout=log_f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group, so a timeout kills anything it started
            )
            timed_out = False
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        records = []
        if out.exists():
            for line in out.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by the kill
        tests = [r for r in records if "test" in r]
        forbidden = [r for r in records if "forbidden" in r]
        seconds = time.perf_counter() - start
        done = {t["test"] for t in tests}
        status = "graded"
        if forbidden:
            status = "calls flashlab"
            for t in tests:
                t.update(score=0, status="failed", output=forbidden[0]["output"])
        if timed_out:
            status = "timeout"
            msg = (
                f"timed out: the exercise did not finish within {limit:g} s (a loop that never ends, or far too "
                "slow); this test and any after it score 0"
            )
            tests += [t for t in _blank_tests(ex.id, "timeout", msg) if t["test"] not in done]
        elif proc.returncode != 0 or len(done) < len(exercises.tests_of(ex.id)):
            status = "crashed" if not forbidden else status
            msg = f"the grading process stopped unexpectedly (exit code {proc.returncode}): {_tail(log)[-600:]}"
            tests += [t for t in _blank_tests(ex.id, "failed", msg) if t["test"] not in done]
    order = [fn.__name__ for fn in exercises.tests_of(ex.id)]
    tests.sort(key=lambda t: order.index(t["test"]) if t["test"] in order else len(order))
    return ExerciseResult(ex.id, tests, status, seconds)


def expand(paths) -> list[Path]:
    """Submission paths: notebooks as given, folders expanded to the notebooks under them."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            out.append(p)
    return out


def grade(paths, out_dir=None, jobs: int | None = None, time_limit: float | None = None, progress: bool = True):
    """Grade every submission; write ``grades.csv`` and ``results.json`` to ``out_dir``. Returns the submissions."""
    from tqdm.auto import tqdm

    submissions, tasks = [], []
    for path in expand(paths):
        sub = Submission(str(path))
        submissions.append(sub)
        try:
            nb = read_notebook(path)
            cells = find_exercise_cells(nb)
        except Exception as e:  # not a notebook, bad JSON, missing file
            sub.error = f"could not read the notebook: {type(e).__name__}: {e}"
            cells = {}
        for ex_id in expected_exercises(path, cells):
            if ex_id not in cells:
                why = sub.error or "no exercise cell for this exercise in the notebook (tag `exercise`)"
                sub.results.append(ExerciseResult(ex_id, _blank_tests(ex_id, "failed", why), "missing"))
                continue
            slot = len(sub.results)
            sub.results.append(None)
            tasks.append((sub, slot, ex_id, cells[ex_id].source))

    jobs = jobs or max(1, os.cpu_count() or 1)
    bar = tqdm(total=len(tasks), desc="grading", unit="exercise", disable=not progress)

    def work(task):
        sub, slot, ex_id, code = task
        try:
            res = run_exercise(ex_id, code, time_limit=time_limit)
        except Exception as e:  # the grader's own failure: record it, grade the rest
            why = f"grader error: {type(e).__name__}: {e}"
            res = ExerciseResult(ex_id, _blank_tests(ex_id, "failed", why), "crashed")
        sub.results[slot] = res
        bar.update(1)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(work, tasks))
    bar.close()
    if out_dir is not None:
        write_reports(submissions, Path(out_dir))
    return submissions


def write_reports(submissions, out_dir: Path) -> None:
    """``grades.csv`` (a row per submission, a column per exercise, total) and ``results.json`` (per test)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    graded_ids = {r.exercise_id for s in submissions for r in s.results}
    ids = [ex_id for ex_id in exercises.all_exercises() if ex_id in graded_ids]
    with open(out_dir / "grades.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", *ids, "total", "max_total"])
        for s in submissions:
            by_id = {r.exercise_id: r for r in s.results}
            w.writerow([s.path, *[by_id[i].score if i in by_id else "" for i in ids], s.score, s.max_score])
    report = {"submissions": []}
    for s in submissions:
        tests = []
        for r in s.results:
            for t in r.tests:
                tests.append(
                    {
                        "name": f"{r.exercise_id}: {t['name']}",
                        "score": t["score"],
                        "max_score": t["max_score"],
                        "status": t["status"],
                        "output": t["output"],
                        "tags": [r.exercise_id, r.status],
                    }
                )
        entry = {"submission": s.path, "score": s.score, "max_score": s.max_score, "tests": tests}
        if s.error:
            entry["output"] = s.error
        report["submissions"].append(entry)
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))


def grade_table(submissions) -> str:
    """The table the command prints: one line per exercise, grouped by submission, with its total."""
    rows = [("submission", "exercise", "score", "result")]
    for s in submissions:
        for r in s.results:
            rows.append((s.path, r.exercise_id, f"{r.score}/{r.max_score}", r.label))
        rows.append((s.path, "total", f"{s.score}/{s.max_score}", s.error or ""))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
        if k == 0:
            lines.append("-" * (sum(widths) + 20))
    return "\n".join(line.rstrip() for line in lines)
