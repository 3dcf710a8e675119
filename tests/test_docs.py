"""The text people read: every link resolves inside the repository, and nothing speaks of how the project is run.

Covers the README, every Markdown file under docs/, data/ and instructor/, the notebooks' Markdown cells, and the
package's docstrings and ``--help`` texts (which live in the package source).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import NOTEBOOKS, ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MARKDOWN = sorted(
    [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("data/**/*.md"), *ROOT.glob("instructor/**/*.md")]
)


def markdown_texts():
    for path in MARKDOWN:
        yield path, path.read_text()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        yield path, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def local_links(text: str):
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http:, mailto:, in-page anchors
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("path,text", list(markdown_texts()), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_every_link_resolves_inside_the_repository(path, text):
    missing = []
    for target in local_links(text):
        resolved = (path.parent / target).resolve()
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to files that are not in the repository: {missing}"


def test_the_link_finder_finds_links():
    text = "see [notes](docs/kernel-notes.md#run-3), [pic](docs/images/explorer.png) and [web](https://example.org)"
    assert list(local_links(text)) == ["docs/kernel-notes.md", "docs/images/explorer.png"]


# Phrases that speak of the project's own process (its tracker, its work sessions, who did what) rather than the
# subject. A learner or a user has no issues to read.
PROCESS = re.compile(
    r"\b(the|an|this|that|our|project'?s?) issue('s)?\b|\bissue #?\d+"
    r"|\b(this|that|earlier|previous|next|work|coding) session\b|\bhelper [A-Z]\d\b",
    re.IGNORECASE,
)


def reader_facing_texts():
    for path in MARKDOWN:
        yield path, path.read_text()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):  # prose and code comments alike
        yield path, "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    for path in sorted((ROOT / "flashlab").rglob("*.py")):
        yield path, path.read_text()
    for path in sorted((ROOT / "scripts").glob("*")):
        yield path, path.read_text()


@pytest.mark.parametrize("path,text", list(reader_facing_texts()), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_text_speaks_of_the_subject_not_the_process(path, text):
    hits = [m.group(0) for m in PROCESS.finditer(text)]
    assert not hits, f"{path.relative_to(ROOT)} speaks of the project's process: {hits}"


def test_the_process_check_can_fail():
    assert PROCESS.search("the bar the issue sets") and PROCESS.search("measured in this session")
    assert not PROCESS.search("a pytest session fixture") and not PROCESS.search("the GitHub issue tracker of Triton")
    assert not PROCESS.search("the child runs in a session of its own")
