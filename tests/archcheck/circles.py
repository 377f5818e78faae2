"""Import circles: strongly connected sets of modules, and one loop through each."""

from __future__ import annotations

from pathlib import Path

from archcheck.source import Import, Module, where


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _shortest_cycle(start: str, graph: dict[str, set[str]], within: set[str]) -> list[str]:
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & within):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def circle_violations(modules: dict[str, Module], imports: list[Import], base: Path) -> list[str]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for i in imports:
        if i.dst in modules and i.dst != i.src:
            graph[i.src].add(i.dst)
    out = []
    for comp in cycles(graph):
        members = set(comp)
        loop = _shortest_cycle(comp[0], graph, members)
        lines = [f"import circle: {' -> '.join(loop)}  (all of: {', '.join(comp)})"]
        for i in sorted(imports, key=lambda i: (i.src, i.line)):
            if i.src in members and i.dst in members and i.src != i.dst:
                lines.append(f"    {where(modules[i.src].path, i.line, base)} {i.how}{i.when}")
        out.append("\n".join(lines))
    return sorted(out)
