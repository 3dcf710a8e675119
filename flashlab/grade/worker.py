"""The grader's side of one submission's process: start it walled in, send it inputs, read back plain answers.

``Worker(exercise, code, function, ...)`` starts ``flashlab.grade.child`` in a process group of its own (so one
signal reaches everything it is), with resource limits, an empty temporary working folder, a clean environment and an
import path that holds the standard library and the third-party packages but not flashlab, and no way to read
outside them, nor (in its private view, ``private_view``) to see that anything else exists (``sandbox``). The timer
runs here: when the exercise's time is up, or grading ends or is interrupted, the whole process group is killed
(``kill_all`` kills every live one).

``Answer(worker)`` is what an exercise's tests receive as ``answer``: calling it sends the arguments and returns
the plain value the function returned; ``answer.measure(...)`` also returns how far the process's resident memory
ever rose above its baseline (read here from the kernel before the learner's cell ran); ``answer.stream(blocks)``
feeds a streaming answer one block at a time and yields each running state it reports, so a test checks a state
before the next block is sent.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np

from flashlab.grade import sandbox, wire

RUNTIME_MODULES = ("__init__.py", "child.py", "sandbox.py", "wire.py")
PACKAGE = "gradechild"
MIB = 2**20
FLASHLAB_ROOT = Path(__file__).resolve().parents[1]


class Timeout(Exception):
    """The exercise's time ran out; its process group was killed."""


class Crashed(Exception):
    """The submission's process died, or sent something that is not an answer."""


class AnswerRaised(Exception):
    """The learner's function raised; ``kind`` is the exception's type name, ``line`` the cell line (or None)."""

    def __init__(self, kind: str, message: str, line: int | None):
        super().__init__(message)
        self.kind, self.message, self.line = kind, message, line

    def describe(self) -> str:
        where = f" at line {self.line} of the exercise cell" if self.line is not None else ""
        if self.kind == "NotImplementedError":
            return "not implemented yet: replace `raise NotImplementedError` in the exercise cell with your code"
        if self.kind == "AssertionError" and self.line is not None:
            return f"your function failed an assert of its own{where}: {self.message or 'a check failed'}"
        if self.kind == "NameError" and self.line is not None:
            return (
                f"NameError: {self.message}{where}. The grader runs only the exercise cell: import what you use and "
                "define helpers inside that cell"
            )
        return f"your function raised {self.kind}{where}: {self.message}"


# the built-in exceptions a test may catch by type; the learner's exception arrives as a subclass of the same name
_BUILTIN_RAISES = {
    e.__name__: type(e.__name__, (AnswerRaised, e), {"__init__": AnswerRaised.__init__, "__str__": Exception.__str__})
    for e in (ValueError, TypeError, ZeroDivisionError, IndexError, KeyError, OverflowError, NotImplementedError)
}


def raised(info) -> AnswerRaised:
    """The exception the grader raises for what the child reported."""
    if not isinstance(info, dict):
        return Crashed("the submission's process sent an unreadable error report")
    kind = str(info.get("type", "Exception"))[:100]
    line = info.get("line") if type(info.get("line")) is int else None
    cls = _BUILTIN_RAISES.get(kind, AnswerRaised) if info.get("builtin") is True else AnswerRaised
    return cls(kind, str(info.get("message", ""))[:2000], line)


class InputMutated(AssertionError):
    """The learner's function changed an argument in place."""


# -- where the child may look -------------------------------------------------------------------------------------


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    paths = sysconfig.get_paths()
    dirs += [paths["purelib"], paths["platlib"]]
    out = []
    for d in dirs:
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def stdlib_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    out = [paths["stdlib"], paths["platstdlib"]]
    out += [p for p in sys.path if p.endswith(".zip") or p.endswith("lib-dynload")]
    return [d for i, d in enumerate(out) if d not in out[:i] and os.path.exists(d)]


def child_path(runtime: Path) -> list[str]:
    """The child's import path: its runtime, the standard library, site-packages (no .pth files, so no flashlab)."""
    return [str(runtime), *stdlib_dirs(), *_site_dirs()]


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def hidden_paths(site_dirs=None) -> list[str]:
    """What the child must not read even where it lies inside a readable folder: flashlab itself (the package it
    runs from, every entry of site-packages that names flashlab, the checkout an editable install points at)."""
    site_dirs = _site_dirs() if site_dirs is None else site_dirs
    out = [FLASHLAB_ROOT, FLASHLAB_ROOT.parent] if _is_checkout(FLASHLAB_ROOT.parent) else [FLASHLAB_ROOT]
    for d in site_dirs:
        out += [Path(d) / name for name in os.listdir(d) if "flashlab" in name.lower()]
    return sorted({os.path.realpath(p) for p in out})


