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

import contextlib
import ctypes
import os
import platform
import resource
import stat
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


# -- a private view: a mount namespace holding only what the child may see ---------------------------------------

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
# statvfs flag -> mount flag, Linux's numbers (os.ST_NODEV and the rest exist only there): a remount inside a user
# namespace must keep these as they are
_KEPT_FLAGS = {2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 1024: _MS_NOATIME, 2048: _MS_NODIRATIME, 4096: _MS_RELATIME}
OWN_PROC = "/proc/self"  # bound as the child's own /proc/PID: resolved in the child, never here


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outer(path: str, folders) -> str | None:
    """The folder of ``folders`` that holds ``path`` (not ``path`` itself), or None."""
    while path != "/":
        path = os.path.dirname(path)
        if path in folders:
            return path
    return None


def _kind(path: str) -> str | None:
    """``"dir"``, ``"file"``, ``"link"`` (not followed) or None where nothing is there."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file"


def _walk(path: str, dirs: set, links: dict, kinds: dict, hops: int = 40) -> str | None:
    """Resolve ``path`` as the kernel does, recording the folders and symbolic links met on the way; the resolved
    path, or None where nothing is there. ``kinds`` remembers what each step was, across calls."""
    todo = [p for p in path.split("/") if p]
    at = "/"
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            at = os.path.dirname(at)  # ``at`` holds no link, so its parent is exact
            continue
        step = os.path.join(at, name)
        if step not in kinds:
            kinds[step] = _kind(step)
        kind = kinds[step]
        if kind == "link":
            hops -= 1
            if hops < 0:
                return None
            target = links[step] = os.readlink(step)
            at = "/" if target.startswith("/") else at
            todo[:0] = [p for p in target.split("/") if p]
            continue
        if kind != "dir":  # a file is the last name on a path, or the path is not there
            return step if kind == "file" and not todo else None
        dirs.add(step)
        at = step
    return at


def view_plan(readable, writable, listable, wanted, root: str) -> dict:
    """What the child's private view holds, as plain data: ``binds`` ([path, "ro" or "rw"], each folder before what
    it holds, none inside another), the mount points and folders to make on the empty root (``dirs``, ``files``),
    and the symbolic links on the way to ``wanted`` (the paths the child will name: its import path, its working
    folder) and to the bound paths (``links``).

    Made in the grader, from the real filesystem. ValueError where no such view can be made (a writable folder
    inside a read-only one, or ``root`` inside a bound folder).
    """
    dirs: set[str] = {"/proc", OWN_PROC}
    links: dict[str, str] = {}
    kinds: dict[str, str | None] = {}
    modes: dict[str, str] = {}
    for mode, paths in (("ro", readable), ("rw", writable)):
        for p in paths:
            real = p if p == OWN_PROC else _walk(p, dirs, links, kinds)
            if real is not None:
                modes[real] = mode
    binds: dict[str, str] = {}
    for path in sorted(modes):  # a folder sorts before what it holds
        outer = _outer(path, binds)
        if outer is not None:
            if binds[outer] == "ro" and modes[path] == "rw":
                raise ValueError(f"the writable {path} lies inside the read-only {outer}")
            continue  # already seen through the folder around it
        if _beneath(root, path):
            raise ValueError(f"the view's root {root} lies inside {path}, which it would hold")
        binds[path] = modes[path]
    for p in [*listable, *wanted]:
        _walk(p, dirs, links, kinds)
    files = [b for b in binds if b != OWN_PROC and kinds.get(b) == "file"]
    return {  # what lies inside a bound folder comes with it
        "dirs": sorted(d for d in dirs if _outer(d, binds) is None),
        "links": sorted([p, t] for p, t in links.items() if _outer(p, binds) is None),
        "files": files,
        "binds": [[p, m] for p, m in binds.items()],
    }


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _make(root_fd: int, path: str, kind: str, target: str = "") -> None:
    """Make ``path`` beneath the folder ``root_fd`` (a folder, an empty file or a link), never following a link."""
    *parents, last = [p for p in path.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for name in parents:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if kind == "dir":
            with contextlib.suppress(FileExistsError):
                os.mkdir(last, 0o755, dir_fd=fd)
        elif kind == "link":
            os.symlink(target, last, dir_fd=fd)
        else:
            new_file = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(last, new_file, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def _set_read_only(libc, path: str, read_only: bool = True) -> bool:
    """Make the mount at ``path`` and every mount beneath it read-only (or read-write again) in one call; False
    where the kernel (before 5.12) has no mount_setattr."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0) if read_only else _MountAttr(0, _MOUNT_ATTR_RDONLY, 0, 0)
    args = (ctypes.c_int(_AT_FDCWD), path.encode(), ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr))
    if libc.syscall(_MOUNT_SETATTR, *args, ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return True
    if ctypes.get_errno() != 38:  # ENOSYS
        _check(-1, f"making {path} {'read-only' if read_only else 'writable'}")
    return False


def _remount_read_only(libc, path: str) -> None:
    """The same for one mount, the old way: a remount that keeps the flags a user namespace may not change."""
    flags = os.statvfs(path).f_flag
    kept = sum(m for st, m in _KEPT_FLAGS.items() if flags & st)
    _check(libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept, None), path)


def _enter_namespace(libc, user: bool | None) -> str:
    """Unshare the mount namespace (root), or a user and a mount namespace (anyone else, or ``user=True``); which
    one, in words."""
    if not user and os.geteuid() == 0 and libc.unshare(_CLONE_NEWNS) == 0:
        return "mount namespace"
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "user and mount namespace"


def enter_private_view(root: str, plan: dict, user_namespace: bool | None = None) -> dict:
    """Move the calling process (single-threaded, before any learner code) into a mount namespace of its own whose
    root is a new tmpfs holding only ``plan`` (``view_plan``), bound at the same paths; the folder ``root`` (empty,
    made by the grader) is where that tmpfs is built before it becomes ``/``. ``user_namespace=True`` makes a user
    namespace even for root, as an unprivileged process must.

    Returns ``{"private_view": how}`` (``"mount namespace"`` or ``"user and mount namespace"``), or ``{"private_view":
    False, "view_problem": why}`` where none could be made: then the process sees the filesystem as before.
    Nothing done here reaches the grader's view: every mount is private to the new namespace.
    """
    if platform.system() != "Linux" or platform.machine() not in _PIVOT_ROOT:
        return {"private_view": False, "view_problem": f"no mount namespaces on {platform.system()}"}
    libc = _libc()
    try:
        how = _enter_namespace(libc, user_namespace)
    except OSError as e:
        return {"private_view": False, "view_problem": f"no mount namespace could be made ({e.strerror or e})"}
    try:
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making the mounts private")
        _check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755,size=4m"), "tmpfs")
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:  # every mount point is made on the tmpfs before anything is bound onto it
            for d in plan["dirs"]:
                _make(root_fd, d, "dir")
            for path, target in plan["links"]:
                _make(root_fd, path, "link", target)
            for f in plan["files"]:
                _make(root_fd, f, "file")
        finally:
            os.close(root_fd)
        for path, _ in plan["binds"]:
            where = root + path
            _check(libc.mount(path.encode(), where.encode(), None, _MS_BIND | _MS_REC, None), f"binding {path}")
        if _set_read_only(libc, root):  # the whole tree at once, then the writable folders again
            for path, mode in plan["binds"]:
                if mode == "rw":
                    _set_read_only(libc, root + path, read_only=False)
        else:
            _remount_read_only(libc, root)
            for path, mode in plan["binds"]:
                if mode == "ro":
                    _remount_read_only(libc, root + path)
        os.chdir(root)
        _check(libc.syscall(_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
        _check(libc.umount2(b".", _MNT_DETACH), "detaching the old root")
        os.chdir("/")
    except (OSError, KeyError, TypeError, ValueError) as e:
        return {"private_view": False, "view_problem": f"{how}, but the view could not be built ({e})"}
    return {"private_view": how}


# -- capabilities -------------------------------------------------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> bool:
    """Give up every capability (effective, permitted, inheritable); for root too. False where unsupported."""
    if platform.system() != "Linux":
        return False
    empty = (_CapData * 2)()  # version 3: two 32-bit words of each set
    return _libc().capset(ctypes.byref(_CapHeader(0x20080522, 0)), empty) == 0


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
# calls that start a process, replace the program, enter new namespaces, change what is mounted where (and so could
# uncover what the private view hides), open a file by its handle, or read another process's memory; clone is
# checked for CLONE_THREAD and no new namespace instead (a thread is allowed)
_MOUNTS = (428, 429, 430, 431, 432, 433, 442, 467)  # open_tree, move_mount, fsopen, fsconfig, fsmount, fspick,
# mount_setattr, open_tree_attr: numbered alike on both
_DENY = {
    # fork, vfork, execve, execveat, unshare, setns, ptrace, process_vm_readv, process_vm_writev, mount, umount2,
    # pivot_root, chroot, name_to_handle_at, open_by_handle_at
    "x86_64": (57, 58, 59, 322, 272, 308, 101, 310, 311, 165, 166, 155, 161, 303, 304, *_MOUNTS),
    # execve, execveat, unshare, setns, ptrace, process_vm_readv, process_vm_writev, mount, umount2, pivot_root,
    # chroot, name_to_handle_at, open_by_handle_at
    "aarch64": (221, 281, 97, 268, 117, 270, 271, 40, 39, 41, 51, 264, 265, *_MOUNTS),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_CLONE_THREAD = 0x00010000
_CLONE_NEW_NAMESPACES = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (none is NEWTIME)
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
    body.append(("jset", _CLONE_NEW_NAMESPACES, "eperm", "next"))
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
    """Install a seccomp filter: fork, vfork, exec, clone but for a thread in the same namespaces, unshare, setns,
    every call that mounts, unmounts, moves a mount or changes the root, opening a file by its handle, ptrace and
    reading or writing another process's memory fail; a call through another architecture's table kills the process.
    False where unsupported."""
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
