"""The package read from its source: modules, and every import of one of its modules."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (a dunder) and ``_`` are not."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Module:
    name: str  # dotted, "pkg" for pkg/__init__.py
    path: Path
    tree: ast.Module
    is_package: bool


@dataclass(frozen=True)
class Import:
    src: str  # the importing module
    dst: str  # the imported module (a module of the package where the name is one)
    line: int
    lazy: bool  # inside a function: runs when called, not when the module loads
    typing_only: bool  # under ``if TYPE_CHECKING:``: never runs
    how: str  # the statement, for messages

    @property
    def when(self) -> str:
        return " (under TYPE_CHECKING)" if self.typing_only else " (inside a function)" if self.lazy else ""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_package(root: Path) -> dict[str, Module]:
    mods = {}
    for p in sorted(root.rglob("*.py")):
        name = module_name(p, root)
        mods[name] = Module(name, p, ast.parse(p.read_text(), str(p)), p.name == "__init__.py")
    return mods


def where(path: Path, line: int, base: Path) -> str:
    return f"{path.relative_to(base)}:{line}"


def _is_type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node with (inside a function, under ``if TYPE_CHECKING:``)."""
    stack = [(tree, False, False)]
    while stack:
        node, lazy, tc = stack.pop()
        yield node, lazy, tc
        in_func = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            under = tc or (_is_type_checking(node) and child in node.body)
            stack.append((child, in_func, under))


def resolve_relative(mod: Module, level: int, name: str | None) -> str:
    here = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    for _ in range(level - 1):
        here = here.rpartition(".")[0]
    return f"{here}.{name}" if name else here


def import_call_target(node: ast.AST) -> str | None:
    """The literal module of ``importlib.import_module("x")``, ``import_module("x")``, ``__import__("x")``."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__"):
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    target = arg.value
    if target.startswith(".") and name == "import_module":
        pkg = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"), None)
        if not (isinstance(pkg, ast.Constant) and isinstance(pkg.value, str)):
            return None
        dots = len(target) - len(target.lstrip("."))
        base = pkg.value
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{target.lstrip('.')}"
    return target


def ours(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def imports_of(mod: Module, modules: dict[str, Module], top: str) -> list[Import]:
    """Every import of a module of the package ``top`` made by ``mod``, wherever it sits."""
    found = []
    for node, lazy, tc in walk(mod.tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for a in node.names:
                if ours(a.name, top):
                    found.append(Import(mod.name, a.name, line, lazy, tc, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(mod, node.level, node.module) if node.level else node.module or ""
            if not ours(base, top):
                continue
            by_dst: dict[str, list[str]] = {}
            for a in node.names:
                sub = f"{base}.{a.name}"
                by_dst.setdefault(sub if sub in modules else base, []).append(a.name)
            found.extend(Import(mod.name, dst, line, lazy, tc, f"from {base} import {', '.join(names)}")
                         for dst, names in by_dst.items())
        elif (target := import_call_target(node)) and ours(target, top):
            found.append(Import(mod.name, target, line, lazy, tc, ast.unparse(node)))
    return found


def all_imports(modules: dict[str, Module], top: str) -> list[Import]:
    return [i for m in modules.values() for i in imports_of(m, modules, top)]
