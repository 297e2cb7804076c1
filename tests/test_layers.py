"""The packages' import graph has no loops, lazy imports inside functions included.

A loop hidden behind a function-level import still couples the two modules both ways
(each needs the other to make sense), and it is how new loops usually creep in; so this
reads every ``import`` statement with ``ast``, wherever it sits, and asserts that the
module graph of ``service/``, of ``benchmarks/`` and of ``experiments/`` is acyclic.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` (any nesting depth).

    ``from a import b`` counts as importing ``a.b`` when that is a module and ``a``
    otherwise; relative imports are resolved against the importing module.
    """
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            for target in targets:
                # ``import a.b.c`` depends on the deepest module of ours that it names.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]


@pytest.mark.parametrize("package", ["service", "benchmarks", "experiments"])
def test_no_import_loops(package: str) -> None:
    graph = import_graph(package)
    found = cycles(graph)
    assert not found, "import loops:\n" + "\n".join(
        "  " + "; ".join(edges_within(graph, c)) for c in found
    )


def test_the_checker_sees_a_lazy_loop() -> None:
    # The checker itself: a loop closed by a function-level import is a loop.
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []
