"""environment.yml (for conda users) must list the same dependencies as pyproject.toml (for pip users)."""

from __future__ import annotations

import re

import tomllib

from conftest import ROOT


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_runtime() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {_name(r): r.replace(" ", "") for r in data["project"]["dependencies"]}


def _environment_yml() -> dict[str, str]:
    deps = {}
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"^\s*-\s+(.+?)\s*$", line)
        if not m or m.group(1).endswith(":"):
            continue
        req = m.group(1)
        if req.startswith("-e") or _name(req) in ("python", "pip"):
            continue
        deps[_name(req)] = req.replace(" ", "")
    return deps


def test_environment_yml_lists_every_runtime_dependency_with_the_same_bounds():
    assert _environment_yml() == _pyproject_runtime()


def test_environment_yml_installs_flashlab_with_test_extras():
    assert "-e .[test]" in (ROOT / "environment.yml").read_text()


def test_python_floor_matches():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["requires-python"] == ">=3.10"
    assert "python>=3.10" in (ROOT / "environment.yml").read_text()
