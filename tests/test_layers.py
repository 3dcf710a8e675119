"""The package's layers: every import points down, no module imports a private name from another, no cycles.

Read from the source with ``ast``, so imports inside functions count as much as those at the top of a file (a cycle
hidden in a function body is still a cycle). The layers, bottom to top:

    0  flashlab.core                               shapes, masks, tolerances, integers, checks (NumPy only)
    1  flashlab.reference, flashlab.calculators    the NumPy ground truth; the lesson's arithmetic and catalogues
    2  flashlab.kernels                            the Triton kernels
    3  the tools                                   bench, sdpa, exercises, grade, widgets, paged

A module may import from its own layer's package and from lower layers; the two packages of layer 1 are
independent of each other. The package root ``flashlab`` re-exports lazily and is imported from anywhere only for
``__version__``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from conftest import NOTEBOOKS, ROOT

PACKAGE = ROOT / "flashlab"

LAYERS = {
    "flashlab.core": 0,
    "flashlab.reference": 1,
    "flashlab.calculators": 1,
    "flashlab.kernels": 2,
    "flashlab.bench": 3,
    "flashlab.sdpa": 3,
    "flashlab.exercises": 3,
    "flashlab.grade": 3,
    "flashlab.widgets": 3,
    "flashlab.paged": 3,
    "flashlab.distributed": 3,
}
# What the root re-exports, and where it comes from.
ROOT_EXPORTS = {"flash_attention": "flashlab.kernels.forward", "__version__": None}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def top_package(module: str) -> str:
    """``flashlab.kernels.forward`` -> ``flashlab.kernels``; the unit the layers are drawn in."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def imports_of(tree: ast.AST, module: str, is_package: bool):
    """Every (imported module, imported names) in a module's source, at any depth, relative imports resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)


def flashlab_edges():
    """(importer, imported module, names) for every import of a flashlab module by a flashlab module."""
    edges = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, names in imports_of(tree, name, path.name == "__init__.py"):
            if target != "flashlab" and not target.startswith("flashlab."):
                continue
            if target == "flashlab":  # `from flashlab import x`: a submodule, or one of the root's re-exports
                for n in names:
                    if n in ROOT_EXPORTS:
                        if ROOT_EXPORTS[n]:
                            edges.append((name, ROOT_EXPORTS[n], (n,)))
                    else:
                        edges.append((name, f"flashlab.{n}", ()))
                continue
            if names and all(f"{target}.{n}" in MODULES for n in names):  # `from flashlab.kernels import forward`
                edges.extend((name, f"{target}.{n}", ()) for n in names)
            else:
                edges.append((name, target, names))
    return edges


EDGES = flashlab_edges()


def test_every_module_has_a_layer():
    unplaced = sorted({top_package(m) for m in MODULES} - set(LAYERS) - {"flashlab"})
    assert not unplaced, f"packages with no layer in tests/test_layers.py: {unplaced}"


def test_imports_point_down():
    wrong = []
    for importer, target, _ in EDGES:
        src, dst = top_package(importer), top_package(target)
        if src == "flashlab":  # the root's lazy re-exports
            continue
        if src == dst:
            continue
        if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and LAYERS[src] < 3):
            wrong.append(f"{importer} imports {target} (layer {LAYERS[src]} -> {LAYERS[dst]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_root_imports_nothing_at_import_time():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not top_level, "flashlab/__init__.py must stay import-free (torch and triton load on first use)"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _graph(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for importer, target, _ in edges:
        if importer != target and target in MODULES and importer != "flashlab":
            graph.setdefault(importer, set()).add(target)
    return graph


def test_no_import_cycles_between_modules():
    cycle = _cycle(_graph(EDGES))
    assert cycle is None, "import cycle (imports inside functions included): " + " -> ".join(cycle)


def test_no_import_cycles_between_packages():
    packages: dict[str, set[str]] = {}
    for importer, target, _ in EDGES:
        src, dst = top_package(importer), top_package(target)
        if src != dst and src != "flashlab":
            packages.setdefault(src, set()).add(dst)
    cycle = _cycle(packages)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    # the two tests above can fail: a hand-made cycle, two deep and through a function-level import, is found
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    src = "def f():\n    from flashlab.bench import x\n"
    found = list(imports_of(ast.parse(src), "flashlab.kernels.forward", False))
    assert found == [("flashlab.bench", ("x",))]
    assert _cycle({"x": {"y"}, "y": set()}) is None


def _code_sources():
    """(label, source) of every Python file of the package, the scripts and the tests, and every notebook cell."""
    for path in [
        *sorted(PACKAGE.rglob("*.py")),
        *sorted((ROOT / "scripts").glob("*.py")),
        *sorted(ROOT.glob("tests/*.py")),
    ]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for nb_path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                source = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
                yield f"{nb_path.name} cell {i}", source


def test_no_private_name_is_imported_from_another_module():
    found = []
    for label, source in _code_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:  # an exercise stub left for the learner to complete
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashlab"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{label}: from {node.module} import {', '.join(private)}")
            if isinstance(node, ast.Import):
                found += [
                    f"{label}: import {a.name}"
                    for a in node.names
                    if any(p.startswith("_") for p in a.name.split(".")[1:])
                ]
    assert not found, "private names imported across modules (make them public in the lower module):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "name", ["flashlab.core", "flashlab.core.masking", "flashlab.core.numerics", "flashlab.reference"]
)
def test_the_lower_layers_do_not_need_torch(name):
    # core and the NumPy reference import without torch or triton: check the modules they pull in
    seen, todo = set(), [name]
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in MODULES:
            continue
        seen.add(mod)
        tree = ast.parse(MODULES[mod].read_text())
        for target, _ in imports_of(tree, mod, MODULES[mod].name == "__init__.py"):
            assert target.split(".")[0] not in ("torch", "triton"), f"{mod} imports {target}"
            todo.append(target)
