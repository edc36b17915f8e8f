"""The import graph of ``oobleck/``, ``baselines/`` and ``analysis/`` has no cycles.

Each module is parsed with ``ast`` (nothing is imported), and every ``import`` counts wherever it
stands (module level or inside a function: a function-level import still ties the two files
together, it only hides the cycle until the function runs), except those under
``if TYPE_CHECKING:``, which never run. An import names the deepest project module it reaches
(``from oobleck.planning import outputs`` is ``oobleck.planning.outputs``;
``from oobleck.planning import ExecutionPlan`` is the package ``oobleck.planning``). Importing a
module also runs its parents' ``__init__``; that implicit edge is not counted (a package's own
``__init__`` importing its submodules would otherwise be a cycle by construction).

Two graphs are checked: modules as nodes, and packages as nodes (``oobleck.runtime``,
``oobleck.checkpoint``, ``oobleck.config``, ...: the first two parts of a module's name), so that
``runtime`` using ``checkpoint`` while ``checkpoint`` uses ``runtime`` fails even when no two files
import each other. A failure names the cycle, one import per edge.

``planning/`` is the planner every part shares and runs without torch: no module of it may import
torch, even through another project module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("oobleck", "baselines", "analysis")


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it stands."""

    target: str  # a project module, or the top-level name of a third-party one
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, except under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _type_checking(child):
            for statement in child.orelse:
                yield from _statements(ast.Module(body=[statement], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _statements(child)


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def raw_imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of everything a module imports; ``from a import b`` is ``a.b`` (the
    module ``a.b``, or the name ``b`` of module ``a``: ``_resolve`` tells them apart)."""
    found: list[tuple[str, int]] = []
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        else:
            base = _absolute(name, path.name == "__init__.py", node)
            found += [(base if alias.name == "*" else f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _resolve(dotted: str, modules: dict[str, Path]) -> str:
    """The deepest project module ``dotted`` names, or its top-level name when it is not ours."""
    name = dotted
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or dotted.partition(".")[0]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module -> line of the first import of it} (project modules only)."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for dotted, line in raw_imports(name, path):
            target = _resolve(dotted, modules)
            if target in modules and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """package -> {imported package -> one module-level import that makes the edge, as text}."""
    packages: dict[str, dict[str, str]] = {}
    for source, edges in graph.items():
        for target, line in edges.items():
            a, b = package_of(source), package_of(target)
            packages.setdefault(b, {})
            if a != b:
                packages.setdefault(a, {}).setdefault(b, f"{source}:{line} imports {target}")
    return packages


def find_cycle(graph: dict[str, dict[str, object]]) -> list[str] | None:
    """One cycle of the graph as its nodes in order (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def describe(cycle: list[str], edge: object) -> str:
    return "\n".join(f"  {a} -> {b}  ({edge(a, b)})" for a, b in zip(cycle, cycle[1:]))  # type: ignore[operator]


def test_no_module_imports_itself_back() -> None:
    modules = project_modules()
    graph = import_graph(modules)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between modules:\n" + describe(
        cycle, lambda a, b: f"{modules[a].relative_to(REPO)}:{graph[a][b]}"
    )


def test_no_package_imports_itself_back() -> None:
    packages = package_graph(import_graph(project_modules()))
    cycle = find_cycle(packages)
    assert cycle is None, "import cycle between packages:\n" + describe(cycle, lambda a, b: packages[a][b])


def test_planning_never_imports_torch() -> None:
    modules = project_modules()
    for name in modules:
        if not name.startswith("oobleck.planning"):
            continue
        seen, todo = {name}, [name]
        while todo:
            current = todo.pop()
            for dotted, line in raw_imports(current, modules[current]):
                target = _resolve(dotted, modules)
                assert target != "torch", f"{name} reaches torch: {modules[current].relative_to(REPO)}:{line}"
                if target in modules and target not in seen:
                    seen.add(target)
                    todo.append(target)


def test_shipped_code_never_imports_the_test_helpers() -> None:
    """``testing/`` is not in the wheel: an import of it from the package would fail once installed."""
    modules = project_modules()
    for name, path in modules.items():
        for dotted, line in raw_imports(name, path):
            assert dotted.partition(".")[0] != "testing", f"{path.relative_to(REPO)}:{line} imports {dotted}"


def test_the_checker_finds_cycles(tmp_path: Path) -> None:
    """The graph code on a made-up tree: a function-level cycle is found, a TYPE_CHECKING one is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    modules = {f"pkg.{p.stem}" if p.stem != "__init__" else "pkg": p for p in package.glob("*.py")}
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.c": 2} and graph["pkg.c"] == {}
    assert find_cycle(graph) is None
    (package / "c.py").write_text("import os\n\ndef h():\n    import pkg.a\n")
    cycle = find_cycle(import_graph(modules))
    assert cycle == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    packages = package_graph({"x.p.m": {"x.q.n": 3}, "x.q.n": {"x.r": 1}, "x.r": {"x.p.k": 9}, "x.p.k": {}})
    assert find_cycle(packages) == ["x.p", "x.q", "x.r", "x.p"]
