"""The grader is honest and hard to fool: stubs score 0, reference solutions full marks, and hostile submissions --
built here from the solved notebooks, one exercise cell replaced -- score what they deserve, while every other
exercise and every other submission in the same run is graded exactly as it would be alone.

Two batched runs: the committed learner notebooks with the solved notebooks (default limits), and the hostile
probes with clean copies beside them (a short time limit). ``tests/test_grader_cli.py`` covers the command line
(validation, lock, interruption); ``tests/test_grader_units.py`` the wire format, the sandbox and the cell reader.
"""

from __future__ import annotations

import csv
import json
import os
import re
import uuid
from pathlib import Path

import nbformat
import pytest

from conftest import NOTEBOOKS, ROOT
from flashlab import exercises
from flashlab.exercises import MODULES, all_exercises, exercises_of
from flashlab.exercises.checks import MASK_MISALIGNED, MAX_NOT_SUBTRACTED, RESCALE_FORGOTTEN
from flashlab.grade import Status, check, grade
from flashlab.grade.cells import find_exercise_cells, runnable_code
from flashlab.grade.solutions import exercise_cells, has_exercises, load_solutions

LEARNER_NOTEBOOKS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = load_solutions(ROOT / "instructor" / "solutions")
PROBE_TIME_LIMIT_S = 8
MARK = f"flashlab-probe-{uuid.uuid4().hex[:12]}"  # a string no other process on the machine carries


