"""The package's layers: every import points down, no module imports a private name from another, no cycles.

Read from the source with ``ast``, so imports inside functions count as much as those at the top of a file (a cycle
hidden in a function body is still a cycle). The layers, bottom to top:

    0  flashlab.core                               shapes, masks, tolerances, integers, checks (NumPy only)
    1  flashlab.reference, flashlab.calculators    the NumPy ground truth; the lesson's arithmetic and catalogues
    2  flashlab.kernels                            the Triton kernels: device code and one plain launch each
    3  flashlab.host                               the host engine: entry points, checks, plans, direct launches
    4  the tools                                   bench, sdpa, exercises, grade, widgets, kv_allocator

A module may import from its own layer's package and from lower layers; the two packages of layer 1 are
independent of each other. The package root ``flashlab`` re-exports lazily and is imported from anywhere only for
``__version__``. Plans live in the host engine alone: no module outside ``flashlab.host`` keeps a module-level
cache (``test_no_plan_cache_outside_the_host_engine``).
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
    "flashlab.host": 3,
    "flashlab.bench": 4,
    "flashlab.sdpa": 4,
    "flashlab.exercises": 4,
    "flashlab.grade": 4,
    "flashlab.widgets": 4,
    "flashlab.kv_allocator": 4,
    "flashlab.distributed": 4,
    "flashlab.tune": 4,
    "flashlab.warmup": 4,
}
TOOLS = 4  # the top layer, whose packages may import each other
# What the root re-exports, and where it comes from.
ROOT_EXPORTS = {
    "flash_attention": "flashlab.host",
    "flash_attention_with_kvcache": "flashlab.host",
    "check_kvcache_errors": "flashlab.host",
    "quantize_kv": "flashlab.host.quantize",
    "dequantize_kv": "flashlab.host.quantize",
    "flash_attention_varlen": "flashlab.host",
    "__version__": None,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def top_package(module: str) -> str:
    """``flashlab.kernels.decode.split_kv`` -> ``flashlab.kernels``; the unit the layers are drawn in."""
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
        if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and LAYERS[src] < TOOLS):
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
    found = list(imports_of(ast.parse(src), "flashlab.kernels.decode.split_kv", False))
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


# Inside flashlab.kernels imports point one way too: the shared pieces at the bottom, then the kernels' folders.
KERNEL_BASE = (
    "flashlab.kernels.configs",
    "flashlab.kernels.device",
    "flashlab.kernels.error_record",
    "flashlab.kernels.gluon_hopper",
    "flashlab.kernels.interpreter",
    "flashlab.kernels.interpreter_rounding",
    "flashlab.kernels.softmax_step",
)


def test_inside_the_kernels_imports_point_one_way():
    wrong = []
    for importer, target, _ in EDGES:
        if not (importer.startswith("flashlab.kernels") and target.startswith("flashlab.kernels.")):
            continue
        if importer in KERNEL_BASE:
            if target not in KERNEL_BASE or target == importer:
                wrong.append(f"{importer} imports {target}")
            continue
        folder = ".".join(importer.split(".")[:3])  # flashlab.kernels.ladder, .decode, .backward
        if not (target in KERNEL_BASE or target.startswith(folder)):
            wrong.append(f"{importer} imports {target}")
    assert not wrong, "kernel modules that import sideways:\n" + "\n".join(wrong)


# Module-level caches outside the host engine that are no plan, and why. Anything else a module outside
# flashlab.host keeps at module level and fills while it runs is a second plan cache, and fails the test below.
NOT_PLANS = {
    "flashlab.kernels.configs:_bucket_config": "the tile config of a length bucket, one per bucket (bounded)",
    "flashlab.kernels.configs:_table": "a tuned-config table file as read, one per file (bounded)",
    "flashlab.kernels.interpreter:_INTERPRETED": "interpreted copies of @triton.jit functions, one per function",
    "flashlab.kernels.device:smem_limit": "a device query (shared memory per block), one per GPU",
    "flashlab.kernels.device:sm_count": "a device query (multiprocessors), one per GPU",
    "flashlab.kernels.backward.rung1_two_pass:_SIDE_STREAMS": "the dQ kernel's side stream, one per GPU",
    "flashlab.kernels.gluon_hopper:_LAYOUTS": "shared-memory layouts of a tile shape and dtype",
    "flashlab.kernels.ladder.rung4_overlap:_METAS": "constexpr dicts, one per head dim, tiles and mask kind",
    "flashlab.kernels.ladder.rung3_hopper:_REPAIR_METAS": "the repair pass's constexprs, one per head dim and dtype",
    "flashlab.kernels.ladder.tile_schedule:_TABLES": "device copies of a schedule table, one per lengths",
}
CACHE_DECORATORS = {"cache", "lru_cache", "cached_property"}
MUTATING_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__"}


def module_caches(tree: ast.Module) -> list[str]:
    """Names of a module's caches: module-level dicts (``{}``, ``dict()``, ``OrderedDict()``, ``defaultdict()``)
    that a function writes into, and functions memoised with ``functools.cache`` / ``lru_cache``."""
    mappings = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        called = value.func if isinstance(value, ast.Call) else None
        name = getattr(called, "attr", None) or getattr(called, "id", None)
        if isinstance(value, ast.Dict) or name in ("dict", "OrderedDict", "defaultdict"):
            mappings |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                deco = deco.func if isinstance(deco, ast.Call) else deco
                if (getattr(deco, "attr", None) or getattr(deco, "id", None)) in CACHE_DECORATORS:
                    found.add(node.name)
            for inner in ast.walk(node):
                if isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store):
                    if isinstance(inner.value, ast.Name) and inner.value.id in mappings:
                        found.add(inner.value.id)
                elif isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
                    owner = inner.func.value
                    if isinstance(owner, ast.Name) and owner.id in mappings and inner.func.attr in MUTATING_METHODS:
                        found.add(owner.id)
    return sorted(found)


def caches_outside_the_host(modules: dict[str, Path]) -> list[str]:
    return [
        f"{name}:{cache}"
        for name, path in modules.items()
        if name != "flashlab.host" and not name.startswith("flashlab.host.")
        for cache in module_caches(ast.parse(path.read_text(), filename=str(path)))
    ]


def test_no_plan_cache_outside_the_host_engine():
    # one plan cache (flashlab.host.plan.PLANS): a module-level dict filled at run time anywhere else is another
    found = caches_outside_the_host(MODULES)
    unexplained = sorted(set(found) - set(NOT_PLANS))
    assert not unexplained, "module-level caches outside flashlab.host (plans belong in flashlab.host.plan):\n" + (
        "\n".join(unexplained)
    )
    stale = sorted(set(NOT_PLANS) - set(found))
    assert not stale, f"NOT_PLANS names caches that are gone: {stale}"


def test_the_plan_cache_scan_finds_a_planted_cache(tmp_path):
    # the test above can fail: a plan dict planted in a kernel module, filled inside a function, is found, as is a
    # memoised function and an OrderedDict filled through a method; a constant table and a function's own dict are
    # not caches
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import collections, functools\n"
        "TABLE = {'a': 1}\n"
        "_PLANS: dict = {}\n"
        "_BY_KEY = collections.OrderedDict()\n"
        "def plan(key):\n"
        "    if key not in _PLANS:\n"
        "        _PLANS[key] = object()\n"
        "    _BY_KEY.setdefault(key, 1)\n"
        "    local = {}\n"
        "    local[key] = 1\n"
        "    return _PLANS[key], TABLE['a']\n"
        "@functools.lru_cache(maxsize=None)\n"
        "def planned(key):\n"
        "    return key\n"
    )
    modules = {"flashlab.kernels.planted": planted, "flashlab.host.planted": planted}
    assert caches_outside_the_host(modules) == [
        "flashlab.kernels.planted:_BY_KEY",
        "flashlab.kernels.planted:_PLANS",
        "flashlab.kernels.planted:planned",
    ]
