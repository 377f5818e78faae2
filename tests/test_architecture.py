"""The house rules of the package, checked from its source with ``ast``.

- no import circle between modules (imports inside functions count: they are circles all the same);
- no upward import: each part of the package has a layer (docs/architecture.md) and imports only
  from lower layers or from inside its own part;
- no ``_private`` name of one module used from another;
- no file over about 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagerloco"

#: Parts of the package from the bottom up; a part imports only from parts in lower layers.
LAYERS: list[set[str]] = [
    {"schedule", "codec_sizes", "units", "jsonfiles", "flops", "procs"},  # torch-free foundations
    {"codecs", "model", "evals", "fsdp", "checkpoint", "data", "device"},
    {"config"},
    {"fragments", "faults", "netshape", "flags"},
    {"comm"},
    {"outer"},
    {"train", "hooks"},
    {"launch", "sim", "compare", "integrations"},
    {"cli"},
    {"__main__"},
]
MAX_LINES = 600


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def scan(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The import graph of the package at ``root`` and the uses of another module's private names."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    packages = {module_name(p, root) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    private: list[str] = []
    top = root.name
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> package module it names
        for node in _nodes(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == top or a.name.startswith(top + "."):
                        graph[mod].add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod if mod in packages else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        here = here.rpartition(".")[0]
                    base = f"{here}.{base}" if base else here
                if not (base == top or base.startswith(top + ".")):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in files:
                        graph[mod].add(sub)
                        aliases[a.asname or a.name] = sub
                    else:
                        graph[mod].add(base)
                        if a.name.startswith("_") and not a.name.startswith("__") and base != mod:
                            private.append(f"{mod} imports {a.name} from {base}")
        for node in _nodes(tree):  # a second pass: every alias is known by now
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and target != mod and node.attr.startswith("_") and not node.attr.startswith("__"):
                    private.append(f"{mod} uses {target}.{node.attr}")
    for mod in graph:
        graph[mod] = {t for t in graph[mod] if t in files and t != mod}
    return graph, private


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


def part(mod: str) -> str:
    pieces = mod.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def layer_of(name: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if name in layer), None)


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        s = part(src)
        if s == "":  # the package's own __init__: a facade over the public API
            continue
        for dst in targets:
            d = part(dst)
            if d == s:
                continue
            ls, ld = layer_of(s), layer_of(d)
            if d == "" or ls is None or ld is None or ld >= ls:
                bad.append(f"{src} (layer {ls}) imports {dst} (layer {ld})")
    return bad


def test_no_import_circle() -> None:
    graph, _ = scan(PACKAGE)
    assert cycles(graph) == []


def test_every_part_has_a_layer_and_imports_only_downward() -> None:
    graph, _ = scan(PACKAGE)
    parts = {part(m) for m in graph} - {""}
    assert sorted(p for p in parts if layer_of(p) is None) == []
    assert upward(graph) == []


def test_no_private_name_crosses_a_module() -> None:
    _, private = scan(PACKAGE)
    assert private == []


def test_no_file_over_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A package with a circle through a function-level import, an upward import and a private import."""
    pkg = tmp_path / "eagerloco"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from eagerloco.train.loop import run\n")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("from eagerloco.config import f\nfrom eagerloco.schedule import _hidden\n"
                                           "def run():\n    pass\n")
    (pkg / "schedule.py").write_text("from eagerloco import config as c\n_hidden = 1\nx = c._secret\n")
    return pkg


def test_the_checks_catch_what_they_are_for(planted: Path) -> None:
    graph, private = scan(planted)
    # config -> train.loop (inside a function) -> schedule -> config
    assert cycles(graph) == [["eagerloco.config", "eagerloco.schedule", "eagerloco.train.loop"]]
    assert "eagerloco.config (layer 2) imports eagerloco.train.loop (layer 6)" in upward(graph)
    assert "eagerloco.schedule (layer 0) imports eagerloco.config (layer 2)" in upward(graph)
    assert sorted(private) == ["eagerloco.schedule uses eagerloco.config._secret",
                               "eagerloco.train.loop imports _hidden from eagerloco.schedule"]


@pytest.mark.processes
def test_the_parser_and_the_simulator_never_import_torch() -> None:
    """`eagerloco simulate` answers in well under a second because nothing on its path imports torch."""
    import subprocess
    import sys

    code = ("import sys; from eagerloco.cli import main; "
            "rc = main(['simulate', '--model', '1b', '--paper', '--bandwidth-gbps', '5']); "
            "assert rc == 0, rc; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