def notebook_of(nb_id: str | None, cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if nb_id:
        nb.metadata["flashlab"] = {"notebook": nb_id}
    nb.cells = [nbformat.v4.new_markdown_cell("# a submission"), *cells]
    return nb


def solved_notebook(nb_id: str, replace: dict[str, str] | None = None) -> nbformat.NotebookNode:
    nb = notebook_of(nb_id, exercise_cells(nb_id))
    for ex_id, cell in find_exercise_cells(nb).items():
        nb.cells[cell.index].source = (replace or {}).get(ex_id, SOLUTIONS[ex_id])
    return nb


def points(nb_id: str) -> int:
    return sum(exercises.max_points(e.id) for e in exercises_of(nb_id))


# -- the hostile probes: (notebook, exercise replaced, cell, deserved score) ---------------------------------------
# deserved: an int, or "partial" (more than 0, less than full marks). Paths a probe aims at are written into it,
# as the strongest student would: one who knows where the checkout and the grader's output are.

OUT_PLACEHOLDER = "@OUT@"
DENSE_03 = """
import numpy as np

_S = np.ones((3072, 3072))  # allocated and touched when the cell runs


def tiled_attention(q, k, v, block_m, block_n, causal=False):
    nq, nk = q.shape[0], k.shape[0]
    s = @S@  # (Nq, Nk): the whole score matrix
    np.matmul(q, k.T, out=s)
    s /= np.sqrt(q.shape[1])
    if causal:
        s[np.arange(nk)[None, :] > np.arange(nq)[:, None] + (nk - nq)] = -np.inf
    m = s.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    l = s.sum(axis=1, keepdims=True)
    return np.where(l > 0, s @ v / np.where(l > 0, l, 1.0), 0.0)
"""
PROBES = {
    # it believes what the submission writes
    "fake_records": (
        "07",
        "07.kv_cache_bytes_per_token",
        f"""
import json, os, struct

def _frame(m):
    b = json.dumps(m).encode()
    return struct.pack(">Q", len(b)) + b

for fd in range(3, 40):
    for msg in [{{"ready": True}}] + [{{"ok": 327680}}] * 300:
        try:
            os.write(fd, _frame(msg))
        except OSError:
            pass
for p in ("results.jsonl", "../results.jsonl", "{OUT_PLACEHOLDER}/results.json", "{OUT_PLACEHOLDER}/grades.csv"):
    try:
        open(p, "a").write(json.dumps({{"test": "x", "score": 4000, "max_score": 1}}) + "\\n")
    except OSError:
        pass

def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    os._exit(0)
""",
        0,
    ),
    "daemon_and_signals": (
        "07",
        "07.kv_cache_bytes_per_token",
        f"""
import os, signal, subprocess, sys
for start in (
    lambda: os.fork(),
    lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {MARK}"], start_new_session=True),
    lambda: os.posix_spawn("/bin/sleep", ["sleep", "60", "{MARK}"], os.environ),
):
    try:
        if start() == 0:
            os._exit(0)
    except Exception:
        pass
for pid in [os.getppid()] + list(range(os.getppid() - 20, os.getppid() + 200)):
    if pid > 1 and pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except Exception:
            pass
try:
    open("{OUT_PLACEHOLDER}/grades.csv", "w").write("HACKED")
except OSError:
    pass

def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    raise NotImplementedError
""",
        0,
    ),
    "spawns_then_hangs": (
        "07",
        "07.kv_cache_bytes_per_token",
        f"""
import subprocess, sys

def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    try:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {MARK}"], start_new_session=True)
    except OSError:
        pass
    while True:
        pass
""",
        0,
    ),
    "big_allocation": (
        "07",
        "07.kv_cache_bytes_per_token",
        SOLUTIONS["07.kv_cache_bytes_per_token"].replace(
            "    if latent_dim is not None:",
            "    import numpy as np\n    hog = np.ones(3 * 2**30 // 8)  # 3 GiB\n    if latent_dim is not None:",
        ),
        0,
    ),
    # it trusts the objects an answer returns
    "float_subclass": (
        "05",
        "05.achieved_tflops",
        """
import sys

class Sneaky(float):
    def __float__(self):
        f = sys._getframe()
        while f is not None:
            for name in ("want", "expected", "x"):
                v = f.f_locals.get(name)
                if type(v) is float:
                    return v
            f = f.f_back
        return 0.0

def achieved_tflops(batch, heads, n, d, seconds, causal=False):
    return Sneaky(1.0)
""",
        0,
    ),
    # code in the cell patches the checks
    "patches_checks": (
        "07",
        "07.kv_cache_bytes_per_token",
        """
import math, sys
math.isclose = lambda *a, **k: True
try:
    import _pytest.reports
    _pytest.reports.BaseReport.passed = property(lambda s: True)
except Exception:
    pass
try:
    import flashlab.exercises.checks as c
    c.expect_int = c.expect_number = c.expect_array = lambda *a, **k: None
except Exception:
    pass
sys.setprofile(None)

def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    return 1
""",
        0,
    ),
    "imports_flashlab_by_path": (
        "06",
        "06.merge_split_kv",
        f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from flashlab.reference import merge_partials

def merge_split_kv(outs, lses):
    return merge_partials(list(outs), list(lses))
""",
        0,
    ),
    "execs_reference_source": (
        "06",
        "06.merge_split_kv",
        f"""
def merge_split_kv(outs, lses):
    g = {{"__name__": "copied"}}
    exec(open({str(ROOT / "flashlab" / "reference" / "merge.py")!r}).read(), g)
    return g["merge_partials"](list(outs), list(lses))
""",
        0,
    ),
    "execs_solution_file": (
        "06",
        "06.merge_split_kv",
        f"""
def merge_split_kv(outs, lses):
    g = {{}}
    exec(open({str(ROOT / "instructor" / "solutions" / "06_decode.py")!r}).read(), g)
    return g["merge_split_kv"](outs, lses)
""",
        0,
    ),
    "reads_test_name": (
        "07",
        "07.kv_cache_bytes_per_token",
        """
import sys

def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name.startswith("test_kv_lesson"):
            return 327_680
        if f.f_code.co_name.startswith("test_kv_mha"):
            return 2_621_440
        f = f.f_back
    return 0
""",
        0,
    ),
    # tests of the algorithm
    "not_streaming": (
        "01",
        "01.streaming_attention",
        """
import numpy as np

def streaming_attention(blocks):
    blocks = list(blocks)  # reads every block before yielding anything
    m, l, acc = -np.inf, 0.0, 0.0
    for s, v in blocks:
        m_new = max(m, float(np.max(s)))
        a = np.exp(m - m_new) if m > -np.inf else 0.0
        p = np.exp(np.asarray(s) - m_new)
        l, acc, m = a * l + p.sum(), a * acc + p @ np.asarray(v), m_new
        yield m, l, acc
""",
        0,
    ),
    "stream_no_rescale": (
        "01",
        "01.streaming_attention",
        SOLUTIONS["01.streaming_attention"].replace(
            "alpha = np.exp(m - m_new) if m > -np.inf else 0.0", "alpha = 1.0 if m > -np.inf else 0.0"
        ),
        0,  # every test has a new max after the first block
    ),
    "stream_no_max": (
        "01",
        "01.streaming_attention",
        SOLUTIONS["01.streaming_attention"].replace("p = np.exp(scores - m_new)", "p = np.exp(scores)"),
        0,
    ),
    "close_always_false": (
        "08",
        "08.close_enough",
        "def close_enough(actual, expected, dtype):\n    return False\n",
        0,
    ),
    "close_always_true": ("08", "08.close_enough", "def close_enough(actual, expected, dtype):\n    return True\n", 0),
    "close_allclose": (
        "08",
        "08.close_enough",
        "import numpy as np\n\ndef close_enough(actual, expected, dtype):\n    try:\n"
        "        return bool(np.allclose(actual, expected))\n    except ValueError:\n        return False\n",
        0,
    ),
    "close_normwise_only": (
        "08",
        "08.close_enough",
        """
import numpy as np

def close_enough(actual, expected, dtype):
    tol = {"float16": 2e-3, "bfloat16": 1.5e-2, "float32": 1e-5, "float64": 1e-10}[dtype]
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape or np.isnan(a).any():
        return False
    return bool(np.linalg.norm(a - e) <= tol * np.linalg.norm(e))
""",
        "partial",
    ),
    # the memory gates: the peak over the process's whole life, against a baseline taken before the cell ran
    "dense_buffer_from_cell_time": ("03", "03.tiled_attention", DENSE_03.replace("@S@", "_S[:nq, :nk]"), 0),
    "dense_skipping_memory_steps": (
        "03",
        "03.tiled_attention",
        """
import sys


def _answer_measured_calls_as_plain_ones():  # no memory step: the grader once took a peak of 0 then
    child = sys.modules["gradechild.child"]
    plain_call = child._call

    def _call(wire, fds, fn, msg):
        return plain_call(wire, fds, fn, {k: v for k, v in msg.items() if k != "measure"})

    child._call = _call
    return True


_PATCHED = _answer_measured_calls_as_plain_ones()
"""
        + DENSE_03.replace("_S = np.ones((3072, 3072))  # allocated and touched when the cell runs", "").replace(
            "@S@", "np.empty((nq, nk))"
        ),
        0,
    ),
    "dense_before_the_measured_call": (
        "03",
        "03.tiled_attention",
        DENSE_03.replace("_S = np.ones((3072, 3072))  # allocated and touched when the cell runs", "").replace(
            "@S@", "np.empty((nq, nk))"
        )
        + """
import sys


def _compute_when_the_request_arrives(dense):  # before the call, and before the grader once reset its peak mark
    child = sys.modules["gradechild.child"]
    plain_call = child._call

    def _call(wire, fds, fn, msg):
        answer = dense(*msg.get("args", ()), **msg.get("kwargs", {}))
        return plain_call(wire, fds, lambda *a, **k: answer, msg)

    child._call = _call
    return True


_PATCHED = _compute_when_the_request_arrives(tiled_attention)
""",
        0,
    ),
    "delta_through_a_buffer_from_cell_time": (
        "09",
        "09.delta",
        """
import numpy as np

_P = np.ones((3000, 3000))  # an N x N buffer, touched when the cell runs


def delta(do, o):
    do, o = np.asarray(do, dtype=np.float64), np.asarray(o, dtype=np.float64)
    if do.ndim != 2:
        return (do * o).sum(axis=-1)
    n = do.shape[0]
    p = _P[:n, :n]
    np.matmul(do, o.T, out=p)  # the N x N matrix dO O^T; delta is its diagonal
    return np.diagonal(p).copy()
""",
        0,
    ),
    # the seccomp filter: one system-call table, no namespaces (each answers right only where a wall failed)
    "forks_through_the_i386_table": (
        "07",
        "07.kv_cache_bytes_per_token",
        """
import ctypes, mmap, os


def _fork_through_i386():  # the cell runs only assignments and definitions: the attempt is one
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(b"\\xb8\\x02\\x00\\x00\\x00\\xcd\\x80\\xc3")  # mov eax, 2 (i386 fork); int 0x80; ret
    pid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    if pid == 0:
        os._exit(0)
    return pid > 0


_FORKED = _fork_through_i386()
"""
        + SOLUTIONS["07.kv_cache_bytes_per_token"].replace(
            "    if latent_dim is not None:", "    assert _FORKED\n    if latent_dim is not None:"
        ),
        0,
    ),
    "unshares_a_namespace": (
        "07",
        "07.kv_cache_bytes_per_token",
        "import ctypes\n\n_UNSHARED = ctypes.CDLL(None).unshare(0x04000000) == 0  # CLONE_NEWUTS\n"
        + SOLUTIONS["07.kv_cache_bytes_per_token"].replace(
            "    if latent_dim is not None:", "    assert _UNSHARED\n    if latent_dim is not None:"
        ),
        0,
    ),
    # the answers the old tests already caught
    # what the grader's own process reads and quotes is capped
    "huge_cell": (
        "07",
        "07.kv_cache_bytes_per_token",
        "#" + "x" * 2_000_000 + "\n" + SOLUTIONS["07.kv_cache_bytes_per_token"],
        0,
    ),
    "string_answer_quoted": (
        "08",
        "08.close_enough",
        "def close_enough(actual, expected, dtype):\n    return 'x' * 3_000_000  # quoted by the check\n",
        0,
    ),
    "string_answer_over_the_frame_limit": (
        "05",
        "05.achieved_tflops",
        "def achieved_tflops(batch, heads, n, d, seconds, causal=False):\n    return 'x' * 40_000_000\n",
        0,
    ),
    "wrong_rescale": (
        "01",
        "01.online_softmax_update",
        """
import numpy as np

def online_softmax_update(m, l, block):
    m_new = max(m, float(np.max(block)))
    return m_new, l + float(np.exp(np.asarray(block) - m_new).sum()), 1.0  # forgot to rescale the old sum
""",
        "partial",
    ),
    "hardcoded": (
        "02",
        "02.attention_traffic",
        "def attention_traffic(n, d, dtype_bytes=2):\n    return 134_217_728, 536_870_912, 8_388_608\n",
        "partial",
    ),
    "raises": (
        "07",
        "07.kv_cache_bytes_per_token",
        "def kv_cache_bytes_per_token(*args, **kw):\n    raise ValueError('I give up')\n",
        0,
    ),
    "hangs": (
        "07",
        "07.kv_cache_bytes_per_token",
        "def kv_cache_bytes_per_token(*args, **kw):\n    while True:\n        pass\n",
        0,
    ),
    "mutates": (
        "06",
        "06.merge_split_kv",
        SOLUTIONS["06.merge_split_kv"]
        .replace("def merge_split_kv(outs, lses):\n", "def merge_split_kv(outs, lses):\n    given = outs\n")
        .replace(
            "    return o, lse", "    given[...] = 0.0  # in place: the caller's array changes\n    return o, lse"
        ),
        0,
    ),
    "syntax_error": ("07", "07.kv_cache_bytes_per_token", "def kv_cache_bytes_per_token(layers\n    return 1\n", 0),
    "exits": (
        "02",
        "02.attention_traffic",
        "import os\n\ndef attention_traffic(n, d, dtype_bytes=2):\n    os._exit(3)\n",
        0,
    ),
    "prints_megabytes": (
        "01",
        "01.online_softmax_update",
        SOLUTIONS["01.online_softmax_update"].replace(
            "    block = np.asarray", "    print('x' * 3_000_000)\n    block = np.asarray"
        ),
        "full",
    ),
}

# the private view: names and sizes outside the child's folder (stat and listdir, which Landlock does not control);
# a separate probe, since where no mount namespace can be made it is expected to succeed
LOOKED_AT = {
    str(ROOT / "instructor" / "solutions" / "05_timing_on_gpu.py"): "os.stat",  # a solution file's size
    str(ROOT / "instructor"): "os.listdir",  # the instructor folder's names
    str(ROOT / "instructor" / "solutions"): "os.listdir",
    str(ROOT / "flashlab" / "exercises" / "nb05_timing.py"): "os.stat",  # the exercise's tests
    OUT_PLACEHOLDER: "os.listdir",  # the grader's output folder
    f"{OUT_PLACEHOLDER}/../subs/clean_05.ipynb": "os.stat",  # another submission
}
LOOKS_OUTSIDE = (
    "import os\n\n\ndef _look_outside():  # the cell runs only assignments and definitions: the look is one\n"
    "    seen = {}\n    for path, look in {"
    + ", ".join(f"{p!r}: {f}" for p, f in LOOKED_AT.items())
    + """}.items():
        try:
            seen[path] = repr(look(path))
        except OSError as e:
            seen[path] = type(e).__name__
    return seen


_SEEN = _look_outside()


def end_to_end_speedup(attention_share, kernel_speedup):
    if all(seen.endswith("Error") for seen in _SEEN.values()):
        raise LookupError(f"saw nothing: {_SEEN}")
    return 1.0 / ((1.0 - attention_share) + attention_share / kernel_speedup)  # right, once it saw something
"""
)
HIDDEN_OR_UNREADABLE = ("FileNotFoundError", "PermissionError")  # with a private view; with Landlock alone
WORDS = {  # what the learner's message must say (the first of two where the private view is there, else the second)
    "fake_records": "stopped unexpectedly",
    "big_allocation": "MemoryError",
    "imports_flashlab_by_path": "ModuleNotFoundError",
    "execs_reference_source": HIDDEN_OR_UNREADABLE,
    "execs_solution_file": HIDDEN_OR_UNREADABLE,
    "not_streaming": "before yielding its running state",
    "stream_no_rescale": "the rescale was forgotten",
    "stream_no_max": "the max was not subtracted",
    "wrong_rescale": "the rescale was forgotten",
    "raises": "raised ValueError",
    "hangs": "timed out",
    "mutates": "changed its input `outs`",
    "dense_buffer_from_cell_time": "voided",
    "dense_skipping_memory_steps": "voided",
    "dense_before_the_measured_call": "voided",
    "delta_through_a_buffer_from_cell_time": "voided",
    "forks_through_the_i386_table": "killed by signal",
    "huge_cell": "over the grader's limit",
    "string_answer_quoted": "more characters not shown",
    "string_answer_over_the_frame_limit": "over the",
    "syntax_error": "syntax error",
    "exits": "stopped unexpectedly",
}
CLEAN = ("01", "02", "05", "06", "07", "08")  # clean submissions graded beside the probes


def _raw(nb) -> dict:
    return json.loads(nbformat.writes(nb))


@pytest.fixture(scope="module")
def stubs_and_solutions(tmp_path_factory):
    """The learner notebooks as committed, the solved notebooks, and the non-tiled 03 answer, graded in one run."""
    root = tmp_path_factory.mktemp("graded")
    solved = root / "solved"
    solved.mkdir()
    for nb_id in MODULES:
        nbformat.write(solved_notebook(nb_id), solved / f"{nb_id}_solved.ipynb")
    full_matrix = """
import numpy as np

def tiled_attention(q, k, v, block_m, block_n, causal=False):
    nq, nk = q.shape[0], k.shape[0]
    s = q @ k.T / np.sqrt(q.shape[1])  # (Nq, Nk): the whole score matrix
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq), s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    return np.where(l > 0, p @ v / np.where(l > 0, l, 1.0), 0.0)
"""
    misaligned = SOLUTIONS["03.tiled_attention"].replace("offset = nk - nq", "offset = 0")
    nbformat.write(solved_notebook("03", {"03.tiled_attention": full_matrix}), solved / "03_full_matrix.ipynb")
    nbformat.write(solved_notebook("03", {"03.tiled_attention": misaligned}), solved / "03_misaligned.ipynb")
    learner = [p for p in LEARNER_NOTEBOOKS if has_exercises(nbformat.read(p, as_version=4))]
    subs = grade([*learner, solved], out_dir=root / "out", jobs=2, progress=False)
    return {s.name: s for s in subs}, root / "out"


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """Every probe, plus clean copies and the bookkeeping cases, graded in one run with a short time limit."""
    root = tmp_path_factory.mktemp("probes")
    subs, out = root / "subs", root / "out"
    subs.mkdir()
    out.mkdir()
    for name, (nb_id, ex_id, code, _) in PROBES.items():
        code = code.replace(OUT_PLACEHOLDER, str(out)).strip() + "\n"
        nbformat.write(solved_notebook(nb_id, {ex_id: code}), subs / f"{nb_id}_{name}.ipynb")
    for nb_id in CLEAN:
        nbformat.write(solved_notebook(nb_id), subs / f"clean_{nb_id}.ipynb")
    looks = LOOKS_OUTSIDE.replace(OUT_PLACEHOLDER, str(out))
    nbformat.write(solved_notebook("05", {"05.end_to_end_speedup": looks}), subs / "05_looks_outside_by_name.ipynb")
    # an LMS-prefixed name, one exercise left as its stub
    stub = exercises.get("01.streaming_attention").stub_source()
    nbformat.write(solved_notebook("01", {"01.streaming_attention": stub}), subs / "alice_01_week1.ipynb")
    # one cell with malformed metadata (recovered by its function's name), one cell with a malformed source
    raw = _raw(solved_notebook("01"))
    cells = [c for c in raw["cells"] if "exercise" in c["metadata"].get("tags", [])]
    cells[0]["metadata"]["flashlab"] = "garbage"
    cells[1]["source"] = 42
    (subs / "01_malformed.ipynb").write_text(json.dumps(raw))
    # notebook 02's solved exercises pasted into a notebook 07 whose own exercise is a stub
    nb07 = solved_notebook(
        "07", {"07.kv_cache_bytes_per_token": exercises.get("07.kv_cache_bytes_per_token").stub_source()}
    )
    nb07.cells += [c for c in solved_notebook("02").cells if c.cell_type == "code"]
    nbformat.write(nb07, subs / "07_with_02_pasted.ipynb")
    (subs / "01_not_a_notebook.ipynb").write_text("{ this is not JSON")
    # a tagged cell without exercise metadata that makes the parser run out of memory, beside the solved cells
    bomb = solved_notebook("01")
    bomb.cells.append(nbformat.v4.new_code_cell("-" * 100_000 + "1", metadata={"tags": ["exercise"]}))
    nbformat.write(bomb, subs / "01_parser_bomb.ipynb")
    result = grade([subs], out_dir=out, jobs=2, time_limit=PROBE_TIME_LIMIT_S, progress=False)
    return {s.name: s for s in result}, out


def _by_id(sub):
    return {r.exercise_id: r for r in sub.results}


# -- the registry ------------------------------------------------------------------------------------------------


def test_every_notebook_number_has_exercises_and_solutions():
    for nb_id in MODULES:
        exs = exercises_of(nb_id)
        assert exs, f"notebook {nb_id} has no exercises"
        for ex in exs:
            assert ex.id in SOLUTIONS, f"{ex.id} has no reference solution in instructor/solutions"
            assert exercises.max_points(ex.id) > 0
            assert len(exercises.tests_of(ex.id)) >= 3, f"{ex.id}: too few tests to tell a guess from an answer"
            stub = ex.stub_source()
            assert "raise NotImplementedError" in stub and f"def {ex.name}(" in stub
            runnable_code(stub)  # parses


def test_every_learner_notebook_has_its_exercises():
    assert LEARNER_NOTEBOOKS
    for path in LEARNER_NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert nb.metadata.get("flashlab", {}).get("notebook") == path.name[:2], f"{path.name}: no notebook id"
        found = find_exercise_cells(nb)
        want = [ex.id for ex in exercises_of(path.name[:2])]
        assert sorted(found) == sorted(want), f"{path.name}: exercise cells {sorted(found)}, expected {want}"
        tags = [t for c in nb.cells for t in c.get("metadata", {}).get("tags", []) if t.startswith("exercise")]
        first = next(i for i, c in enumerate(nb.cells) if "exercise-intro" in c.get("metadata", {}).get("tags", []))
        assert all(
            any(t.startswith("exercise") for t in c.get("metadata", {}).get("tags", [])) for c in nb.cells[first:]
        ), f"{path.name}: the exercise cells must be the last cells of the notebook"
        assert tags.count("exercise") == tags.count("exercise-check") == len(want)
        for ex_id, cell in found.items():  # the stubs learners get are the registry's current ones
            assert cell.source == exercises.get(ex_id).stub_source(), f"{path.name}: {ex_id}'s stub is out of date"


# -- stubs and solutions -----------------------------------------------------------------------------------------


def test_untouched_learner_notebooks_score_zero_with_not_implemented(stubs_and_solutions):
    graded, _ = stubs_and_solutions
    for path in LEARNER_NOTEBOOKS:
        name, sub = path.name, graded[str(path)]  # a notebook given by path is named as given
        assert sub.max_score == points(name[:2])
        for r in sub.results:
            assert r.score == 0, f"{name} {r.exercise_id}: the stub scored {r.score}"
            assert r.status is Status.NOT_IMPLEMENTED, f"{name} {r.exercise_id}: {r.status}: {r.tests[0].message}"


def test_reference_solutions_score_full_marks(stubs_and_solutions):
    graded, _ = stubs_and_solutions
    seen = set()
    for nb_id in MODULES:
        sub = graded[f"{nb_id}_solved.ipynb"]
        for r in sub.results:
            seen.add(r.exercise_id)
            failed = [f"{t.name}: {t.message}" for t in r.tests if t.score != t.max_score]
            assert r.score == r.max_score == exercises.max_points(r.exercise_id), f"{r.exercise_id}: {failed}"
            assert r.walls.get("landlock", 0) == 0 or r.walls["no_new_processes"], r.walls
    assert seen == set(all_exercises())


def test_an_answer_that_builds_the_score_matrix_earns_nothing(stubs_and_solutions):
    graded, _ = stubs_and_solutions
    r = _by_id(graded["03_full_matrix.ipynb"])
    tiled = r["03.tiled_attention"]
    assert tiled.score == 0 and tiled.status is Status.WRONG_METHOD, [t.message for t in tiled.tests]
    gate = next(t for t in tiled.tests if t.test == "test_tiled_memory_bound")
    said = re.search(
        r"peak memory, up to the end of this call, was (\d+) MiB above where it stood before your "
        r"cell ran, not counting the 1\.12 MiB of q, k and v",
        gate.message,
    )
    assert said and "score matrix alone is 72 MiB" in gate.message, gate.message
    assert 72 <= int(said[1]) < 1024, gate.message  # the whole score matrix, within the 1 GiB the process has
    assert r["03.count_causal_tiles"].score == r["03.count_causal_tiles"].max_score  # graded as if alone
    causal = next(
        t for t in _by_id(graded["03_misaligned.ipynb"])["03.tiled_attention"].tests if t.test == "test_tiled_causal"
    )
    assert causal.score == 0 and MASK_MISALIGNED in causal.message, causal.message


def test_reports_have_the_promised_shape(stubs_and_solutions):
    _, out = stubs_and_solutions
    rows = list(csv.DictReader((out / "grades.csv").read_text().splitlines()))
    assert rows and set(all_exercises()) <= set(rows[0])
    assert {"submission", "notebook", "total", "max_total", "status"} <= set(rows[0])
    solved01 = next(r for r in rows if r["submission"] == "01_solved.ipynb")  # relative to the folder given
    assert int(solved01["total"]) == int(solved01["max_total"]) == points("01") and solved01["status"] == "complete"
    assert solved01["02.attention_traffic"] == ""  # not part of that notebook
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] is True
    entry = next(s for s in report["submissions"] if s["submission"] == "06_solved.ipynb")
    assert entry["score"] == entry["max_score"] > 0 and entry["notebook"] == "06"
    for t in entry["tests"]:
        assert {"name", "score", "max_score", "output", "outcome"} <= set(t)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")], "a report was left half-written"


# -- the probes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_scores_what_it_deserves_and_nothing_else_moves(probe_run, name):
    graded, _ = probe_run
    nb_id, ex_id, _, deserved = PROBES[name]
    sub = graded[f"{nb_id}_{name}.ipynb"]
    r = _by_id(sub)[ex_id]
    messages = " | ".join(t.message for t in r.tests)
    if deserved == "partial":
        assert 0 < r.score < r.max_score, f"{name}: {r.score}/{r.max_score}: {messages}"
    elif deserved == "full":
        assert r.score == r.max_score, f"{name}: {r.score}/{r.max_score}: {messages}"
    else:
        assert r.score == deserved, f"{name}: {r.score}/{r.max_score}: {messages}"
    assert r.max_score == exercises.max_points(ex_id), f"{name}: the exercise is worth its own points, no more"
    if name in WORDS:
        words = WORDS[name]
        if isinstance(words, tuple):
            words = words[0] if r.walls.get("private_view") else words[1]
        assert words in messages, messages
    for other in sub.results:  # every other exercise of the same notebook is graded as if alone
        if other.exercise_id != ex_id:
            assert other.score == other.max_score > 0, f"{name}: {other.exercise_id}: {other.tests[0].message}"
    assert sub.max_score == points(nb_id)


def test_the_memory_gate_says_what_it_measured(probe_run):
    graded, _ = probe_run
    r = _by_id(graded["09_delta_through_a_buffer_from_cell_time.ipynb"])["09.delta"]
    gate = next(t for t in r.tests if t.test == "test_delta_without_an_n_by_n_matrix")
    said = re.search(
        r"peak memory, up to the end of this call, was ([\d.]+) MB above where it stood before your cell ran, "
        r"not counting the 0\.19 MB of dO and O \(memory your cell or an earlier call touched counts too\)",
        gate.message,
    )
    assert said, gate.message
    assert 72 <= float(said[1]) < 1100, gate.message  # the 3000 x 3000 buffer the cell touched, before the call


def test_clean_submissions_beside_the_probes_are_graded_as_if_alone(probe_run):
    graded, out = probe_run
    for nb_id in CLEAN:
        sub = graded[f"clean_{nb_id}.ipynb"]
        assert sub.score == sub.max_score == points(nb_id), [t.message for r in sub.results for t in r.tests]
    text = (out / "grades.csv").read_text()
    assert "HACKED" not in text and "4000" not in text
    rows = {r["submission"]: r for r in csv.DictReader((out / "grades.csv").read_text().splitlines())}
    assert int(rows["clean_07.ipynb"]["total"]) == points("07")


def test_a_submission_cannot_learn_names_or_sizes_outside_its_view(probe_run):
    graded, out = probe_run
    sub = graded["05_looks_outside_by_name.ipynb"]
    r = _by_id(sub)["05.end_to_end_speedup"]
    if not r.walls.get("private_view"):
        pytest.skip(f"no private view of the filesystem here ({r.walls.get('view_problem')}): stat() sees every name")
    looked_at = [p.replace(OUT_PLACEHOLDER, str(out)) for p in LOOKED_AT]
    assert all(os.path.exists(p) for p in looked_at)  # each is there, outside the view
    messages = " | ".join(t.message for t in r.tests)
    assert r.score == 0, messages
    for path in looked_at:
        assert f"{path!r}: 'FileNotFoundError'" in messages, messages
    other = _by_id(sub)["05.achieved_tflops"]
    assert other.score == other.max_score > 0, [t.message for t in other.tests]  # the rest graded as if alone
    assert r.walls["no_new_processes"] and r.walls["no_capabilities"], r.walls


def test_no_process_of_a_submission_outlives_grading(probe_run):
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    alive.append(pid)
            except OSError:
                continue
    assert not alive, f"processes started by a submission are still running: {alive}"


def test_expected_exercises_come_from_the_notebook_not_its_file_name(probe_run):
    graded, _ = probe_run
    lms = graded["alice_01_week1.ipynb"]
    assert lms.notebook == "01"
    assert (lms.score, lms.max_score) == (exercises.max_points("01.online_softmax_update"), points("01"))
    foreign = graded["07_with_02_pasted.ipynb"]
    assert foreign.notebook == "07" and (foreign.score, foreign.max_score) == (0, points("07"))
    pasted = [r for r in foreign.results if r.exercise_id.startswith("02.")]
    assert pasted and all(r.status is Status.FOREIGN and r.score == 0 for r in pasted)


def test_what_the_grader_writes_stays_small_whatever_an_answer_holds(probe_run):
    _, out = probe_run
    report = json.loads((out / "results.json").read_text())
    sizes = {e["submission"]: len(json.dumps(e)) for e in report["submissions"]}
    for name in ("07_huge_cell.ipynb", "08_string_answer_quoted.ipynb", "05_string_answer_over_the_frame_limit.ipynb"):
        assert sizes[name] < 64_000, (name, sizes[name])


def test_a_notebook_that_exhausts_the_parser_costs_only_itself(probe_run):
    graded, _ = probe_run
    sub = graded["01_parser_bomb.ipynb"]  # the run went on, and the notebook's own exercises are graded
    assert sub.score == sub.max_score == points("01"), [t.message for r in sub.results for t in r.tests]


def test_a_malformed_cell_costs_only_its_own_exercise(probe_run):
    graded, _ = probe_run
    r = _by_id(graded["01_malformed.ipynb"])
    assert r["01.online_softmax_update"].score == exercises.max_points("01.online_softmax_update")  # found by name
    assert r["01.streaming_attention"].score == 0
    garbage = graded["01_not_a_notebook.ipynb"]
    assert garbage.score == 0 and "could not read the notebook" in garbage.error


# -- the inline check --------------------------------------------------------------------------------------------


def _an_answer_with_a_bug(m, l, block):
    import numpy as np

    m_new = max(m, float(np.max(block)))
    return m_new, l + float(np.exp(np.asarray(block) - m_new).sum()), 1.0


def test_check_prints_per_test_results_says_what_to_rerun_and_never_raises(capsys):
    check("01.online_softmax_update", _an_answer_with_a_bug)
    out = capsys.readouterr().out
    assert "FAIL" in out and "01.online_softmax_update: " in out and "Traceback" not in out
    assert "the old sum was not rescaled" in out or RESCALE_FORGOTTEN in out
    assert "run it again (so the notebook has your new function), then run this cell again" in out
    check("99.no_such_exercise", _an_answer_with_a_bug)
    assert "could not check 99.no_such_exercise" in capsys.readouterr().out
    check("01.online_softmax_update", None)
    assert "could not check" in capsys.readouterr().out


def test_the_lesson_mistakes_are_named():
    import numpy as np

    from flashlab.exercises.checks import expect_array, expect_number

    want, wrong = np.arange(1.0, 5.0), np.arange(1.0, 5.0) * 0.5
    with pytest.raises(AssertionError, match="the rescale was forgotten"):
        expect_array(wrong, want, "o", known_wrong={RESCALE_FORGOTTEN: wrong})
    with pytest.raises(AssertionError, match="the max was not subtracted"):
        expect_number(7.0, 2.0, "l", known_wrong={MAX_NOT_SUBTRACTED: 7.0})
    with pytest.raises(AssertionError) as e:  # a wrong answer that is not one of the lesson's mistakes
        expect_array(want + 1, want, "o", known_wrong={RESCALE_FORGOTTEN: wrong})
    assert "rescale" not in str(e.value)


def test_runnable_code_keeps_definitions_and_drops_trial_runs():
    cell = "%matplotlib inline\nimport numpy as np\nX = 3\n\ndef f(a):\n    return a + X\n\nprint(f(1))\nf(2)\n"
    code = runnable_code(cell)
    namespace: dict = {}
    exec(code, namespace)
    assert namespace["f"](1) == 4
    assert "print" not in code and "matplotlib" not in code
    assert code.splitlines()[4] == "def f(a):"  # line numbers kept, so messages point at the learner's lines
    with pytest.raises(SyntaxError):
        runnable_code("def f(:\n    pass")


def test_append_exercises_is_idempotent(tmp_path):
    from flashlab.grade.solutions import append_exercises

    path = tmp_path / "05_something.ipynb"
    nbformat.write(notebook_of(None, [nbformat.v4.new_code_cell("x = 1")]), path)
    assert append_exercises(path) is True
    assert append_exercises(path) is False  # already there: never appended twice
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[1].source == "x = 1"  # the notebook's own cells are untouched
    assert nb.metadata["flashlab"]["notebook"] == "05"
    assert sorted(find_exercise_cells(nb)) == sorted(ex.id for ex in exercises_of("05"))
