"""What ``data/results/`` holds: only recordings something reads, each listed once in its index.

A file there earns its place when a reader uses it: a notebook, the top-level README, a test or the package names
it, or a notebook loads it through one of the package's "newest recording of a kind" loaders. The index,
``data/results/README.md``, says what each file is; it must list exactly the files present, but being listed there
keeps no file. Everything else -- logs, probes, superseded runs -- belongs in ``lab/results/``, which nothing in the
package reads and the package does not install.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from setuptools import find_packages

from conftest import NOTEBOOKS, ROOT
from flashlab.bench.results import newest_gpu_results
from flashlab.bench.traffic import newest_traffic_results

RESULTS = ROOT / "data" / "results"
INDEX = RESULTS / "README.md"
HERE = Path(__file__).resolve()

# A file name as text writes it: "h200-bf16-2026-11-29.json", "h200-ladder-bf16-2026-12-02.{json,csv}", or with
# its start elided after another full name, "…-short-causal-gqa8.csv".
NAME = re.compile(r"(?:…|\.\.\.)?[A-Za-z0-9_.-]+\.(?:\{[a-z0-9.,]+\}|tar\.gz|[a-z0-9]+)")
# Loader calls a notebook makes: the newest GPU recording of a mode, the newest traffic recording.
NEWEST_OF_MODE = re.compile(r"newest_gpu_results\([^)]*mode=[\"'](\w+)[\"']")
NEWEST_TRAFFIC = re.compile(r"\b(?:newest_traffic_results|notebook_traffic)\(")


def expand(name: str) -> list[str]:
    """``a.{json,csv}`` -> ``[a.json, a.csv]``; any other name as it is."""
    m = re.fullmatch(r"(.*)\.\{([^}]*)\}", name)
    return [f"{m.group(1)}.{ext}" for ext in m.group(2).split(",")] if m else [name]


def recording(name: str) -> str:
    """A run's files share one stem (the benchmark writes ``.json`` and ``.csv``, the printed table as ``.txt``)."""
    return name.removesuffix(".tar.gz").rsplit(".", 1)[0]


def reader_texts() -> dict[str, str]:
    """Everything that may read a recording: the README, the notebooks' cells, the tests, the package's source."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells)
    for path in [*sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "flashlab").rglob("*.py"))]:
        if path != HERE:
            texts[str(path.relative_to(ROOT))] = path.read_text()
    return texts


def notebook_loads(directory: Path, texts: dict[str, str]) -> set[str]:
    """The files the notebooks' loaders pick in ``directory``: the newest of each mode they ask for."""
    code = "\n".join(t for name, t in texts.items() if name.endswith(".ipynb"))
    picked = [newest_gpu_results(directory, mode=mode) for mode in sorted(set(NEWEST_OF_MODE.findall(code)))]
    if NEWEST_TRAFFIC.search(code):
        picked.append(newest_traffic_results(directory))
    return {p.name for p in picked if p is not None}


def unread(directory: Path, texts: dict[str, str]) -> list[str]:
    """Files in ``directory`` (its README aside) that no reader names and no notebook loader picks."""
    files = sorted(p.name for p in directory.iterdir() if p.name != "README.md")
    named = set()
    for text in texts.values():
        for token in NAME.findall(text):
            for name in expand(token):
                if name.startswith(("…", "...")):  # an elided start: the one file it can be
                    tail = name.lstrip("….")
                    named |= {f for f in files if f.endswith(tail)}
                else:
                    named.add(name)
    read = named | notebook_loads(directory, texts)
    stems = {recording(n) for n in read if n in files}
    return [f for f in files if recording(f) not in stems]


