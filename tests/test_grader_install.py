"""The walls hold with flashlab installed as a regular package, not only as the editable checkout the suite runs
from: a copy installed by pip into a site-packages folder the learner's process imports from is as unreadable to a
submission as the checkout is.

The regular install is real (``pip install --no-deps --target``) into a temporary folder the grader then treats as
one more site-packages folder, exactly where a ``pip install .`` would put flashlab; the submissions are the solved
notebooks with one exercise cell replaced, as in ``tests/test_grader.py``.
"""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from test_grader import SOLUTIONS, solved_notebook

from conftest import ROOT
from flashlab import exercises
from flashlab.grade import grade, sandbox, worker

pytestmark = pytest.mark.skipif(sandbox.landlock_abi() == 0, reason="this kernel has no Landlock: nothing is walled")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A regular (non-editable) install of flashlab in a folder of its own: its package and its dist-info."""
    site = tmp_path_factory.mktemp("site-packages")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"]
    subprocess.run([*cmd, "--target", str(site), str(ROOT)], check=True, timeout=300, capture_output=True)
    assert (site / "flashlab" / "exercises" / "nb03_tiling.py").is_file()
    return site


def _probes(site) -> dict[str, tuple[str, str, tuple[str, str]]]:
    tests = site / "flashlab" / "exercises" / "nb03_tiling.py"
    return {  # name: (exercise replaced, its cell, words the learner reads: in a private view, under Landlock alone)
        "calls_installed_reference": (
            "03.tiled_attention",
            "from flashlab.reference import tiled_attention as _theirs\n\n\n"
            "def tiled_attention(q, k, v, block_m, block_n, causal=False):\n"
            "    return _theirs(q, k, v, causal=causal, block_m=block_m, block_n=block_n)[0]\n",
            ("ModuleNotFoundError", "PermissionError"),  # not in the private view at all; unreadable under Landlock
        ),
        "reads_installed_tests": (
            "03.count_causal_tiles",
            f"_tests = open({str(tests)!r}).read()  # the exercise tests, and so the expected values\n\n"
            + SOLUTIONS["03.count_causal_tiles"],
            ("FileNotFoundError", "PermissionError"),
        ),
    }


def test_a_regular_install_is_unreadable_to_a_submission(installed, tmp_path, monkeypatch):
    real = worker._site_dirs()
    monkeypatch.setattr(worker, "_site_dirs", lambda: [*real, str(installed)])
    subs = tmp_path / "subs"
    subs.mkdir()
    probes = _probes(installed)
    for name, (ex_id, code, _) in probes.items():
        nbformat.write(solved_notebook("03", {ex_id: code}), subs / f"03_{name}.ipynb")
    nbformat.write(solved_notebook("03"), subs / "03_clean.ipynb")
    graded = {s.name: s for s in grade([subs], out_dir=tmp_path / "out", jobs=2, time_limit=30, progress=False)}
    for name, (ex_id, _, words) in probes.items():
        by_id = {r.exercise_id: r for r in graded[f"03_{name}.ipynb"].results}
        r = by_id[ex_id]
        messages = " | ".join(t.message for t in r.tests)
        words = words[0] if r.walls.get("private_view") else words[1]
        assert r.score == 0 and words in messages, f"{name}: {r.score}/{r.max_score}: {messages}"
        assert r.walls.get("landlock", 0) > 0, r.walls
        for other in by_id.values():  # the notebook's other exercise is graded as if alone
            if other.exercise_id != ex_id:
                assert other.score == other.max_score > 0, f"{name}: {other.exercise_id}: {other.tests[0].message}"
    clean = graded["03_clean.ipynb"]
    assert clean.score == clean.max_score == sum(exercises.max_points(e.id) for e in exercises.exercises_of("03"))
