"""Private names reached across modules, in the package and from tests, benchmarks and examples."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from archcheck.source import Module, import_call_target, is_private, ours, where

ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


@functools.cache  # a tree is asked again for each check and each file of the tests; trees hash by identity
def defined_names(tree: ast.AST) -> frozenset[str]:
    """Names this source defines: defs, classes, assignments, ``self._x = ...``, class annotations, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.Call) and _attr_call(node) == "setattr" and _is_own(node.args[0]):
            names.add(node.args[1].value)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                         and isinstance(c.value, str))
    return frozenset(names)


def _is_own(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _attr_call(node: ast.Call) -> str | None:
    """``getattr`` and kin (also ``monkeypatch.setattr``) with a literal name as second argument."""
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    if name in ATTR_FUNCS and len(node.args) >= 2:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return name
    return None


def _base_name(node: ast.AST) -> ast.Name | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node if isinstance(node, ast.Name) else None


@dataclass(frozen=True)
class PrivateUse:
    line: int
    name: str  # the private name
    text: str  # what the code does, for the message
    imported_from: str | None  # the module a name bound by an import came from, else None


def _from_module(node: ast.ImportFrom, package: str | None) -> str | None:
    """The absolute module of ``from ... import``; ``package``: where relative imports start."""
    if not node.level:
        return node.module
    if package is None:
        return None
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_bindings(tree: ast.AST, top: str | None = None, package: str | None = None,
                    modules: Iterable[str] = ()) -> dict[str, str]:
    """Local names bound by imports (of ``top``'s modules only, when given) -> the module they came from.

    ``from pkg import x`` binds ``x`` to ``pkg.x`` where that is one of ``modules``.
    """
    modules = set(modules)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if top is None or ours(a.name, top):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (src := _from_module(node, package)):
            if top is None or ours(src, top):
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    bound[a.asname or a.name] = sub if sub in modules else src
        elif isinstance(node, ast.Assign) and (t := import_call_target(node.value)):
            if top is None or ours(t, top):
                for tgt in node.targets:
                    if isinstance(tgt, ast.Name):
                        bound[tgt.id] = t
    return bound


def private_uses(tree: ast.AST, here: str | None, top: str, bindings: dict[str, str],
                 package: str | None = None) -> list[PrivateUse]:
    """Every reach for a private name that this source may not define itself.

    ``from pkg.x import _y``; ``x._y`` or ``getattr(x, "_y")`` where ``x`` is bound by an import (the
    use names that module); and ``obj._y`` / ``getattr(obj, "_y")`` on anything but ``self``, ``cls``
    or ``super()``, where this source defines no ``_y`` (``imported_from`` None).
    """
    own = defined_names(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (src := _from_module(node, package)) and ours(src, top):
            uses.extend(PrivateUse(node.lineno, a.name, f"from {src} import {a.name}", src)
                        for a in node.names if is_private(a.name) and src != here)
        elif isinstance(node, ast.Import):
            uses.extend(PrivateUse(node.lineno, p, f"import {a.name}", a.name)
                        for a in node.names if ours(a.name, top) for p in a.name.split(".") if is_private(p))
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            uses.extend(_reach(node.lineno, node.value, node.attr, ast.unparse(node), own, bindings))
        elif isinstance(node, ast.Call) and (fn := _attr_call(node)):
            name = node.args[1].value
            if is_private(name) and not (fn == "setattr" and _is_own(node.args[0])):
                uses.extend(_reach(node.lineno, node.args[0], name, ast.unparse(node), own, bindings))
    return uses


def _reach(line: int, obj: ast.AST, name: str, text: str, own: frozenset[str], bindings: dict[str, str]):
    base = _base_name(obj)
    if base is not None and base.id in bindings:
        yield PrivateUse(line, name, text, bindings[base.id])
    elif not _is_own(obj) and name not in own:
        yield PrivateUse(line, name, text, None)


def private_violations(modules: dict[str, Module], top: str, base: Path,
                       exceptions: dict[tuple[str, str], str]) -> list[str]:
    """Private names reached across the package's modules (of the package or of any other library).

    ``exceptions``: (file relative to ``base``, private name) -> the one-line reason it is allowed.
    """
    index = private_index(modules)
    out = []
    for name, mod in modules.items():
        package = name if mod.is_package else name.rpartition(".")[0]
        rel = str(mod.path.relative_to(base))
        for u in _unique(private_uses(mod.tree, name, top, import_bindings(mod.tree, None, package, modules),
                                      package)):
            if u.imported_from == name or (rel, u.name) in exceptions:
                continue
            if u.imported_from:
                why = f"{u.name} is private to {u.imported_from}"
            else:
                elsewhere = ", ".join(sorted(index.get(u.name, ())))
                why = f"{u.name} is not defined in {name}" + (f" but in {elsewhere}" if elsewhere else "")
            out.append(f"{where(mod.path, u.line, base)} {u.text}: {why}")
    return out


def _unique(uses: Iterable[PrivateUse]) -> list[PrivateUse]:
    """One use per line and text (``x._y = f(x._y)`` is one use), in the order of the lines."""
    return sorted(set(uses), key=lambda u: (u.line, u.text))


def private_index(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Every private name defined anywhere in the package -> the modules defining it."""
    index: dict[str, set[str]] = {}
    for name, mod in modules.items():
        for n in defined_names(mod.tree):
            if is_private(n):
                index.setdefault(n, set()).add(name)
    return index


DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def outside_violations(files: Iterable[Path], modules: dict[str, Module], top: str, base: Path,
                       exceptions: dict[tuple[str, str], str]) -> list[str]:
    """Private names of the package used in other code (tests, benchmarks, examples).

    A use counts when it goes through a name imported from the package, names a private that the
    package defines and this file does not, or patches a dotted path (``"pkg.x._y"``) of the package.
    ``exceptions``: (file relative to ``base``, private name) -> the one-line reason it is allowed.
    """
    index = private_index(modules)
    out = []
    for path in sorted(files):
        rel = str(path.relative_to(base))
        tree = ast.parse(path.read_text(), str(path))
        uses = [u for u in private_uses(tree, None, top, import_bindings(tree, top, None, modules))
                if u.imported_from is not None or u.name in index]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
                parts = node.value.split(".")
                first = next((k for k, p in enumerate(parts) if is_private(p)), None)
                if ours(node.value, top) and first is not None:
                    uses.append(PrivateUse(node.lineno, parts[first], repr(node.value), ".".join(parts[:first])))
        for u in _unique(uses):
            if (rel, u.name) in exceptions:
                continue
            origin = u.imported_from or ", ".join(sorted(index[u.name]))
            out.append(f"{rel}:{u.line} {u.text}: {u.name} is private to {origin}")
    return out
