"""The packages depend in one direction, and no module imports itself back through others."""

from __future__ import annotations

import ast

from tests.launching import REPO

# Lower layers first: a package may import only those to its left (and itself).
LAYERS = ["transport", "sim", "sft", "rlvla3", "roles"]
# The same inside rlvla3: its subpackages, then its top-level modules (the CLI, the reference
# pages), which may import any of them.
RLVLA3_LAYERS = ["config", "runtime", "policy", "algo", "launch", "monitor", "(top level)"]


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


def _rlvla3_layer(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if (REPO / "rlvla3" / parts[1]).is_dir() else "(top level)"
    if name not in RLVLA3_LAYERS:
        raise AssertionError(f"{module}: rlvla3.{name} is not in RLVLA3_LAYERS; place it there")
    return RLVLA3_LAYERS.index(name)


def test_rlvla3_subpackages_depend_in_one_direction() -> None:
    graph = _imports()
    inside = [m for m in graph if m.startswith("rlvla3.") and m != "rlvla3"]
    upward = sorted(
        f"{m} -> {t}"
        for m in inside
        for t in graph[m]
        if t.startswith("rlvla3.") and _rlvla3_layer(t) > _rlvla3_layer(m)
    )
    assert not upward, f"imports of a higher rlvla3 layer ({' < '.join(RLVLA3_LAYERS)}): {upward}"


def test_rlvla3_top_level_stays_small() -> None:
    modules = [p.name for p in (REPO / "rlvla3").glob("*.py")]
    assert len(modules) <= 12, f"rlvla3/ has {len(modules)} top-level modules: {sorted(modules)}"


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
