"""No import cycle among kvdbg's own modules, counting imports inside functions.

A cycle hidden by a function-level import still couples two modules both ways;
this test parses every module's source with ``ast`` (nothing is imported), so
an import in any function counts as much as one at the top. Imports under
``if TYPE_CHECKING:`` never run and are left out. ``importlib.import_module``
of a module named in a string constant (the backend and command registries)
counts as an import of that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

# Source directory -> package it is installed as (pyproject's package-dir).
PACKAGES = {"kvdbg": "kvdbg", "backends": "kvdbg.backends"}


def _module_files() -> dict[str, Path]:
    out = {}
    for directory, package in PACKAGES.items():
        for path in sorted((Path(ROOT) / directory).rglob("*.py")):
            parts = list(path.relative_to(Path(ROOT) / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` loads: itself, else its nearest project ancestor; None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Project modules ``module`` imports anywhere (module level or in a function) -> the first line that does."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    dynamic = "import_module" in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        target = _resolve(name, modules) if name else None
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                # ``from pkg import sub`` loads the submodule when there is one, else takes a name from pkg.
                submodule = f"{origin}.{alias.name}"
                add(submodule if submodule in modules else origin, node.lineno)
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.split(":")[0]
            if name in modules:
                add(name, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = _module_files()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                return paths[node] + [start]
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return component


def test_the_graph_sees_project_modules_and_function_level_imports():
    graph = import_graph()
    assert "kvdbg.backends.flex" in graph and "kvdbg.cli.replay" in graph
    # A function-level import (the replay command loads the replay core only when run).
    assert "kvdbg.replayer.runner" in graph["kvdbg.cli.replay"]
    # The backend registry loads its modules by name through importlib.
    assert "kvdbg.backends.flashinfer_ts" in graph["kvdbg.backends"]


def test_find_cycles_reports_a_cycle_through_function_level_imports(tmp_path):
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 1}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert _one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle_among_project_modules():
    graph = import_graph()
    cycles = find_cycles(graph)
    lines = []
    for component in cycles:
        path = _one_cycle(graph, component)
        steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:]))
        lines.append(f"{', '.join(component)}\n    e.g. {steps} -> {path[-1]}")
    assert not cycles, "import cycles among project modules:\n  " + "\n  ".join(lines)


# The packages from the bottom up: a module may import its own package and any package of a lower rank,
# never one of its rank or above (docs/architecture.md draws the same). The root package ``kvdbg`` names
# the public API lazily (its table of names is not an import at start-up) and is left out.
LAYERS = (
    ("kvdbg.errors", "kvdbg._version", "kvdbg.fixtures"),
    ("kvdbg.util",),
    ("kvdbg.judge",),
    ("kvdbg.ts",),
    ("kvdbg.snapshot",),
    ("kvdbg.backends",),
    ("kvdbg.replayer",),
    ("kvdbg.moves", "kvdbg.capture", "kvdbg.importers"),
    ("kvdbg.sentinel", "kvdbg.fleet"),
    ("kvdbg.vllm_plugin",),
    ("kvdbg.api", "kvdbg.render"),
    ("kvdbg.cli",),
    ("kvdbg.__main__",),
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str | None:
    """The layer package ``module`` belongs to (the longest prefix in LAYERS); None for the root package."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        source = package_of(module)
        for target, line in sorted(targets.items()):
            into = package_of(target)
            if None in (source, into) or source == into:
                continue
            if RANK[into] >= RANK[source]:
                bad.append(f"{module} (line {line}) imports {target}: {source} may not import {into}")
    return bad


def test_every_module_belongs_to_a_layer():
    assert [m for m in import_graph() if m != "kvdbg" and package_of(m) is None] == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"kvdbg.snapshot.store": {"kvdbg.replayer.runner": 12}, "kvdbg.replayer.runner": {},
             "kvdbg.moves.shrinker": {"kvdbg.capture.prepare": 3}, "kvdbg.capture.prepare": {}}
    assert upward_imports(graph) == [
        "kvdbg.moves.shrinker (line 3) imports kvdbg.capture.prepare: kvdbg.moves may not import kvdbg.capture",
        "kvdbg.snapshot.store (line 12) imports kvdbg.replayer.runner: kvdbg.snapshot may not import kvdbg.replayer",
    ]


def test_imports_run_one_way_lower_packages_never_import_higher_ones():
    assert upward_imports(import_graph()) == []
