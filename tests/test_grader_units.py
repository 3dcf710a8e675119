"""The grader's parts on their own: the wire format runs no code and makes only plain values, the sandbox holds,
the cell reader survives malformed notebooks, and the streaming test's ground truth is the reference's."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from conftest import ROOT
from flashlab.exercises.nb01_online_softmax import fold
from flashlab.grade import sandbox, wire
from flashlab.grade.cells import find_exercise_cells, notebook_id
from flashlab.reference import softmax

# -- the wire format ---------------------------------------------------------------------------------------------


def _roundtrip(x):
    return wire.decode(wire.encode(wire.to_plain(x)))


def _frame(header: bytes, arrays: bytes = b"") -> bytes:
    return struct.pack(wire.PREFIX, len(header), len(arrays)) + header + arrays


def test_plain_values_cross_unchanged():
    value = (1, -(2**80), 2.5, math.inf, None, True, "é", [1, (2, 3)], {"a": np.arange(6.0).reshape(2, 3)})
    got = _roundtrip(value)
    assert got[:7] == value[:7] and got[7] == [1, (2, 3)] and math.isnan(_roundtrip(math.nan))
    assert np.array_equal(got[8]["a"], value[8]["a"]) and got[8]["a"].dtype == np.float64
    assert _roundtrip(np.float32(1.5)) == 1.5 and type(_roundtrip(np.int64(3))) is int
    assert _roundtrip(np.array([1, 2], dtype=">i4")).tolist() == [1, 2]  # byte order normalised
    both = _roundtrip([np.float16([1.5, -2.0]), np.zeros((0, 3)), np.arange(5, dtype=np.uint8)[::2]])
    assert both[0].dtype == np.float16 and both[0].tolist() == [1.5, -2.0] and both[1].shape == (0, 3)
    assert both[2].tolist() == [0, 2, 4]


def test_what_an_answer_returns_becomes_exact_builtin_types():
    class Sneaky(float):
        def __eq__(self, other):
            return True

    got = _roundtrip(Sneaky(2.0))
    assert type(got) is float and got == 2.0 and got != 3.0
    with pytest.raises(wire.WireError):
        wire.to_plain(object())
    with pytest.raises(wire.WireError):
        wire.to_plain(np.array([object()]))


@pytest.mark.parametrize(
    "frame",
    [
        _frame(b'{"$pickle": "gASV"}'),
        _frame(b'{"$array": {"dtype": "|O", "shape": [1]}}', b"\0" * 8),
        _frame(b'{"$array": {"dtype": "<f8", "shape": [2]}}', b"\0" * 8),  # fewer bytes than the array needs
        _frame(b'{"$array": {"dtype": "<f8", "shape": [1]}}', b"\0" * 16),  # bytes that belong to no array
        _frame(b'{"$array": {"dtype": "<f8", "shape": [1], "data": "AAAAAAAAAAA="}}', b"\0" * 8),
        _frame(b'{"$array": {"dtype": "<f8", "shape": [1000000000000]}}'),
        _frame(b'{"a": 1}'),
        _frame(b"[1, 2]"),
        _frame(b"not json"),
        _frame(b"[" * 100_000),
        _frame(b"{}")[:-1],
        b"short",
    ],
)
def test_anything_else_is_refused_not_run(frame):
    with pytest.raises(wire.WireError):
        wire.decode(frame)


@pytest.mark.parametrize("lengths", [(10**9, 0), (0, 10**9)])
def test_an_oversized_frame_is_refused_unread(lengths):
    import os

    r, w = os.pipe()
    os.write(w, struct.pack(wire.PREFIX, *lengths))
    with pytest.raises(wire.WireError, match="over the"):
        wire.receive(r, max_bytes=1000, max_header=1000)
    os.close(r)
    os.close(w)


def test_an_array_is_received_into_its_own_memory_only():
    """The receiving process holds the array and the header, not a text copy of the array's bytes."""
    script = textwrap.dedent(
        f"""
        import os, sys, threading
        import numpy as np
        sys.path.insert(0, {str(ROOT)!r})
        from flashlab.grade import wire
        frame = wire.encode(wire.to_plain(np.ones((4096, 1024))))  # 32 MiB
        r, w = os.pipe()
        threading.Thread(target=lambda: os.write(w, frame), daemon=True).start()
        del frame
        def kib(field):
            return int(next(x for x in open("/proc/self/status") if x.startswith(field)).split()[1])
        open("/proc/self/clear_refs", "w").write("5")
        before = kib("VmRSS")
        got = wire.receive(r)
        print((kib("VmHWM") - before) / 1024, got.shape)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rise_mib = float(out.stdout.split()[0])
    assert 30 < rise_mib < 40, out.stdout  # the array itself, 32 MiB, and little else


# -- the sandbox -------------------------------------------------------------------------------------------------


@pytest.mark.skipif(sandbox.landlock_abi() == 0, reason="this kernel has no Landlock")
def test_the_sandbox_holds(tmp_path):
    solution = ROOT / "instructor" / "solutions" / "01_online_softmax_by_hand.py"
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys
        sys.path.insert(0, {str(ROOT)!r})
        from flashlab.grade import sandbox
        walls = sandbox.restrict_filesystem([sys.base_prefix, {str(ROOT / "flashlab")!r}], [{str(tmp_path)!r}])
        assert sandbox.forbid_new_processes()
        open({str(tmp_path / "ok")!r}, "w").write("mine")
        for what, attempt in [
            ("read solutions", lambda: open({str(solution)!r}).read()),
            ("write outside", lambda: open({str(ROOT / "stray.txt")!r}, "w")),
            ("fork", os.fork),
            ("exec", lambda: subprocess.run(["/bin/true"])),
            ("signal the parent", lambda: os.kill(os.getppid(), 0)),
        ]:
            try:
                attempt()
            except OSError:
                continue
            print("NOT BLOCKED:", what)
        print("done", walls)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "NOT BLOCKED" not in out.stdout and "done" in out.stdout, out.stdout
    assert (tmp_path / "ok").read_text() == "mine" and not (ROOT / "stray.txt").exists()


_WALLED = (
    f"import ctypes, os, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom flashlab.grade import sandbox\n"
    "assert sandbox.forbid_new_processes()\nlibc = ctypes.CDLL(None, use_errno=True)\n"
)
_I386 = """
import ctypes, mmap

def i386(nr):  # one system call through the i386 table: mov eax, nr; int 0x80; ret
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(b"\\xb8" + nr.to_bytes(4, "little") + b"\\xcd\\x80\\xc3")
    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
"""


def _python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 and x32 system-call tables are x86-64's")
def test_seccomp_kills_a_call_through_another_table():
    plain = _python(_I386 + "import os\nprint(i386(20) == os.getpid())")  # getpid, no filter
    if plain.returncode != 0 or "True" not in plain.stdout:
        pytest.skip("this kernel runs no i386 system calls (no IA32 emulation), so there is no other table to try")
    fork = _python(_WALLED + _I386 + "r = i386(2)\nif r == 0:\n    os._exit(0)\nprint('forked', r)")  # i386 fork
    assert fork.returncode == -signal.SIGSYS, (fork.returncode, fork.stdout, fork.stderr[-500:])
    x32 = _python(_WALLED + "print('x32 fork:', libc.syscall(0x40000000 | 57))")
    assert x32.returncode == -signal.SIGSYS, (x32.returncode, x32.stdout, x32.stderr[-500:])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="the seccomp filter is installed on Linux x86-64 and arm64 only",
)
def test_seccomp_denies_namespaces_and_other_processes_memory():
    script = _WALLED + textwrap.dedent(
        """
        import threading
        t = threading.Thread(target=print, args=("thread ok",))
        t.start(); t.join()
        buf = ctypes.create_string_buffer(8)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
        for what, call in [
            ("unshare", lambda: libc.unshare(0x04000000)),  # CLONE_NEWUTS
            ("setns", lambda: libc.setns(os.open("/proc/self/ns/uts", os.O_RDONLY), 0)),
            ("ptrace", lambda: libc.ptrace(16, os.getppid(), None, None)),  # PTRACE_ATTACH
            ("process_vm_readv", lambda: libc.process_vm_readv(os.getppid(), iov, 1, iov, 1, 0)),
        ]:
            r = call()
            print(what, r, ctypes.get_errno())
        # each with arguments the kernel itself would refuse (ENOENT, EBADF, EINVAL...): only the filter says EPERM
        nr = NUMBERS[platform.machine()]
        for what, args in [
            ("mount", (b"none", b"/no/such/place", b"tmpfs", 0, None)),
            ("umount2", (b"/no/such/place", 0)),
            ("pivot_root", (b"/no/such/place", b"/no/such/place")),
            ("chroot", (b"/no/such/place",)),
            ("open_tree", (-1, b"/no/such/place", 0)),
            ("move_mount", (-1, b"", -1, b"", 0)),
            ("fsopen", (b"no-such-filesystem", 0)),
            ("fsmount", (-1, 0, 0)),
            ("fspick", (-1, b"/no/such/place", 0)),
            ("mount_setattr", (-1, b"/no/such/place", 0, None, 0)),
            ("open_by_handle_at", (-1, None, 0)),
            ("name_to_handle_at", (-1, b"/no/such/place", None, None, 0)),
            ("clone thread into a new mount namespace", (0x00010000 | 0x00020000, 0, 0, 0, 0)),
        ]:
            r = libc.syscall(nr[what], *args)
            print(what, r, ctypes.get_errno())
        """
    )
    numbers = {
        "x86_64": {"mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "name_to_handle_at": 303},
        "aarch64": {"mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "name_to_handle_at": 264},
    }
    for arch, table in numbers.items():
        table["open_by_handle_at"] = table["name_to_handle_at"] + 1
        table["clone thread into a new mount namespace"] = {"x86_64": 56, "aarch64": 220}[arch]
        table.update(open_tree=428, move_mount=429, fsopen=430, fsmount=432, fspick=433, mount_setattr=442)
    out = _python(f"import platform\nNUMBERS = {numbers!r}\n" + script)
    assert out.returncode == 0, out.stderr[-1000:]
    assert "thread ok" in out.stdout
    for what in ("unshare", "setns", "ptrace", "process_vm_readv", *numbers["x86_64"]):
        assert f"{what} -1 1\n" in out.stdout, out.stdout  # EPERM


def test_the_view_plan_binds_what_may_be_read_and_keeps_the_links_on_the_way(tmp_path):
    (tmp_path / "lib" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "alias").symlink_to("lib")
    (tmp_path / "work").mkdir()
    root = str(tmp_path / "elsewhere" / "root")
    plan = sandbox.view_plan(
        [str(tmp_path / "alias"), str(tmp_path / "lib" / "pkg")], [str(tmp_path / "work")], [], [], root
    )
    real = str(tmp_path.resolve())
    assert plan["binds"] == [[f"{real}/lib", "ro"], [f"{real}/work", "rw"]]  # pkg comes with lib
    assert [f"{real}/alias", "lib"] in plan["links"] and f"{real}/lib/pkg" not in plan["dirs"]
    with pytest.raises(ValueError, match="writable"):  # a writable folder inside a read-only one
        sandbox.view_plan([str(tmp_path / "lib")], [str(tmp_path / "lib" / "pkg")], [], [], root)
    with pytest.raises(ValueError, match="root"):  # the view's root inside what it holds
        sandbox.view_plan([str(tmp_path)], [], [], [], root)


_VIEW = """
import json, os, sys
sys.path.insert(0, {grade!r})
import sandbox  # alone, as the child has it: no flashlab, no NumPy (whose threads forbid a user namespace)
readable = [{lib!r}, "/proc/self", sys.base_prefix, *{stdlib!r}]
plan = sandbox.view_plan(readable, [{work!r}], [], [{alias!r}], {view!r})
view = sandbox.enter_private_view({view!r}, plan, user_namespace={user!r})
seen = {{"view": view, "caps": sandbox.drop_capabilities()}}
for path, look in [] if not view["private_view"] else [
    ({solution!r}, os.stat), ({instructor!r}, os.listdir), ({secret!r}, os.stat), ({base!r}, os.listdir),
    ({alias!r} + "/m.py", lambda p: open(p).read()), ({lib!r} + "/new", lambda p: open(p, "w")),
    ({work!r} + "/out.txt", lambda p: open(p, "w").write("mine")), ("/made-here", os.mkdir),
    ("/proc/self/status", lambda p: open(p).read()[:5]),
]:
    try:
        seen[path] = look(path)
    except OSError as e:
        seen[path] = type(e).__name__
print(json.dumps(seen, default=repr))
"""


@pytest.mark.parametrize("user", [None, True], ids=["as-is", "user-namespace"])
def test_the_private_view_holds_only_what_the_child_may_read(tmp_path, user):
    """stat and listdir, which Landlock does not control, find nothing outside the view; nothing leaks out."""
    from flashlab.grade.worker import stdlib_dirs

    base = tmp_path / "base"
    lib, work, secret, view = base / "lib", base / "work", base / "secret.txt", tmp_path / "view"
    for d in (lib, work, view):
        d.mkdir(parents=True)
    (lib / "m.py").write_text("x = 1\n")
    secret.write_text("the answer")
    (base / "alias").symlink_to("lib")
    solution = ROOT / "instructor" / "solutions" / "01_online_softmax_by_hand.py"
    paths = dict(lib=str(lib), work=str(work), secret=str(secret), view=str(view), alias=str(base / "alias"))
    paths.update(solution=str(solution), instructor=str(ROOT / "instructor"), base=str(base))
    script = _VIEW.format(grade=str(ROOT / "flashlab" / "grade"), stdlib=stdlib_dirs(), user=user, **paths)
    out = _python(script)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout)
    if not seen["view"]["private_view"]:
        pytest.skip(f"no private view can be made here: {seen['view']['view_problem']}")
    assert solution.exists() and secret.exists()  # there, but not in the view
    for gone in (paths["solution"], paths["instructor"], paths["secret"]):
        assert seen[gone] == "FileNotFoundError", seen
    assert sorted(seen[paths["base"]]) == ["alias", "lib", "work"], seen  # only what leads somewhere readable
    assert seen[paths["alias"] + "/m.py"] == "x = 1\n" and seen[paths["lib"] + "/new"] == "OSError", seen
    assert seen["/made-here"] == "OSError" and seen["/proc/self/status"] == "Name:", seen
    assert (work / "out.txt").read_text() == "mine" and not (lib / "new").exists()  # the work folder is the real one
    assert os.listdir(view) == [] and not os.path.exists("/made-here")  # nothing was made outside the view
    assert seen["caps"] is True
    want = "user and mount namespace" if user or os.geteuid() != 0 else "mount namespace"
    assert seen["view"]["private_view"] == want


def test_where_no_view_can_be_made_the_child_is_graded_and_says_why(monkeypatch):
    import time

    from flashlab import exercises
    from flashlab.grade import worker

    monkeypatch.setattr(worker, "private_view", lambda *a: {"problem": "no private view of the filesystem: planted"})
    solutions = str(ROOT / "instructor" / "solutions")
    code = f"import os\n\ndef kv_cache_bytes_per_token(*args, **kwargs):\n    return os.path.exists({solutions!r})\n"
    ex = exercises.get("07.kv_cache_bytes_per_token")
    s = worker.Worker(ex, code, code, ex.name, time.monotonic() + 30)
    try:
        assert s.start().get("ready") is True
        assert worker.Answer(s)(1, 2, 3) is True  # stat() sees the grader's filesystem: the gap the view closes
    finally:
        s.kill()
    assert s.walls["private_view"] is False and s.walls["view_problem"].endswith("planted"), s.walls


def test_the_learners_process_runs_under_its_limits_in_a_session_of_its_own():
    import time

    from flashlab import exercises
    from flashlab.grade.worker import Answer, Worker

    code = (
        "import os, resource as r\n\ndef kv_cache_bytes_per_token(*args, **kwargs):\n"
        "    limits = [r.getrlimit(x)[0] for x in (r.RLIMIT_AS, r.RLIMIT_NOFILE, r.RLIMIT_FSIZE, r.RLIMIT_CPU)]\n"
        "    try:\n        r.setrlimit(r.RLIMIT_AS, (r.RLIM_INFINITY, r.RLIM_INFINITY))\n        raised = True\n"
        "    except (ValueError, OSError):\n        raised = False\n"
        "    return limits + [os.getsid(0) == os.getpid(), os.getcwd(), sorted(os.environ), raised]\n"
    )
    ex = exercises.get("07.kv_cache_bytes_per_token")
    s = Worker(ex, code, code, ex.name, time.monotonic() + 30, memory_mib=700)
    try:
        assert s.start().get("ready") is True
        got = Answer(s)(1, 2, 3)
    finally:
        s.kill()
    address, files, size, cpu, own_session, cwd, env, raised = got
    assert (address, files, size) == (700 * 2**20, 256, 16 * 2**20) and 0 < cpu <= 33
    if s.walls.get("no_capabilities"):  # root's too: no raising a hard limit
        assert not raised
    assert own_session and cwd.startswith(tempfile.gettempdir()) and "flashlab-answer-" in cwd
    assert not {"PYTHONPATH", "VIRTUAL_ENV", "PWD"} & set(env), env


# -- the cell reader ---------------------------------------------------------------------------------------------


def _cell(source, metadata):
    return {"cell_type": "code", "source": source, "metadata": metadata}


def test_which_notebook_comes_from_the_notebook_itself():
    tagged = {"tags": ["exercise"], "flashlab": {"exercise": "02.attention_traffic"}}
    nb = {"metadata": {"flashlab": {"notebook": "07"}}, "cells": [_cell("", tagged)]}
    assert notebook_id(nb, "alice_01_x.ipynb") == "07"  # metadata first
    nb["metadata"] = {}
    assert notebook_id(nb, "alice_01_x.ipynb") == "02"  # then what its exercise cells name
    assert notebook_id({"cells": []}, "05_x.ipynb") == "05"  # the file name only when nothing else says
    assert notebook_id({"cells": []}, "alice.ipynb") is None


@pytest.mark.parametrize(
    "metadata",
    [
        "garbage",
        {"tags": "exercise"},
        {"tags": ["exercise"], "flashlab": "garbage"},
        {"tags": ["exercise"], "flashlab": {"exercise": 5}},
    ],
)
def test_malformed_metadata_costs_nothing_but_that_cell(metadata):
    good = _cell("def kv_cache_bytes_per_token(layers, kv_heads, head_dim):\n    pass\n", {"tags": ["exercise"]})
    odd = _cell("def attention_traffic(n, d, dtype_bytes=2):\n    pass\n", metadata)
    bad_source = _cell(42, {"tags": ["exercise"], "flashlab": {"exercise": "02.roofline_bound"}})
    found = find_exercise_cells({"cells": [good, odd, bad_source, "not a cell"]})
    assert "07.kv_cache_bytes_per_token" in found and found["02.roofline_bound"].source == ""
    tagged = isinstance(metadata, dict) and isinstance(metadata.get("tags"), list)
    assert ("02.attention_traffic" in found) == tagged  # found by its function's name when still tagged


# -- the streaming test's ground truth ---------------------------------------------------------------------------


def test_fold_is_the_online_softmax_of_the_reference():
    rng = np.random.default_rng(1)
    s, v = rng.normal(0, 3, 23), rng.normal(0, 1, (23, 4))
    blocks = [(s[i : i + 5], v[i : i + 5]) for i in range(0, 23, 5)]
    m, l, acc = fold(blocks)[-1]
    assert m == s.max() and math.isclose(l, np.exp(s - s.max()).sum(), rel_tol=1e-12)
    np.testing.assert_allclose(acc / l, softmax(s) @ v, rtol=1e-12)
    wrong = fold(blocks, rescale=False)[-1]
    assert not math.isclose(wrong[1], l, rel_tol=1e-6)  # the mistake changes the answer the test compares with