def _is_checkout(folder: Path) -> bool:
    return (folder / "pyproject.toml").exists() or (folder / ".git").exists()


def _open_except(path: str, hidden: list[str], seen: set, parent: str | None = None) -> tuple[list, list]:
    """``(readable, listable)`` that open ``path`` but nothing in ``hidden``: the folder itself where nothing hidden
    lies inside it, else its names (listable) and, one by one, what beside the hidden entries it holds."""
    real = os.path.realpath(path)
    if parent is not None and not _beneath(real, parent) and any(_beneath(real, h) for h in hidden):
        return [], []  # a link out of the folder being opened, into a hidden one
    if real in seen or real in hidden:
        return [], []
    seen.add(real)
    if not any(_beneath(h, real) for h in hidden):
        return [real], []
    readable, listable = [], [real]
    try:
        names = sorted(os.listdir(real))
    except OSError:
        return [], listable
    for name in names:
        r, ls = _open_except(os.path.join(real, name), hidden, seen, parent=real)
        readable += r
        listable += ls
    return readable, listable


def _readable_tops(runtime: Path, site_dirs) -> list[str]:
    """The child's readable places as named (links unresolved): the Python installation, the third-party packages,
    system libraries, its own runtime."""
    tops = [sys.base_prefix, sys.exec_prefix, *stdlib_dirs(), *site_dirs]
    tops += ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/usr/share/zoneinfo", "/dev/null"]
    return tops + ["/dev/urandom", "/proc/self", "/sys/devices/system/cpu", "/etc/ld.so.cache", str(runtime)]


def private_view(runtime: Path, work: Path, readable: list[str], listable: list[str]) -> dict:
    """The child's private view of the filesystem (``sandbox.view_plan``): what it may read and its working folder,
    bound where they are, and the links on the way to every path it names; ``{"problem": why}`` where none can be
    made. Its root is built in ``runtime``'s parent folder, ``root`` (empty)."""
    root = runtime.parent.resolve() / "root"
    wanted = [sys.executable, str(work), *child_path(runtime), *_readable_tops(runtime, _site_dirs())]
    wanted = [p for p in wanted if p != sandbox.OWN_PROC]  # the child's own, bound as it is
    try:
        plan = sandbox.view_plan(readable, [str(work)], listable, wanted, str(root))
    except (OSError, ValueError) as e:
        return {"problem": f"no private view of the filesystem: {e}"}
    root.mkdir()
    return {"root": str(root), "plan": plan}


def readable_paths(runtime: Path, site_dirs=None) -> tuple[list[str], list[str]]:
    """``(readable, listable)`` for the walled-in child: the Python installation, the third-party packages, system
    libraries and its runtime, each opened except flashlab's entries (``hidden_paths``) inside it; ``listable``
    are the folders the child may list but whose files it may read only as ``readable`` allows."""
    site_dirs = _site_dirs() if site_dirs is None else site_dirs
    hidden = hidden_paths(site_dirs)
    readable, listable, seen = [], [], set()
    for top in _readable_tops(runtime, site_dirs):
        if top.startswith("/proc/self"):  # the child's own, resolved in the child: never realpath'd here
            readable.append(top)
        elif os.path.exists(top):
            r, ls = _open_except(top, hidden, seen)
            readable += r
            listable += ls
    return readable, listable


# -- live workers: every one is killed when grading ends or is interrupted --------------------------------------

_LIVE: set[Worker] = set()
_LIVE_LOCK = threading.Lock()


