"""The package's import graph: no circle, imports point down the layers, every package declared.

Read from the source (``ast``), so a test needs no import of the package and sees every module,
including those no test imports. Relative imports are resolved against the importing module's
package; ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module.
"""
from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The parts of zoo, bottom up, each with the parts right below it (DESIGN.md, "Layers"): a part
# may import those and, transitively, everything below them. zoo/__init__.py, the public API,
# sits on top and may import anything; nothing in the package imports it.
LAYERS: dict[str, tuple[str, ...]] = {
    "zoo._torch": (),
    "zoo._subclass": (),
    "zoo.checkpoint": ("zoo._torch", "zoo._subclass"),
    "zoo.reversible": ("zoo.checkpoint",),
    "zoo.nn": ("zoo.checkpoint",),
    "zoo.blocks": ("zoo.checkpoint", "zoo.nn"),  # checkpoint_module converts spectral norm
    "zoo.memory": ("zoo.checkpoint", "zoo.nn", "zoo.reversible", "zoo.blocks"),
    "zoo.planner": ("zoo.memory",),
    "zoo.models": ("zoo.memory",),
    "zoo.integrations": ("zoo.models", "zoo.planner"),
    "zoo.train": ("zoo.integrations",),
}

# Import names of the packages pyproject.toml declares, where they differ from the distribution's
IMPORT_NAMES = {"pyyaml": "yaml"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of zoo/: its dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted((ROOT / "zoo").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _runs_at_import(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports of a module's top level, in ``if``/``try``/``with`` blocks too, and those
    under ``if TYPE_CHECKING:`` (two modules that need each other's names form a circle even
    where only a type checker follows it); not those inside functions or classes."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _runs_at_import(node.body)
            yield from _runs_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _runs_at_import(block)
        elif isinstance(node, ast.With):
            yield from _runs_at_import(node.body)


def _imported_names(name: str, nodes: list[ast.Import | ast.ImportFrom]) -> Iterator[str]:
    """The absolute dotted names ``nodes`` (in module ``name``) import."""
    is_package = MODULES[name][1]
    package = name.split(".") if is_package else name.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        if node.level:
            base = package[:len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            yield f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module


def _zoo_imports(name: str, module_level: bool) -> set[str]:
    """The modules of zoo that module ``name`` imports (at import time, or anywhere)."""
    tree = ast.parse(MODULES[name][0].read_text())
    nodes = (list(_runs_at_import(tree.body)) if module_level else
             [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))])
    found = set()
    for target in _imported_names(name, nodes):
        while target and target not in MODULES:  # zoo.checkpoint.region.name -> the module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _part(module: str) -> str:
    """The layer a module belongs to: zoo.planner.search.front -> zoo.planner; zoo -> zoo."""
    return ".".join(module.split(".")[:2])


def _circles() -> list[list[str]]:
    """The import circles among zoo's modules at import time: the strongly connected
    components of more than one module (Tarjan's algorithm, iterative)."""
    graph = {m: sorted(_zoo_imports(m, module_level=True)) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _below(part: str) -> set[str]:
    """Every part ``part`` may import: those LAYERS names under it, and theirs, transitively."""
    allowed, todo = set(), list(LAYERS[part])
    while todo:
        lower = todo.pop()
        if lower not in allowed:
            allowed.add(lower)
            todo.extend(LAYERS[lower])
    return allowed


def test_the_walk_finds_the_package_and_resolves_relative_imports():
    """The graph the tests below read is the real one: known modules, known edges."""
    assert {"zoo", "zoo.nn", "zoo.checkpoint", "zoo.reversible.rebuild"} <= set(MODULES)
    assert "zoo.checkpoint" in _zoo_imports("zoo.nn", module_level=True)
    assert "zoo.checkpoint" in _zoo_imports("zoo", module_level=True)
    assert "zoo.reversible.coupling" in _zoo_imports("zoo.reversible.rebuild", module_level=True)


@pytest.mark.parametrize("part", ["zoo", *LAYERS])
def test_no_import_circle(part):
    """No two modules need each other to import, in any part of the package."""
    touching = [c for c in _circles() if any(_part(m) == part for m in c)]
    assert not touching, f"import circles through {part}: {touching}"


def test_every_module_is_in_a_layer():
    """A new top-level module or package is placed in LAYERS, where DESIGN.md puts it."""
    unplaced = sorted({_part(m) for m in MODULES} - set(LAYERS) - {"zoo"})
    assert not unplaced, f"{unplaced} in no layer: add them to LAYERS in {Path(__file__).name}"


@pytest.mark.parametrize("part", list(LAYERS))
def test_imports_point_down_the_layers(part):
    """A part imports only the parts below it, inside functions too (where a late import
    would hide an upward one); none imports the package's top, zoo/__init__.py."""
    allowed = _below(part) | {part}
    upward = sorted((m, t) for m in MODULES if _part(m) == part
                    for t in _zoo_imports(m, module_level=False) if _part(t) not in allowed)
    assert not upward, f"{part} may import only {sorted(allowed)}; found {upward}"


def _third_party() -> dict[str, set[str]]:
    """The packages outside the standard library that zoo's modules import: top name -> files."""
    found: dict[str, set[str]] = {}
    for name, (path, _) in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top != "zoo" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    """What the library imports is in pyproject.toml's dependencies, so ``pip install`` brings
    it; and the library imports nothing of scripts/ (the benchmark package ``bench``)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    declared = {IMPORT_NAMES.get(d, d) for d in names}
    imported = _third_party()
    assert "bench" not in imported and "scripts" not in imported
    missing = {top: sorted(files) for top, files in imported.items() if top not in declared}
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"
