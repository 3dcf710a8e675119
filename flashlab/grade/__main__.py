"""``python -m flashlab.grade SUBMISSION... --out DIR``: grade notebooks, write grades.csv and results.json."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashlab.grade.runner import grade, grade_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flashlab.grade",
        description="Grade submitted flashlab notebooks: run each exercise's pytest tests on the learner's function, "
        "one process per submission and exercise, with a time limit each.",
    )
    p.add_argument("submissions", nargs="+", help="notebooks, or folders (graded: every .ipynb under them)")
    p.add_argument("--out", required=True, type=Path, help="folder for grades.csv and results.json")
    p.add_argument("--jobs", type=int, default=None, help="exercises graded at once (default: one per CPU core)")
    p.add_argument(
        "--time-limit", type=float, default=None, help="seconds per exercise (default: each exercise's own limit)"
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    missing = [s for s in args.submissions if not Path(s).exists()]
    if missing:
        p.error(f"no such file or folder: {', '.join(missing)}")
    subs = grade(args.submissions, args.out, jobs=args.jobs, time_limit=args.time_limit, progress=not args.no_progress)
    print(grade_table(subs))
    print(f"\nwrote {args.out / 'grades.csv'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