def kill_all() -> int:
    """Kill every live submission process group (grading was interrupted). Returns how many."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for s in live:
        s.kill()
    return len(live)


class Worker:
    """One submission's process for one exercise, started lazily and restarted after a crash."""

    def __init__(self, exercise, code: str, source: str, function: str, deadline: float, memory_mib: int | None = None):
        self.exercise, self.code, self.source, self.function = exercise, code, source, function
        self.deadline = deadline  # time.monotonic() when the exercise's time is up
        self.memory_mib = memory_mib or exercise.memory_mib
        self.proc: subprocess.Popen | None = None
        self.tmp: Path | None = None
        self.walls: dict = {}
        self.baseline: int | None = None  # resident bytes before the learner's cell ran
        self.killed = False

    # -- starting and stopping -------------------------------------------------------------------------------

    def _runtime(self, tmp: Path) -> Path:
        runtime = tmp / "runtime"
        pkg = runtime / PACKAGE
        pkg.mkdir(parents=True)
        here = resources.files("flashlab.grade")
        for name in RUNTIME_MODULES[1:]:
            (pkg / name).write_text(here.joinpath(name).read_text())
        (pkg / "__init__.py").write_text("")
        if self.exercise.harness:
            src = resources.files("flashlab.exercises").joinpath(self.exercise.harness + ".py").read_text()
            (runtime / f"{self.exercise.harness}.py").write_text(src)
        return runtime

    def _limits(self) -> sandbox.Limits:
        left = max(1.0, self.deadline - time.monotonic())
        return sandbox.Limits(
            memory_bytes=int(self.memory_mib * MIB),
            cpu_seconds=int(math.ceil(left)) + 2,
            tasks=sandbox.tasks_of_user() + 64,
        )

    def start(self) -> dict:
        """Start the process and run the cell. Returns the child's start-up reply (``ready`` or ``setup``)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="flashlab-answer-"))
        runtime = self._runtime(self.tmp)
        work = self.tmp / "work"
        work.mkdir()
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "MALLOC_MMAP_THRESHOLD_": "65536",
        }
        if self.exercise.triton:
            env.update(TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(work / "triton"))
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        limits = self._limits()
        # The limits are set first thing in the new interpreter, before it imports anything or reads a byte of the
        # learner's code. Not in preexec_fn: that runs the interpreter's fork handlers in a grader with many
        # threads, which can deadlock it.
        bootstrap = (
            f"import sys; sys.path[:] = {child_path(runtime)!r}; from {PACKAGE} import sandbox; "
            f"sandbox.set_limits(sandbox.{limits!r}); from {PACKAGE}.child import main; "
            f"sys.exit(main({from_parent}, {to_parent}))"
        )
        log = open(self.tmp / "log.txt", "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", bootstrap],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(from_parent, to_parent),
                start_new_session=True,  # setsid: a process group of its own, so one killpg reaches all of it
                close_fds=True,
            )
        finally:
            log.close()
            os.close(from_parent)
            os.close(to_parent)
        self.to_child, self.from_child = to_child, from_child
        with _LIVE_LOCK:
            _LIVE.add(self)
        readable, listable = readable_paths(runtime)
        boot = {
            "view": private_view(runtime, work, readable, listable),
            "path": child_path(runtime),
            "cwd": str(work),
            "imports": list(self.exercise.child_imports),
            "harness": self.exercise.harness,
            "readable": readable,
            "listable": listable,
            "writable": [str(work)],
            "code": self.code,
            "source": self.source,
            "function": self.function,
        }
        self._send(boot)
        walled = self.receive().get("walled")  # sent before any learner code: what held, as the child found it
        self.walls = walled if isinstance(walled, dict) else {}
        try:
            self.baseline = self.reset_peak()
        except OSError:
            self.baseline = None  # no /proc: a memory test says so and fails
        self._send("go")
        return self.receive()

    def kill(self) -> None:
        """Kill the process group, reap the process, remove its folder. Safe to call more than once."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            for fd in (self.to_child, self.from_child):
                with contextlib.suppress(OSError):
                    os.close(fd)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def log_tail(self, chars: int = 600) -> str:
        """The last ``chars`` bytes the process printed (only those are read, however much it wrote)."""
        try:
            with open(self.tmp / "log.txt", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - chars))
                data = f.read(chars)
        except (OSError, TypeError):
            return ""
        return data.decode("utf-8", "replace")

    # -- talking -------------------------------------------------------------------------------------------------

    def _send(self, message) -> None:
        try:
            wire.send(self.to_child, message, deadline=self.deadline)
        except wire.Late:
            self.kill()
            raise Timeout() from None
        except (BrokenPipeError, OSError):
            self._died()

    def receive(self):
        if time.monotonic() >= self.deadline:
            self.kill()
            raise Timeout()
        try:
            msg = wire.receive(self.from_child, deadline=self.deadline)
        except wire.Late:
            self.kill()
            raise Timeout() from None
        except wire.Closed:
            self._died()
        except wire.WireError as e:
            self.kill()
            raise Crashed(f"the submission's process sent something that is not plain data ({e})") from None
        if not isinstance(msg, dict):
            self.kill()
            raise Crashed("the submission's process sent something that is not a message")
        return msg

    def _died(self):
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=max(0.1, min(2.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                code = None  # its channel closed but it lives on: killed below
        tail = self.log_tail()
        self.kill()
        if code is not None and code < 0 and -code == signal.SIGXCPU:
            raise Timeout()
        why = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        raise Crashed(f"the grading process stopped unexpectedly ({why}): {tail}".rstrip())

    def request(self, message):
        if self.proc is None:
            raise Crashed("the submission's process is not running")
        self._send(message)
        return self.receive()

    def peak_rss_bytes(self) -> int:
        """The process's high-water mark of resident memory since the last reset; OSError where it has none."""
        if self.proc is None:
            raise OSError("the process has ended")
        return _status_kib(self.proc.pid, "VmHWM") * 1024

    def reset_peak(self) -> int:
        """Reset the kernel's peak-RSS mark of the process; its RSS now, in bytes."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        return _status_kib(self.proc.pid, "VmRSS") * 1024


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} for process {pid}")


# -- the answer the tests call -----------------------------------------------------------------------------------


def _array_bytes(x) -> int:
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(_array_bytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_array_bytes(v) for v in x.values())
    return 0


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"))
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


class Answer:
    """The learner's function as the tests see it: it runs in the submission's process, on plain data only."""

    def __init__(self, worker: Worker, params: list[str] | None = None):
        self.worker = worker
        self.params = params or []
        self.check_inputs = worker.exercise.check_inputs

    def _reply(self, reply):
        if "raised" in reply:
            raise raised(reply["raised"])
        if "unsendable" in reply:
            raise AssertionError(f"your function returned something the grader cannot read: {reply['unsendable']}")
        if "ok" not in reply:
            raise Crashed("the submission's process answered out of turn")
        return reply["ok"]

    def _check_inputs(self, args, reply) -> None:
        after = reply.get("inputs_after")
        if after is None:
            return
        for i, (a, b) in enumerate(zip(args, after, strict=False)):
            if not _same(a, b):
                name = self.params[i] if i < len(self.params) else f"#{i + 1}"
                raise InputMutated(
                    f"your function changed its input `{name}` in place; work on a copy (e.g. x = x.copy()) "
                    "so the caller's data stays as it was"
                )

    def __call__(self, *args, **kwargs):
        args = wire.to_plain(list(args))
        reply = self.worker.request(
            {"op": "call", "args": args, "kwargs": wire.to_plain(kwargs), "inputs_back": self.check_inputs}
        )
        value = self._reply(reply)
        if self.check_inputs:
            self._check_inputs(args, reply)
        return value

    def measure(self, *args, **kwargs):
        """``(value, peak_bytes)``: the answer, and how far the process's resident memory ever rose above what it was
        before the learner's cell ran, read from the kernel once the whole reply has arrived, less the bytes of the
        call's input arrays (which the process must hold to make the call).

        The peak is the process's high-water mark over its whole life since that baseline: memory touched when the
        cell ran, in earlier calls, or in any step of this one counts, and nothing the process does can lower it
        (the walls keep it from resetting the mark). Where the mark cannot be read, the test fails.
        """
        s = self.worker
        value = self(*args, **kwargs)
        inputs = _array_bytes(wire.to_plain([args, kwargs]))  # read into the process's memory for the call
        try:
            if s.baseline is None:
                raise OSError("no baseline was taken when the process started")
            peak = s.peak_rss_bytes() - s.baseline - inputs
        except (OSError, AttributeError, ValueError) as e:
            s.kill()
            raise AssertionError(
                "this test measures your function's peak memory, read by the grader from Linux's /proc, and that "
                f"reading is missing ({e}); the test is failed"
            ) from None
        return value, max(0, peak)

    def stream(self, blocks):
        """Feed ``blocks`` one at a time; yield each state the answer reports, one per block, before the next."""
        s = self.worker
        blocks = [wire.to_plain(b) for b in blocks]
        reply = s.request({"op": "stream"})
        sent, stated = 0, 0  # blocks sent, states received
        try:
            while True:
                if "need" in reply:
                    if stated < sent:
                        raise AssertionError(
                            f"your function read block {sent + 1} before yielding its running state for block "
                            f"{sent}: yield (m, l, acc) after each block, before reading the next"
                        )
                    more = sent < len(blocks)
                    reply = s.request({"block": blocks[sent]} if more else {"end": True})
                    sent += more
                elif "state" in reply:
                    if stated == sent:
                        raise AssertionError(
                            f"your function yielded a second state for block {sent} (or one before reading any "
                            "block): yield once per block, after folding it in"
                        )
                    stated += 1
                    yield reply["state"]
                    reply = s.receive()
                elif "done" in reply:
                    if sent < len(blocks):
                        raise AssertionError(f"your function stopped after {sent} of {len(blocks)} blocks")
                    return
                else:
                    self._reply(reply)
                    raise Crashed("the submission's process answered out of turn")
        except GeneratorExit:
            s.kill()  # the test stopped reading mid-stream: this process is out of step, start afresh
            raise
        except AssertionError:
            s.kill()
            raise
