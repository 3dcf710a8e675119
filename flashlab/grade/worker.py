"""One exercise of one submission, graded in a process of its own: ``python -m flashlab.grade.worker SPEC OUT``.

SPEC is a JSON file ``{"exercise": "NN.name", "code": <the exercise cell>, "function": <name, optional>}``; the
exercise cell is all the grader sees of a notebook. The worker runs the learner's cell, then the exercise's pytest
tests with a plugin that hands them the learner's function as the fixture ``answer``, and appends one JSON line
per test to OUT as it goes (so a parent that has to kill a never-returning answer still has every result that
came before it).

While the learner's function runs, the plugin watches (``sys.setprofile``) for calls into flashlab's own code
outside the grader: an answer that calls flashlab's implementation scores 0 for the exercise. It also checks that
the function left its inputs as it found them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import linecache
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

MAX_OUTPUT_CHARS = 2000

_FLASHLAB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_ALLOWED_DIRS = tuple(_FLASHLAB_DIR + sub + os.sep for sub in ("grade", "exercises"))


class Watch:
    """While the learner's function runs (``with watch:``), record every call it makes into flashlab's own code.

    Only entry points are recorded (a flashlab function called from outside flashlab), and calls into the grader
    and the exercises' own harness code are allowed.
    """

    def __init__(self):
        self.depth = 0
        self.forbidden: list[str] = []

    def profile(self, frame, event, arg):
        if event != "call":
            return
        if not _is_flashlab(frame.f_code.co_filename):
            return
        if frame.f_back is not None and _is_flashlab(frame.f_back.f_code.co_filename):
            return  # flashlab calling itself: the entry point is already recorded
        rel = frame.f_code.co_filename[len(_FLASHLAB_DIR) :].removesuffix(".py").replace(os.sep, ".")
        name = f"flashlab.{rel}.{frame.f_code.co_name}".replace(".__init__.", ".")
        if name not in self.forbidden:
            self.forbidden.append(name)

    def __enter__(self):
        if self.depth == 0:
            sys.setprofile(self.profile)
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            sys.setprofile(None)


def _is_flashlab(filename: str) -> bool:
    """Code in flashlab's package, outside the grader and the exercises."""
    return filename.startswith(_FLASHLAB_DIR) and not filename.startswith(_ALLOWED_DIRS)


watch = Watch()


class InputMutated(AssertionError):
    pass


def _snapshot(x):
    if isinstance(x, np.ndarray):
        return x.copy()
    try:
        return copy.deepcopy(x)
    except Exception:
        return x


def _same(a, b) -> bool:
    try:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
        if hasattr(a, "data_ptr") and hasattr(a, "clone"):  # a torch tensor
            return bool((a == b).all() | ((a != a) & (b != b)).all())
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b) or (a != a and b != b)
    except Exception:
        return True


