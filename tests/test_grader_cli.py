"""The grading command: every argument checked before any grading, one run per output folder, and an interrupted
run kills its submissions' processes and leaves a report marked incomplete, never the previous run's."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from test_grader import solved_notebook

from conftest import ROOT
from flashlab.grade.__main__ import main
from flashlab.grade.runner import LOCK_NAME, expand


@pytest.fixture
def one_submission(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(solved_notebook("07"), subs / "07_a.ipynb")
    return subs


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--time-limit", "nan"], "finite number above 0"),
        (["--time-limit", "inf"], "finite number above 0"),
        (["--time-limit", "0"], "finite number above 0"),
        (["--time-limit", "-5"], "finite number above 0"),
        (["--jobs", "0"], "finite number above 0"),
        (["--jobs", "-1"], "finite number above 0"),
        (["--memory-limit", "0"], "finite number above 0"),
    ],
)
def test_bad_limits_are_refused_before_grading(one_submission, tmp_path, capsys, extra, words):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main([str(one_submission), "--out", str(out), *extra])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (out / "results.json").exists()


def test_an_out_that_cannot_take_reports_is_refused_first(one_submission, tmp_path, capsys):
    a_file = tmp_path / "grades.txt"
    a_file.write_text("not a folder")
    for out, words in ((a_file, "is a file"), (a_file / "sub", "cannot write")):
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            main([str(one_submission), "--out", str(out)])
        assert e.value.code == 2 and words in capsys.readouterr().err
        assert time.monotonic() - start < 2, "the check must come before any grading"


def test_a_second_run_on_the_same_out_is_refused(one_submission, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "grades.csv").write_text("the running grader's file\n")
    with open(out / LOCK_NAME, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds it
        assert main([str(one_submission), "--out", str(out), "--no-progress"]) == 2
    assert "another grading run is writing to" in capsys.readouterr().err
    assert (out / "grades.csv").read_text() == "the running grader's file\n"


def test_submission_names_are_relative_to_the_folder_given(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder / "week1").mkdir(parents=True)
        (tmp_path / folder / "week1" / "01_x.ipynb").write_text("{}")
    (tmp_path / "a" / "week1" / "02_y.ipynb").write_text("{}")
    names = [n for _, n in expand([tmp_path / "a"])]
    assert names == ["week1/01_x.ipynb", "week1/02_y.ipynb"]
    clash = [n for _, n in expand([tmp_path / "a", tmp_path / "b"])]  # the same relative name twice: told apart
    assert len(set(clash)) == len(clash) == 3


def _children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(p))
    return out


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_run_kills_its_children_and_marks_its_report(tmp_path, signum, code):
    subs, out = tmp_path / "subs", tmp_path / "out"
    subs.mkdir()
    out.mkdir()
    (out / "grades.csv").write_text("submission,total\nSTALE,99\n")  # the previous run's
    spin = "def kv_cache_bytes_per_token(*args, **kw):\n    while True:\n        pass\n"
    nbformat.write(solved_notebook("07", {"07.kv_cache_bytes_per_token": spin}), subs / "07_spins.ipynb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashlab.grade", str(subs), "--out", str(out), "--time-limit", "300", "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children, deadline = [], time.monotonic() + 60
    while not children and time.monotonic() < deadline:  # wait for the submission's process to start
        time.sleep(0.2)
        children = _children(proc.pid)
    assert children, "the grader never started a submission process"
    time.sleep(1.0)
    proc.send_signal(signum)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the grader did not stop after the signal") from None
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr
    time.sleep(0.2)
    assert not [c for c in children if Path(f"/proc/{c}").exists() and "zombie" not in _state(c)], "child lives on"
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] is False and "interrupted" in report["reason"]
    rows = list(csv.DictReader((out / "grades.csv").read_text().splitlines()))
    assert [r["submission"] for r in rows] == ["07_spins.ipynb"] and rows[0]["status"] == "incomplete"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


# -- what is a submission ----------------------------------------------------------------------------------------


def test_only_regular_files_are_submissions(tmp_path, capsys):
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(solved_notebook("07"), subs / "07_real.ipynb")
    os.mkfifo(subs / "07_fifo.ipynb")  # reading it would wait for a writer forever
    (subs / "07_zero.ipynb").symlink_to("/dev/zero")  # reading it would never end
    (subs / "07_link.ipynb").symlink_to(subs / "07_real.ipynb")  # another learner's file, by link
    out = tmp_path / "out"
    assert main([str(subs), "/dev/zero", "--out", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    rows = {r["submission"]: r for r in csv.DictReader((out / "grades.csv").read_text().splitlines())}
    assert int(rows["07_real.ipynb"]["total"]) == int(rows["07_real.ipynb"]["max_total"]) > 0
    for name in ("07_fifo.ipynb", "07_zero.ipynb", "07_link.ipynb", "/dev/zero"):
        assert rows[name]["total"] == "0" and rows[name]["max_total"] == "0", rows[name]
    walls = next(line for line in table.splitlines() if line.startswith("sandbox: "))  # what held, said once
    assert "private view (" in walls or "no private mount namespace for 1 of 1 exercises" in walls, walls
    lines = {line.split()[0]: line for line in table.splitlines() if " total " in line}
    assert "skipped: not a regular file (a FIFO)" in lines["07_fifo.ipynb"]
    assert "skipped: not a regular file (a character device)" in lines["/dev/zero"]
    assert "skipped: a symbolic link" in lines["07_zero.ipynb"] and "skipped: a symbolic link" in lines["07_link.ipynb"]


def test_grading_refuses_to_run_without_landlock_unless_told(one_submission, tmp_path, capsys, monkeypatch):
    from flashlab.grade import __main__ as command

    monkeypatch.setattr(command.sandbox, "landlock_abi", lambda: 0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main([str(one_submission), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no Landlock" in err and "--allow-without-landlock" in err
    assert "signal your processes" in err and not out.exists()
    assert main([str(one_submission), "--out", str(out), "--no-progress", "--allow-without-landlock"]) == 0
    assert json.loads((out / "results.json").read_text())["complete"] is True


def test_the_documented_output_folders_are_ignored_by_git():
    readme = (ROOT / "instructor" / "README.md").read_text()
    outs = re.findall(r"--out (\S+)", "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.S)))
    assert len(outs) >= 3, outs
    for out in outs:
        ignored = subprocess.run(["git", "check-ignore", "-q", out.rstrip("/") + "/x"], cwd=ROOT)
        assert ignored.returncode == 0, f"--out {out} in instructor/README.md is not ignored by git"
    for command in ("flashlab.grade", "flashlab.grade.solutions"):
        help_text = subprocess.run(
            [sys.executable, "-m", command, "--help"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        assert "grading/" in help_text and "ignores" in help_text, help_text


def test_the_summary_says_where_names_outside_the_view_were_not_hidden():
    from flashlab.grade.records import ExerciseResult, Submission
    from flashlab.grade.runner import walls_summary

    held = {"landlock": 6, "no_new_processes": True, "private_view": "user and mount namespace"}
    bare = {"landlock": 6, "no_new_processes": True, "private_view": False, "view_problem": "unshare: EPERM"}
    sub = Submission("a.ipynb")
    sub.results = [ExerciseResult("07.kv_cache_bytes_per_token", [], walls=held)]
    assert walls_summary([sub]) == (
        "sandbox: Landlock ABI 6; seccomp; private view (user and mount namespace): nothing outside what it may "
        "read is there to name"
    )
    sub.results.append(ExerciseResult("06.merge_split_kv", [], walls=bare))
    line = walls_summary([sub])
    assert "no private mount namespace for 1 of 2 exercises (unshare: EPERM)" in line
    assert "names and sizes of files there" in line
