"""kvgen's modules import each other without circles: every ``import`` of a kvgen module, at the top of a file or
inside a function, is an edge of a graph that must have no cycle (a lazy import that closes a circle hides it,
and the next refactor trips on it). Registries stand where a module must reach the ones that import it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """kvgen module -> the kvgen modules it imports anywhere (``from package import module`` names the module)."""
    modules = {module_name(p): p for p in (SRC / "kvgen").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= named or {node.module}
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_a_circle():
    graph = import_graph()
    assert len(graph) > 60 and "kvgen.cache.base" in graph["kvgen.cache.dynamic"]  # the walk sees the package
    assert cycles(graph) == []


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kvgen_imports_in_a_fresh_process():
    subprocess.run([sys.executable, "-c", "import kvgen, kvgen.serving.engine, kvgen.cache.paged"], check=True)
