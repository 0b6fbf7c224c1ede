"""The package's import graph, read from the source: cycles, layer rules and file lengths.

    python -m tests.harness.imports      # prints each module's imports, then cycles and violations

Modules are named as installed: autoshard/x.py is autoshard.x, passes/x.py autoshard.passes.x,
kernels/x.py autoshard.kernels.x. Every import statement counts, wherever it is in the file.
"""
from __future__ import annotations

import ast
import pathlib
import sys

__all__ = ["ALLOWED", "CALLS_UP", "TOP_LEVEL", "import_graph", "cycles", "layer_violations", "long_files"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
_DIRS = {"autoshard": "autoshard", "passes": "autoshard.passes", "kernels": "autoshard.kernels"}

# subsystem -> the subsystems it may import (besides itself and the leaf modules below)
LEAVES = {"errors", "bounds", "module_paths", "factory", "png"}
ALLOWED: dict[str, set[str]] = {
    "world": set(),
    "kernels": set(),
    "parallel": {"world"},
    "passes": {"parallel", "kernels"},
    "runtime": {"parallel", "passes", "world"},
    "regions": {"parallel", "passes", "world"},          # what outlined regions run at step time
    "compile": {"parallel", "passes", "regions", "runtime", "kernels", "world"},
    "planning": {"compile", "regions", "runtime", "world", "parallel", "passes", "kernels"},     # the meta copy of a rank
    "checkpoint": {"compile", "runtime", "parallel", "passes", "world"},
    "models": set(),
    **{leaf: set() for leaf in LEAVES},
}
# The imports that go up a layer, each inside a function (run at call time, never at import) and each
# named here with its reason; both checks leave them out. No registry hides one.
CALLS_UP: dict[tuple[str, str], str] = {
    ("autoshard.compile.program", "autoshard.verify.run"):
        "ShardedProgram.verify() hands the program to the user layer's certificate (verify_program)",
}
TOP_LEVEL = {"api", "cli", "demo", "testing", "train", "verify", "cpu_profile", "__init__"}     # the user-facing layer: may import anything


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    name = ".".join([_DIRS[parts[0]], *parts[1:]])
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the autoshard modules it imports (a name imported from a package that is a
    module of it counts as that module)."""
    files = [p for d in _DIRS for p in (ROOT / d).rglob("*.py")]
    names = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        module = _module_name(path)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in names and t != module and (module, t) not in CALLS_UP}
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (sorted), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _subsystem(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        mine = _subsystem(module)
        if mine in TOP_LEVEL:
            continue
        for dep in sorted(deps):
            theirs = _subsystem(dep)
            if theirs != mine and theirs not in LEAVES and theirs not in ALLOWED.get(mine, set()):
                out.append(f"{module} imports {dep} ({mine} may not import {theirs})")
    return out


def long_files(limit: int) -> list[str]:
    """Source files (autoshard/, passes/, kernels/) longer than `limit` lines."""
    return [f"{p.relative_to(ROOT)}: {n} lines" for d in _DIRS for p in sorted((ROOT / d).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


if __name__ == "__main__":
    g = import_graph()
    for m in sorted(g):
        print(f"{m}: {', '.join(sorted(g[m])) or '-'}")
    print("cycles:", cycles(g) or "none")
    print("layer violations:", layer_violations(g) or "none")
    # one concept per file; length is a hint to look, never a reason to split (STYLE.md)
    print("files over 600 lines (worth a look):", long_files(600) or "none")
