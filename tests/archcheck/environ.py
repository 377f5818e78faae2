"""Who reads the process environment: ``os.environ`` and ``os.getenv`` outside the modules allowed to."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from archcheck.source import Module, where


def _reads(tree: ast.AST) -> list[int]:
    """Lines that touch the environment: ``os.environ``, ``os.getenv``, or either imported from os."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "getenv", "putenv", "unsetenv")):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            lines.append(node.lineno)
    return sorted(set(lines))


def environment_violations(modules: dict[str, Module], readers: Iterable[str], base: Path) -> list[str]:
    """Every place outside ``readers`` (module names; ``pkg.x`` also allows its submodules) that reads
    or writes the process environment."""
    allowed = tuple(readers)

    def may(name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in allowed)

    return [f"{where(m.path, line, base)} reads the process environment: read it through "
            f"{' or '.join(allowed)} (a field of its Environment), and never write it"
            for m in modules.values() if not may(m.name) for line in _reads(m.tree)]