def wrap_answer(fn, check_inputs: bool = True):
    """The learner's function as the tests see it: watched for flashlab calls, and for changed inputs."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []

    @functools.wraps(fn)
    def answer(*args, **kwargs):
        before = [_snapshot(a) for a in args] if check_inputs else []
        with watch:
            result = fn(*args, **kwargs)
        for i, (a, b) in enumerate(zip(args, before, strict=False)):
            if not _same(a, b):
                name = params[i] if i < len(params) else f"#{i + 1}"
                raise InputMutated(
                    f"your function changed its input `{name}` in place; work on a copy (e.g. x = x.copy()) "
                    "so the caller's data stays as it was"
                )
        return result

    answer.flashlab_raw = fn
    return answer


def _learner_line(tb, cell_name: str) -> int | None:
    line = None
    for frame in traceback.extract_tb(tb):
        if frame.filename == cell_name:
            line = frame.lineno
    return line


def describe_exception(exc: BaseException, tb, cell_name: str) -> str:
    """A learner-facing one-paragraph account of an exception, never a stack trace."""
    while type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:  # Triton's interpreter wraps
        exc = exc.__cause__
        tb = exc.__traceback__
    if isinstance(exc, NotImplementedError):
        return "not implemented yet: replace `raise NotImplementedError` in the exercise cell with your code"
    if isinstance(exc, AssertionError):
        line = _learner_line(tb, cell_name)
        msg = str(exc) or "a check failed"
        if line is not None and not isinstance(exc, InputMutated) and "flashlab" not in str(type(exc).__module__):
            return f"your function failed an assert of its own at line {line} of the exercise cell: {msg}"
        return msg
    if isinstance(exc, NameError) and _learner_line(tb, cell_name) is not None:
        return (
            f"NameError: {exc} (line {_learner_line(tb, cell_name)} of the exercise cell). The grader runs only the "
            "exercise cell: import what you use and define helpers inside that cell"
        )
    line = _learner_line(tb, cell_name)
    where = f" at line {line} of the exercise cell" if line is not None else ""
    return f"your function raised {type(exc).__name__}{where}: {exc}"


def truncate(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit:,} more characters of output cut]"


class GradePlugin:
    """pytest plugin: selects one exercise's tests, hands them ``answer``, records score per test."""

    def __init__(self, exercise, answer, out_path: Path, cell_name: str):
        self.exercise = exercise
        self.answer_fn = answer
        self.out_path = out_path
        self.cell_name = cell_name
        self.results: list[dict] = []

    def pytest_collection_modifyitems(self, session, config, items):
        keep = [it for it in items if getattr(getattr(it, "obj", None), "flashlab_exercise", None) == self.exercise.id]
        drop = [it for it in items if it not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    @pytest.fixture
    def answer(self):
        return self.answer_fn

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and report.failed):
            fn = item.obj
            points = fn.flashlab_points
            if report.passed:
                message, score = "passed", points
            else:
                exc = call.excinfo.value if call.excinfo else None
                tb = call.excinfo.tb if call.excinfo else None
                message = describe_exception(exc, tb, self.cell_name) if exc else "failed"
                score = 0
            printed = "".join(text for _, text in report.sections if "Captured" in _)
            record = {
                "test": item.name,
                "name": (fn.__doc__ or item.name).strip().splitlines()[0],
                "score": score,
                "max_score": points,
                "status": "passed" if score == points else "failed",
                "output": message,
            }
            if printed:
                record["printed"] = truncate(printed, 500)
            self.results.append(record)
            with open(self.out_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _write(out_path: Path, record: dict) -> None:
    with open(out_path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(spec: dict, out_path: Path) -> None:
    from flashlab import exercises
    from flashlab.grade.cells import runnable_code

    ex = exercises.get(spec["exercise"])
    module = __import__(ex.module, fromlist=["_"])  # the tests bind flashlab's reference before learner code runs
    cell_name = f"<exercise cell {ex.id}>"

    def fail_all(message: str, status: str = "failed") -> None:
        for fn in exercises.tests_of(ex.id):
            doc = (fn.__doc__ or fn.__name__).strip().splitlines()[0]
            _write(
                out_path,
                {
                    "test": fn.__name__,
                    "name": doc,
                    "score": 0,
                    "max_score": fn.flashlab_points,
                    "status": status,
                    "output": message,
                },
            )

    namespace: dict = {"__name__": "__exercise__"}
    exec("import math\nimport numpy as np\n", namespace)
    source = spec["code"]
    try:
        code = runnable_code(source)
    except SyntaxError as e:
        fail_all(f"the exercise cell has a syntax error at line {e.lineno}: {e.msg}")
        return
    linecache.cache[cell_name] = (len(source), None, source.splitlines(True), cell_name)
    try:
        exec(compile(code, cell_name, "exec"), namespace)
    except BaseException as e:  # the learner's top-level code
        fail_all(f"running the exercise cell failed: {describe_exception(e, e.__traceback__, cell_name)}")
        return
    fn_name = spec.get("function") or ex.name  # the inline check passes the name of the function it was given
    fn = namespace.get(fn_name)
    if fn is None or not callable(fn):
        fail_all(f"the exercise cell must define a function named `{fn_name}`")
        return
    if hasattr(fn, "fn") and callable(fn.fn) and not inspect.isfunction(fn):  # a @triton.jit function
        fn = fn.fn
    answer = wrap_answer(fn, check_inputs=ex.wrap)

    plugin = GradePlugin(ex, answer, out_path, cell_name)
    args = [
        module.__file__,
        "-q",
        "--no-header",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,
        "--rootdir",
        str(Path(module.__file__).parent),
        "-o",
        "python_functions=test_*",
        "-W",
        "ignore",
    ]
    pytest.main(args, plugins=[plugin])
    if watch.forbidden:
        names = ", ".join(watch.forbidden[:3])
        _write(
            out_path,
            {
                "forbidden": watch.forbidden,
                "output": f"your function calls flashlab's own implementation ({names}); this exercise asks you to "
                "write it yourself, so it scores 0",
            },
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m flashlab.grade.worker SPEC.json OUT.jsonl", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    run(spec, Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
