"""The submission's process: run the exercise cell, then compute answers for the inputs the grader sends.

It is untrusted once the learner's code has run, so it decides nothing: it receives inputs, calls the learner's
function, turns what came back into plain data (``wire.to_plain``) and sends it. Every check and every score is
computed by the grader (``flashlab.grade.worker``). The grader copies this module, ``wire`` and ``sandbox`` into a
package ``gradechild`` in a temporary folder and starts ``python -I -S -c "...; gradechild.child.main(IN, OUT)"``
there, with a clean environment and an import path without flashlab; it reads requests from the pipe IN and writes
replies to OUT.

Start-up (trusted: no learner code has run yet): enter the private view of the filesystem while the process has one
thread (``sandbox.enter_private_view``) and give up every capability, set the import path, import what the exercise
needs, apply the rest of the sandbox (``sandbox.restrict_filesystem``, ``sandbox.forbid_new_processes``), say
``{"walled": ...}`` and wait while the grader takes its memory baseline, then run the cell. The grader then
sends requests, one at a time:

- ``{"op": "call", "args": [...], "kwargs": {...}, "inputs_back": bool}`` -- call the function once; reply
  ``{"ok": value}`` (and ``"inputs_after"``), or ``{"raised": {...}}``. (A memory test reads this process's peak
  memory from the kernel after the reply; the child has no say in it.)
- ``{"op": "stream"}`` -- call the function with an iterator of blocks; each ``next()`` asks the grader for one
  block (``{"need": true}``), each value the function yields is sent as ``{"state": value}``.
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback

CELL_NAME = "<exercise cell>"
MAX_MESSAGE_CHARS = 2000


def _learner_line(tb) -> int | None:
    line = None
    for frame in traceback.extract_tb(tb):
        if frame.filename == CELL_NAME:
            line = frame.lineno
    return line


def describe(exc: BaseException) -> dict:
    """What the learner's code raised, as plain data: type name, message, line of the exercise cell."""
    while type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:  # Triton's interpreter wraps
        exc = exc.__cause__
    try:
        message = str(exc)
    except Exception:
        message = "(its message could not be read)"
    return {
        "type": str(type(exc).__name__)[:100],
        "builtin": type(exc).__module__ == "builtins",
        "message": message[:MAX_MESSAGE_CHARS],
        "line": _learner_line(exc.__traceback__),
    }


class CappedLog:
    """``sys.stdout`` / ``sys.stderr`` for the learner's prints: the log file starts over when it reaches ``cap``
    bytes, so printing any amount is allowed and the last output (a traceback) is still there to report."""

    def __init__(self, stream, cap: int = 1 << 20):
        self.stream, self.cap, self.written = stream, cap, 0

    def write(self, text: str) -> int:
        data = str(text)[-self.cap :]
        if self.written + len(data) > self.cap:
            self.stream.flush()
            self.stream.seek(0)
            self.stream.truncate()
            self.written = 0
        self.written += len(data)
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


class _Blocks:
    """The iterator a streaming answer reads: each ``next()`` asks the grader for one more block."""

    def __init__(self, wire, fds):
        self.wire, (self.in_fd, self.out_fd) = wire, fds

    def __iter__(self):
        return self

    def __next__(self):
        self.wire.send(self.out_fd, {"need": True})
        msg = self.wire.receive(self.in_fd)
        if msg.get("end"):
            raise StopIteration
        return msg["block"]


def _call(wire, fds, fn, msg) -> dict:
    args, kwargs = msg.get("args", ()), msg.get("kwargs", {})
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # everything the learner's function does is reported, not obeyed
        return {"raised": describe(e)}
    try:
        reply = {"ok": wire.to_plain(result)}
        if msg.get("inputs_back"):
            reply["inputs_after"] = wire.to_plain(list(args))
    except Exception as e:
        return {"unsendable": f"{type(e).__name__}: {e}"[:MAX_MESSAGE_CHARS]}
    return reply


def _stream(wire, fds, fn) -> dict:
    out_fd = fds[1]
    try:
        for state in fn(_Blocks(wire, fds)):
            wire.send(out_fd, {"state": wire.to_plain(state)})
    except BaseException as e:
        return {"raised": describe(e)}
    return {"done": True}


def _start(wire, sandbox, boot: dict, fds, view: dict):
    """Import what the exercise needs, wall the process in, run the cell; the learner's function, or a reply.

    Between the walls and the cell the child says ``{"walled": ...}`` and waits: the grader reads this process's
    memory then, before any learner code exists in it, as the baseline of the memory tests.
    """
    for name in boot["imports"]:
        __import__(name)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    harness = __import__(boot["harness"]) if boot.get("harness") else None
    walls = {"landlock": 0, "no_new_processes": False, **view}
    if boot.get("sandbox", True):
        walls.update(sandbox.restrict_filesystem(boot["readable"], boot["writable"], boot["listable"]))
        walls["no_new_processes"] = sandbox.forbid_new_processes()
    wire.send(fds[1], {"walled": walls})
    wire.receive(fds[0])  # go: the baseline is taken
    source, code = boot["source"], boot["code"]
    linecache.cache[CELL_NAME] = (len(source), None, source.splitlines(True), CELL_NAME)
    namespace: dict = {"__name__": "__exercise__"}
    try:
        exec(compile(code, CELL_NAME, "exec"), namespace)
    except BaseException as e:  # the learner's top-level code
        return None, {"setup": "cell raised", "raised": describe(e)}
    fn = namespace.get(boot["function"])
    if fn is None or not callable(fn):
        return None, {"setup": "no function"}
    if hasattr(fn, "fn") and callable(fn.fn) and not hasattr(fn, "__code__"):  # a @triton.jit function
        fn = fn.fn
    if harness is not None:
        step = fn

        def fn(*args, **kwargs):
            return harness.run(step, *args, **kwargs)

    return fn, {"ready": True}


def _enter_view(sandbox, boot: dict) -> dict:
    """The private view of the filesystem, entered while this process has one thread, then no capabilities;
    what held, for the walls the grader records."""
    if not boot.get("sandbox", True):
        return {"private_view": False, "view_problem": "the sandbox is off"}
    plan = boot.get("view") or {}
    if "plan" in plan:
        view = sandbox.enter_private_view(plan["root"], plan["plan"])
    else:
        view = {"private_view": False, "view_problem": str(plan.get("problem", "no plan"))}
    view["no_capabilities"] = sandbox.drop_capabilities()
    return view


def main(in_fd: int, out_fd: int) -> int:
    from . import sandbox, wire  # the runtime's own package, copied beside this file

    fds = (in_fd, out_fd)
    log = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # the log file the grader opened
    sys.stdout = sys.stderr = CappedLog(log)
    boot = wire.receive(in_fd)
    view = _enter_view(sandbox, boot)
    sys.path[:] = [p for p in boot["path"]]
    os.chdir(boot["cwd"])
    fn, reply = _start(wire, sandbox, boot, fds, view)
    wire.send(out_fd, reply)
    if fn is None:
        return 0
    while True:
        msg = wire.receive(in_fd)
        op = msg.get("op")
        if op == "call":
            wire.send(out_fd, _call(wire, fds, fn, msg))
        elif op == "stream":
            wire.send(out_fd, _stream(wire, fds, fn))
        else:
            return 0
