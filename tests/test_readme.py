"""The README as a newcomer uses it: its commands work when pasted, and its forward figures are the recordings'.

Every command in a fenced shell block is one of three kinds:

- marked with a comment that says it ``needs a CUDA GPU``: its module must exist (``<python> -m <module> --help``
  exits 0), since the command itself cannot run here;
- a ``make`` target: ``make -n`` (a dry run, nothing installed or started) must find the target;
- anything else: run exactly as written, with bash, from a scratch folder laid out like the repository root
  (``.venv`` linked in, an empty ``submissions/``), and it must exit 0 within a few seconds. A bare ``python -m …``
  fails here unless the environment is active, as it does for a newcomer.

The forward figures quoted under "Benchmarking on a GPU" are recomputed from the recording each one names, which
must be the newest of its kind in ``data/results/``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import notebook_claims as claims
import pytest

from conftest import ROOT

README = ROOT / "README.md"
FENCE = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
GPU_MARK = "needs a CUDA GPU"


def fenced_commands(text: str) -> list[tuple[str, str]]:
    """``(command, comment)`` for every command line of the fenced shell blocks (continuations joined)."""
    found = []
    for _, block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            command, _, comment = line.partition("  #")  # a trailing comment follows two spaces
            found.append((command.strip(), comment.strip()))
    return found


def kind(command: str, comment: str) -> str:
    if GPU_MARK in comment:
        return "gpu"
    return "make" if command.split()[0] == "make" else "run"


def scratch_root(tmp_path: Path) -> Path:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "submissions").mkdir()
    return tmp_path


def run(command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


COMMANDS = fenced_commands(README.read_text())


@functools.cache
def module_help(python: str, module: str) -> subprocess.CompletedProcess:
    """``<python> -m <module> --help`` from the repository root, run once per process: most GPU commands are modes
    of one module (``flashlab.bench``), and the same command line in the same tree answers the same each time."""
    return run(f"{python} -m {module} --help", ROOT)


def test_the_readme_has_commands_of_each_kind():
    kinds = {kind(c, note) for c, note in COMMANDS}
    assert kinds == {"gpu", "make", "run"}, f"README's fenced commands: {COMMANDS}"


@pytest.mark.parametrize("command, comment", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_each_readme_command_works_as_pasted(command, comment, tmp_path):
    what = kind(command, comment)
    if what == "gpu":
        module = re.search(r"-m (\S+)", command)
        assert module, f"a command marked '{GPU_MARK}' should be a `python -m` command: {command}"
        done = module_help(shlex.split(command)[0], module.group(1))
    elif what == "make":
        done = run(f"make -n {command.removeprefix('make').strip()}", ROOT)
    else:
        done = run(command, scratch_root(tmp_path))
    assert done.returncode == 0, f"`{command}` ({what}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_the_command_finder_reads_blocks_comments_and_marks():
    text = "x\n```bash\nmake test   # all of it\n\n.venv/bin/python -m a  # needs a CUDA GPU: b\nls \\\n  -l\n```\n"
    found = fenced_commands(text)
    assert found == [("make test", "all of it"), (".venv/bin/python -m a", "needs a CUDA GPU: b"), ("ls    -l", "")]
    assert [kind(*c) for c in found] == ["make", "gpu", "run"]


def test_a_command_that_fails_as_pasted_is_caught(tmp_path):
    done = run("python -m flashlab_does_not_exist --help", scratch_root(tmp_path))
    assert done.returncode != 0


FORWARD = re.compile(
    r"\(`(h200-[\w.-]+\.json)`[^)]*\): ([\d.]+)× cuDNN \(([\d.]+)–([\d.]+)×\), "
    r"([\d.]+)× FlashAttention-2 \(([\d.]+)–([\d.]+)×\)"
)
KIND_KEYS = ("mode", "dtypes", "head_dims", "gqa", "seq_lens")


def same_kind(data: dict, reference: dict) -> bool:
    """A benchmark run of the same grid (mode, dtypes, head dims, GQA, lengths) with flashlab beside both kernels."""
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    if meta.get("tool") != "flashlab.bench" or not meta.get("is_cuda_gpu"):
        return False
    config, ref = meta.get("config") or {}, reference["meta"]["config"]
    grid = [(config.get(k), ref.get(k)) for k in KIND_KEYS if k != "gqa"] + [(config.get("gqa", 1), ref.get("gqa", 1))]
    if not all(a == b for a, b in grid):  # another mode's rows need not name a backend
        return False
    return {"flashlab", "sdpa_flash", "sdpa_cudnn"} <= {r["backend"] for r in claims.ok_rows(data)}


def quoted_forward_figures():
    return FORWARD.findall(README.read_text())


def test_the_readme_quotes_forward_figures():
    assert len(quoted_forward_figures()) >= 4


@pytest.mark.parametrize("quote", quoted_forward_figures(), ids=lambda q: q[0])
def test_readme_forward_figures_are_the_recordings(quote):
    name, *said = quote
    data = claims.load(name)
    expected = []
    for other in ("sdpa_cudnn", "sdpa_flash"):
        r = claims.ratios(data, "flashlab", other)
        expected += [f"{claims.geomean(r):.2f}", f"{min(r):.2f}", f"{max(r):.2f}"]
    assert said == expected, f"README quotes {said} for {name}; the recording gives {expected}"
    newer = []
    for path in claims.RESULTS.glob("*.json"):
        other = json.loads(path.read_text())
        if path.name != name and same_kind(other, data) and other["meta"]["date"] > data["meta"]["date"]:
            newer.append(path.name)
    assert not newer, f"README quotes {name}; newer recordings of the same kind: {newer}"


def test_level_with_cudnn_is_what_the_bf16_recording_says():
    text = README.read_text()
    g = claims.geomean(claims.ratios(claims.load(claims.LADDER), "flashlab", "sdpa_cudnn"))
    if "level with cuDNN" in text:
        assert abs(g - 1) <= 0.05, f"README says level with cuDNN; the recording gives {g:.3f}x"
