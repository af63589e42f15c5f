"""No import cycles among the project's modules, lazy (function-level) imports included.

Why: a cycle makes import order matter (a module half-initialised when its partner reads it) and
ties two jobs together that should be separable; a lazy import only hides one from the
interpreter, not from the reader. The graph is read from the source with ``ast`` (nothing is
imported), so the test also covers modules that need root or a GPU to import usefully.
"""

from __future__ import annotations

import ast

from tests.importgraph import import_graph, modules
from tests.paths import REPO


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_project() -> None:
    mods = modules()
    assert "diag.demo.scenarios.runner" in mods and "collectors.records" in mods
    found = cycles(import_graph(mods))
    assert found == [], found


def test_collectors_never_import_diag() -> None:
    graph = import_graph(modules())
    bad = sorted((m, d) for m, deps in graph.items() if m.startswith("collectors") for d in deps if d.startswith("diag"))
    assert bad == []


def test_test_modules_never_import_each_other() -> None:
    """Shared test helpers live in helper modules (builders, livecg, promserver, conftest), not in test files."""
    bad = []
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(REPO)} imports {n}" for n in names if n.startswith("tests.") and ".test_" in n]
    assert bad == [], bad
