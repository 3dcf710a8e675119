"""``python -m flashlab.grade SUBMISSION... --out DIR``: grade notebooks, write grades.csv and results.json.

Every argument is checked before anything is graded, and where Landlock is missing the command refuses to grade
unless given ``--allow-without-landlock``. Ctrl-C or SIGTERM kills every submission process and leaves a
report marked incomplete (exit status 130 or 143); a second run on the same ``--out`` while one is running is
refused.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

from flashlab.grade import sandbox
from flashlab.grade.runner import Busy, grade, grade_table, interrupt, walls_summary

ALLOW_FLAG = "--allow-without-landlock"
NO_LANDLOCK = (
    "this system has no Landlock (Linux 5.13+ with Landlock enabled), so a submission's process could read, change "
    "and delete every file your user can (instructor/solutions, the other submissions, --out), signal your "
    "processes and read their memory, and open network connections; grade as a user that can reach nothing of "
    f"value, or pass {ALLOW_FLAG} to grade anyway"
)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number above 0; got {text}")
        return value

    return parse


def writable_folder(out: Path) -> str | None:
    """Why ``out`` cannot take the reports, or None if it can (it is created if missing)."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        return f"cannot write to --out {out}: {e.strerror or e}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flashlab.grade",
        description="Grade submitted flashlab notebooks: each exercise's tests run in the grader against the learner's "
        "function, which runs walled in, in a process of its own, with a time and memory limit.",
    )
    p.add_argument("submissions", nargs="+", help="notebooks, or folders (graded: every .ipynb under them)")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="folder for grades.csv and results.json (given explicitly; instructor/README.md uses grading/grades, "
        "which git ignores)",
    )
    p.add_argument("--jobs", type=_positive(int), default=None, help="exercises graded at once (default: CPU cores)")
    p.add_argument(
        "--time-limit", type=_positive(float), default=None, help="seconds per exercise (default: each exercise's own)"
    )
    p.add_argument(
        "--memory-limit", type=_positive(int), default=None, help="MiB of address space per exercise (default: own)"
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        ALLOW_FLAG,
        action="store_true",
        help="grade even where Landlock is missing; submissions can then read and write your files, signal your "
        "processes and read their memory (see instructor/README.md)",
    )
    args = p.parse_args(argv)
    if sandbox.landlock_abi() == 0 and not args.allow_without_landlock:
        p.error(NO_LANDLOCK)
    why = writable_folder(args.out)
    if why:
        p.error(why)
    missing = [s for s in args.submissions if not os.path.lexists(s)]
    if missing:
        p.error(f"no such file or folder: {', '.join(missing)}")
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        interrupt()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        subs = grade(
            args.submissions,
            args.out,
            jobs=args.jobs,
            time_limit=args.time_limit,
            memory_mib=args.memory_limit,
            progress=not args.no_progress,
        )
    except Busy as e:
        print(f"python -m flashlab.grade: error: {e}", file=sys.stderr)
        return 2
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    print(grade_table(subs))
    print(walls_summary(subs))
    if received:
        print(f"\ninterrupted: wrote an incomplete report to {args.out}", file=sys.stderr)
        return 128 + received[0]
    print(f"\nwrote {args.out / 'grades.csv'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
