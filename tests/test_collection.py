"""The test modules that a machine without the Jupyter packages leaves out (``conftest.JUPYTER_TESTS``) are exactly
those that import one at load time, directly or through a module they import."""

from __future__ import annotations

import ast
import functools

from conftest import JUPYTER_TESTS, ROOT


@functools.cache  # every test file's walk meets the same package modules: each is parsed once
def _top_level_imports(path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return frozenset(names)


@functools.cache
def _source(module: str):
    """The file of a flashlab module or of a module in tests/, or None for any other."""
    parts = module.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py"),
                      ROOT / "tests" / f"{module}.py"):  # fmt: skip
        if (parts[0] == "flashlab" or "." not in module) and candidate.is_file():
            return candidate
    return None


def _needs(path, package: str, seen=None) -> bool:
    seen = set() if seen is None else seen
    if path in seen:
        return False
    seen.add(path)
    for module in _top_level_imports(path):
        if module == package or module.startswith(package + "."):
            return True
        source = _source(module)
        if source is not None and _needs(source, package, seen):
            return True
    return False


def test_the_modules_left_out_without_jupyter_are_those_that_import_it():
    for package, listed in JUPYTER_TESTS.items():
        needing = {p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if _needs(p, package)}
        assert needing == set(listed), f"{package}: import it at load time {sorted(needing)}, listed {listed}"


def test_no_gpu_test_is_left_out_with_them():
    # a GPU image without Jupyter still runs every GPU test
    for listed in JUPYTER_TESTS.values():
        for name in listed:
            assert "mark.gpu" not in (ROOT / "tests" / name).read_text(encoding="utf-8"), name