def indexed(index_text: str) -> list[str]:
    """The file names in the first column of the index's table (section "What is here")."""
    sections = [s for s in re.split(r"^## ", index_text, flags=re.MULTILINE) if s.startswith("What is here")]
    assert len(sections) == 1, "the index needs one section headed '## What is here'"
    section = sections[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first_column = line.split("|")[1]
            names += [n for token in re.findall(r"`([^`]+)`", first_column) for n in expand(token)]
    return names


def test_every_recorded_file_is_read_by_a_notebook_the_readme_a_test_or_the_package():
    stray = unread(RESULTS, reader_texts())
    assert not stray, (
        f"data/results/ holds files nothing reads: {stray}. Move them to lab/results/ with git mv "
        "(and their rows to lab/results/README.md), or make a notebook, the README or a test read them."
    )


def test_the_index_lists_exactly_the_files_present():
    listed = indexed(INDEX.read_text())
    present = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert len(listed) == len(set(listed)), (
        f"listed twice in {INDEX.name}: {sorted({n for n in listed if listed.count(n) > 1})}"
    )
    assert not set(present) - set(listed), (
        f"in data/results/ but not in its index: {sorted(set(present) - set(listed))}"
    )
    assert not set(listed) - set(present), (
        f"in the index but not in data/results/: {sorted(set(listed) - set(present))}"
    )


def test_a_stray_file_is_caught_and_an_index_row_does_not_keep_it(tmp_path):
    # the check must be able to fail: a planted probe nobody reads is reported even though the index names it
    for name in ("h200-decode-bf16-2026-12-01.json", "h200-decode-bf16-2026-12-01.csv", "h200-probe-2026-12-01.json"):
        (tmp_path / name).write_text(json.dumps({"meta": {}}))
    (tmp_path / "README.md").write_text("## What is here\n\n| `h200-probe-2026-12-01.json` | a probe |\n")
    texts = {"README.md": "the decode run, `h200-decode-bf16-2026-12-01.csv`"}  # the index is no reader
    assert unread(tmp_path, texts) == ["h200-probe-2026-12-01.json"]  # the .json of the named .csv is kept with it
    assert indexed((tmp_path / "README.md").read_text()) == ["h200-probe-2026-12-01.json"]


def test_a_notebook_loader_keeps_what_it_picks_and_only_that(tmp_path):
    def write(name, date):
        meta = dict(tool="flashlab.bench", date=date, is_cuda_gpu=True, config=dict(mode="decode"))
        (tmp_path / name).write_text(json.dumps(dict(meta=meta, rows=[])))

    write("h200-decode-old.json", "2026-11-29T00:00:00Z")
    write("h200-decode-new.json", "2026-12-01T00:00:00Z")
    notebook = {"06_decode.ipynb": 'bench.newest_gpu_results(RESULTS_DIR, mode="decode")'}
    assert unread(tmp_path, notebook) == ["h200-decode-old.json"]
    assert unread(tmp_path, {}) == ["h200-decode-new.json", "h200-decode-old.json"]


def test_an_elided_name_and_a_brace_pair_name_their_files(tmp_path):
    for name in ("a-run-gqa8.json", "a-run-gqa8.csv", "b-run.json", "b-run.csv", "b-run.txt", "c.log"):
        (tmp_path / name).write_text("{}")
    texts = {"README.md": "see `…-run-gqa8.csv` and `b-run.{json,csv}`"}
    assert unread(tmp_path, texts) == ["c.log"]


def test_the_lab_is_neither_packaged_nor_read_by_the_package():
    find = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]", 1)[1].split("\n[", 1)[0]
    include = re.findall(r'"([^"]+)"', re.search(r"include\s*=\s*\[([^\]]*)\]", find).group(1))
    assert not re.search(r"^\s*exclude", find, re.MULTILINE)  # the include list alone decides
    packages = find_packages(where=ROOT, include=include)
    assert packages and all(p == "flashlab" or p.startswith("flashlab.") for p in packages), packages
    assert (ROOT / "lab" / "README.md").exists()
    for path in sorted((ROOT / "flashlab").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+lab\b", text, re.MULTILINE), f"{path} imports lab"
        assert "lab/results" not in text and '"lab"' not in text, f"{path} reads lab/"
