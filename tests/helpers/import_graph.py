"""The project's import graph, read from the source with ast (nothing is imported): modules, edges, cycles, and
imports of project modules made inside functions."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
LAZY = "# lazy:"  # a function-level import that says why (an optional heavy dependency) is allowed
PACKAGES = {"flash_forensics": "flash_forensics", "flash_forensics.kernels": "kernels",
            "flash_forensics.models": "models", "flash_forensics.orchestrator": "orchestrator"}


@dataclass
class Graph:
    modules: Dict[str, Path]
    edges: Dict[str, Set[str]] = field(default_factory=dict)
    function_imports: List[Tuple[str, int, str]] = field(default_factory=list)  # (module, line, imported)

    def cycles(self) -> List[List[str]]:
        """Strongly connected components with more than one module (Tarjan), each sorted."""
        index: Dict[str, int] = {}
        low: Dict[str, int] = {}
        stack: List[str] = []
        on: Set[str] = set()
        out: List[List[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on.add(v)
            for w in sorted(self.edges.get(v, ())):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for v in sorted(self.modules):
            if v not in index:
                visit(v)
        return out


def _modules(packages: Dict[str, str]) -> Dict[str, Path]:
    mods = {}
    for pkg, folder in packages.items():
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            name = ".".join((pkg, *rel.parts))
            mods[name.removesuffix(".__init__")] = f
    return mods


def _targets(mods, current: str, node) -> Set[str]:
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = current.split(".")
            parts = parts if mods[current].name == "__init__.py" else parts[:-1]
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = set()
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n and n != current and not current.startswith(n + "."):
            found.add(n)
    return found


def build(packages: Dict[str, str] = PACKAGES) -> Graph:
    """The graph of the modules under `packages` ({import name: folder}; default the project's four)."""
    mods = _modules(packages)
    g = Graph(mods)
    for name, path in mods.items():
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        lines = text.split("\n")
        g.edges[name] = set()

        def walk(node, in_function: bool, name: str = name, lines=lines) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    t = _targets(mods, name, child)
                    g.edges[name] |= t
                    if in_function and LAZY not in lines[child.lineno - 1]:
                        g.function_imports += [(name, child.lineno, x) for x in sorted(t)]
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                walk(child, inner, name, lines)

        walk(tree, False)
    return g


if __name__ == "__main__":
    graph = build()
    print(f"{len(graph.modules)} modules, {sum(map(len, graph.edges.values()))} edges")
    print(f"cycles: {len(graph.cycles())}")
    for c in graph.cycles():
        print("  ", " <-> ".join(c))
    print(f"function-level project imports: {len(graph.function_imports)}")
    for m, line, t in graph.function_imports:
        print(f"   {m}:{line} -> {t}")
