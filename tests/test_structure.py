"""The packages depend in one direction, and no module imports itself back through others."""

from __future__ import annotations

import ast

from tests.launching import REPO

# Lower layers first: a package may import only those to its left (and itself).
LAYERS = ["transport", "sim", "sft", "rlvla3", "roles"]


def _imports() -> dict[str, set[str]]:
    """Every project module and the project modules it imports (function-level ones too)."""
    modules = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def test_packages_depend_in_one_direction() -> None:
    rank = {package: i for i, package in enumerate(LAYERS)}
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in _imports().items()
        for t in targets
        if rank[t.split(".")[0]] > rank[m.split(".")[0]]
    )
    assert not upward, f"imports of a higher layer ({' < '.join(LAYERS)}): {upward}"


def test_no_import_cycles() -> None:
    graph = _imports()
    cycles = []
    for start in graph:  # a depth-first walk from each module back to itself
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, f"import cycles: {sorted(set(cycles))[:5]}"
