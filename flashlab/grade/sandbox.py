"""The walls around a submission's process: resource limits, and (on Linux) what it may read and start.

- ``set_limits(limits)`` -- the first thing the child's interpreter does, before it imports anything else or reads
  the learner's code: address space, CPU seconds, tasks, file size and open files, through ``resource.setrlimit``.
- ``view_plan(readable, writable, listable, wanted, root)`` and ``enter_private_view(root, plan)`` -- a mount
  namespace of the child's own (Linux; a user namespace too where the process is not root), whose root is an empty
  tmpfs holding only what the child may read (bound read-only), its working folder (bound read-write) and the
  folders and links on the way to them: everything else -- the checkout, the instructor solutions, the exercise
  tests, the grader's output, other submissions -- is not there at all, so even ``stat()`` and ``listdir()``, which
  Landlock does not control, find nothing. The plan is made by the grader and carried out by the child, first thing
  after it starts (a user namespace needs a single-threaded process).
- ``restrict_filesystem(readable, writable, listable)`` -- Landlock (Linux 5.13+): from then on the process can read
  only beneath ``readable``, write only beneath ``writable`` and list the names beneath ``listable``; with a recent
  enough kernel it can also open no TCP connection and send no signal to a process outside its own sandbox.
- ``drop_capabilities()`` -- no capabilities left (root's included): no raising a hard limit, no bypassing file
  permissions, no opening a file by its handle.
- ``forbid_new_processes()`` -- a seccomp filter (x86-64 and arm64): no fork, no exec, no new namespaces, no
  mounting or unmounting, no opening files by handle, no reading another process's memory, and only the native
  system-call table; threads stay allowed.

The child enters its private view before its trusted start-up imports, and applies the rest to itself after them,
before the submission's code runs. Each returns what it managed, so the grader can say what held. This module
imports only the standard library.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
from dataclasses import dataclass

# -- resource limits ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one submission's process may use."""

    memory_bytes: int  # address space (RLIMIT_AS)
    cpu_seconds: int  # CPU time (RLIMIT_CPU); the wall-clock limit is the grader's timer
    tasks: int  # processes and threads of this user (RLIMIT_NPROC; not enforced for root)
    file_bytes: int = 16 * 2**20  # largest file it may write (RLIMIT_FSIZE)
    open_files: int = 256  # RLIMIT_NOFILE


def set_limits(limits: Limits) -> None:
    """Apply ``limits`` to the calling process (the child, before any learner code exists in it)."""
    for which, value in (
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_CPU, limits.cpu_seconds),
        (resource.RLIMIT_NPROC, limits.tasks),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
    ):
        resource.setrlimit(which, (value, value))


def tasks_of_user(uid: int | None = None) -> int:
    """How many tasks (processes and threads) the user runs now: RLIMIT_NPROC counts them all."""
    uid = os.getuid() if uid is None else uid
    n = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return n


# -- Landlock -----------------------------------------------------------------------------------------------------

_SYS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}  # create_ruleset, add_rule, restrict_self
_PR_SET_NO_NEW_PRIVS = 38
_FS_BITS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}  # how many access-right bits each ABI knows
_READ_DIR = 1 << 3
_READ = (1 << 0) | (1 << 2) | _READ_DIR  # execute, read file, read dir
_WRITE_EXTRA = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 7) | (1 << 8) | (1 << 10) | (1 << 12)  # write/remove/make
_TRUNCATE = 1 << 14
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | _TRUNCATE  # rights that apply to a file (not a directory)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none."""
    nums = _SYS.get(platform.machine())
    if nums is None or platform.system() != "Linux":
        return 0
    r = _libc().syscall(nums[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(r), 0)


def restrict_filesystem(readable, writable, listable=()) -> dict:
    """Landlock the calling process: read beneath ``readable``, read and write beneath ``writable``, and list (read
    the names in, not the files of) the folders beneath ``listable``.

    Returns ``{"landlock": abi, "network": bool, "signals": bool}``; ``landlock`` is 0 where the kernel has none
    (then nothing was restricted).
    """
    abi = landlock_abi()
    if abi == 0:
        return {"landlock": 0, "network": False, "signals": False}
    libc = _libc()
    create, add_rule, restrict = _SYS[platform.machine()]
    handled = (1 << _FS_BITS_BY_ABI.get(abi, 16)) - 1
    attr = _RulesetAttr(handled, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)  # TCP bind+connect; unix+signal
    fd = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        read, write = _READ & handled, (_READ | _WRITE_EXTRA | _TRUNCATE) & handled
        for paths, rights in ((listable, _READ_DIR), (readable, read), (writable, write)):
            for path in paths:
                try:
                    pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # not there: nothing to allow
                try:
                    allowed = rights if os.path.isdir(path) else rights & _FILE_RIGHTS
                    if not allowed:
                        continue
                    rule = _PathBeneath(allowed, pfd)
                    if libc.syscall(
                        add_rule, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)
                    ):
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
                finally:
                    os.close(pfd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(restrict, ctypes.c_int(fd), ctypes.c_uint32(0)):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    return {"landlock": abi, "network": abi >= 4, "signals": abi >= 6}


# -- seccomp: no new processes, no other system-call table --------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86-64's x32 system calls carry this bit in their number
# calls that start a process, replace the program, enter new namespaces or read another process's memory; clone is
# checked for CLONE_THREAD instead (a thread is allowed)
_DENY = {
    # fork, vfork, execve, execveat, unshare, setns, ptrace, process_vm_readv, process_vm_writev
    "x86_64": (57, 58, 59, 322, 272, 308, 101, 310, 311),
    # execve, execveat, unshare, setns, ptrace, process_vm_readv, process_vm_writev
    "aarch64": (221, 281, 97, 268, 117, 270, 271),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_CLONE_THREAD = 0x00010000
_RET_ALLOW, _RET_EPERM, _RET_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
_RET_KILL_PROCESS = 0x80000000


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _filter(arch: str) -> list[tuple[int, int, int, int]]:
    """The BPF program: (code, jump-if-true, jump-if-false, k) per instruction; jumps are relative offsets.

    A call made through another architecture's table (x86-64's i386 ``int 0x80``, arm64's 32-bit mode) kills the
    process, as does any x32 call: the numbers checked below mean something else there.
    """
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    body = [("ld", 4), ("jeq", _AUDIT_ARCH[arch], "next", "kill"), ("ld", 0)]
    if arch == "x86_64":
        body.append(("jge", _X32_BIT, "kill", "next"))
    body += [("jeq", nr, "eperm", "next") for nr in _DENY[arch]]
    body.append(("jeq", _CLONE3, "enosys", "next"))  # glibc then falls back to clone, whose flags are seen
    body.append(("jeq", _CLONE[arch], "next", "allow"))
    body.append(("ld", 16))  # clone's flags (args[0], low word)
    body.append(("jset", _CLONE_THREAD, "allow", "eperm"))
    returns = {"allow": _RET_ALLOW, "enosys": _RET_ENOSYS, "eperm": _RET_EPERM, "kill": _RET_KILL_PROCESS}
    at = {label: len(body) + i for i, label in enumerate(returns)}
    prog = []
    for i, ins in enumerate(body):
        if ins[0] == "ld":
            prog.append((ld, 0, 0, ins[1]))
            continue
        code = {"jeq": jeq, "jge": jge, "jset": jset}[ins[0]]
        jt, jf = (0 if t == "next" else at[t] - i - 1 for t in ins[2:])
        prog.append((code, jt, jf, ins[1]))
    prog += [(ret, 0, 0, k) for k in returns.values()]
    return prog


def forbid_new_processes() -> bool:
    """Install a seccomp filter: fork, vfork, exec, non-thread clone, unshare, setns, ptrace and reading or writing
    another process's memory fail; a call through another architecture's table kills the process. False where
    unsupported."""
    arch = platform.machine()
    if platform.system() != "Linux" or arch not in _AUDIT_ARCH:
        return False
    prog = _filter(arch)
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        return False
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
