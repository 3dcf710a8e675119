"""The pinned versions are the ones installed: requirements/ci-constraints.txt matches this environment.

``make lab`` and ``make test`` install with ``pip install -c requirements/ci-constraints.txt``, so in the
Makefile's environment every package the file lists must be installed at exactly that version. If this fails
after you changed a dependency, re-record the pins in CI's environment (``make constraints``) and commit them.

torch and triton are not pinned: the file records CI's builds as comments only. Which torch you get depends on
the platform and the index (PyPI's Linux wheel is a CUDA build, PyTorch's CPU index has CPU builds), and every
CUDA build of torch requires its own triton release, so a pin would either fail to resolve or force CI's CPU
build on a GPU machine. They are compared only where this environment has CI's very torch build: the same torch
with the same pins must bring the same triton.

Conda environments, virtual environments made by hand, and ``make ... CONSTRAINTS=`` (an install without the
pins) choose their own versions; the test skips there.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import ROOT

CONSTRAINTS = ROOT / "requirements" / "ci-constraints.txt"
MAKEFILE_STAMP = Path(sys.prefix) / ".flashlab-installed"  # the Makefile writes which pins it installed with
NOT_PINNED = ("torch", "triton")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_constraints(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(pins, ci_builds): ``name==version`` lines, and the ``# ci ran, not pinned: name==version`` comments."""
    pins, ci_builds = {}, {}
    for raw in text.splitlines():
        line = raw.strip()
        m = re.fullmatch(r"#\s*ci ran, not pinned:\s*([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            ci_builds[_key(m.group(1))] = m.group(2)
            continue
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line)
        assert m, f"ci-constraints.txt: {raw!r} is not a 'name==version' pin"
        pins[_key(m.group(1))] = m.group(2)
    return pins, ci_builds


PINS, CI_BUILDS = parse_constraints(CONSTRAINTS.read_text())


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_the_constraints_file_pins_exact_versions_and_leaves_torch_and_triton_out():
    assert len(PINS) > 20  # every package CI installed, not a hand-picked few
    for name in ("numpy", "matplotlib", "jupyterlab", "ipywidgets", "pytest", "nbclient", "ruff"):
        assert name in PINS, name
    assert not set(NOT_PINNED) & set(PINS)
    assert set(CI_BUILDS) == set(NOT_PINNED)
    assert "flashlab" not in PINS  # the project itself is installed from the checkout


def test_parse_constraints_reads_pins_and_ci_builds():
    pins, builds = parse_constraints(
        "# about\n# ci ran, not pinned: torch==2.13.0+cpu\nJinja2==3.1.6\n\nnest_asyncio2==1\n"
    )
    assert pins == {"jinja2": "3.1.6", "nest-asyncio2": "1"} and builds == {"torch": "2.13.0+cpu"}
    with pytest.raises(AssertionError, match="not a 'name==version' pin"):
        parse_constraints("numpy>=1\n")


def pinned_by_the_makefile(stamp=MAKEFILE_STAMP) -> bool:
    """Whether the Makefile installed this environment with the constraints file (not with CONSTRAINTS= empty)."""
    return stamp.is_file() and stamp.read_text().strip() == "pinned by: requirements/ci-constraints.txt"


needs_makefile_env = pytest.mark.skipif(
    not pinned_by_the_makefile(),
    reason="not installed by the Makefile with the pins (conda, hand-made, or CONSTRAINTS= empty): "
    "its versions are its own",
)


def test_the_makefile_stamp_says_what_pinned_it(tmp_path):
    stamp = tmp_path / ".flashlab-installed"
    assert not pinned_by_the_makefile(stamp)
    stamp.write_text("pinned by: nothing\n")
    assert not pinned_by_the_makefile(stamp)
    stamp.write_text("pinned by: requirements/ci-constraints.txt\n")
    assert pinned_by_the_makefile(stamp)
    makefile = (ROOT / "Makefile").read_text()
    assert 'echo "pinned by: $(or $(CONSTRAINTS),nothing)" > $@' in makefile
    assert "CONSTRAINTS ?= requirements/ci-constraints.txt" in makefile


@needs_makefile_env
def test_installed_versions_are_the_pinned_ones():
    wrong = {name: (pin, _installed(name)) for name, pin in PINS.items() if _installed(name) != pin}
    assert not wrong, f"installed versions differ from {CONSTRAINTS.name} (pinned, installed): {wrong}"


@needs_makefile_env
def test_torch_and_triton_match_ci_where_torch_is_cis_build():
    torch_version = _installed("torch")
    if torch_version != CI_BUILDS["torch"]:
        pytest.skip(f"torch {torch_version} is not CI's build {CI_BUILDS['torch']}; its triton is its own")
    assert _installed("triton") == CI_BUILDS["triton"]
