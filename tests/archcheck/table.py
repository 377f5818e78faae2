"""The "may import" table of docs/architecture.md, read mechanically, and the imports it forbids."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from archcheck.source import Import, Module, walk, where

TABLE_SECTION = "Who owns what"
#: A phrase of the table naming several labelled rows at once.
ALIASES: dict[str, tuple[str, ...]] = {"the leaves": ("the torch-free leaves", "the leaves with torch")}
#: The row of the package's experiments; the phrase "the library" names every other row.
LAB = "the lab"
#: Rows whose label or "owns" cell says one of these must not reach torch when loaded.
TORCH_FREE_MARKS = ("torch-free", "never imports torch")


@dataclass(frozen=True)
class Target:
    """A module (``x.py``) or a package with everything in it (``x/``), written as in the table."""

    text: str
    name: str  # dotted
    package: bool

    def matches(self, mod: str) -> bool:
        return mod == self.name or (self.package and mod.startswith(self.name + "."))

    @property
    def depth(self) -> tuple[int, int]:  # the more specific target wins
        return self.name.count("."), 0 if self.package else 1


@dataclass(frozen=True)
class Allowed:
    target: Target
    lazily: bool  # only from inside a function (or under TYPE_CHECKING)


@dataclass(frozen=True)
class Row:
    label: str
    targets: tuple[Target, ...]
    owns: str
    cell: str
    allowed: tuple[Allowed, ...]

    @property
    def title(self) -> str:
        return self.label or ", ".join(t.text for t in self.targets)


class TableError(ValueError):
    """The table cannot be read mechanically."""


def parse_target(text: str, top: str) -> Target:
    if text.endswith("/"):
        return Target(text, ".".join([top, *text.strip("/").split("/")]), True)
    if text.endswith(".py"):
        parts = text[:-3].split("/")
        if parts[-1] == "__init__":
            parts.pop()
        return Target(text, ".".join([top, *parts]), False)
    raise TableError(f"`{text}`: write a module as `name.py` and a package as `name/`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _phrases(text: str, phrases: Iterable[str], glue: set[str]) -> tuple[list[str], str]:
    """The phrases found in ``text`` (longest first, each once consumed) and the words left over."""
    text = re.sub(r"`[^`]*`", " ", text)
    found = []
    for p in sorted(phrases, key=len, reverse=True):
        pattern = rf"(?<![\w-]){re.escape(p)}(?![\w-])"
        if re.search(pattern, text):
            found.append(p)
            text = re.sub(pattern, " ", text)
    return found, " ".join(w for w in re.split(r"[\s,;]+", text) if w and w not in glue)


def parse_table(markdown: str, top: str, section: str = TABLE_SECTION) -> list[Row]:
    """The rows of the first table under ``## <section>``; raises TableError where a cell is unreadable."""
    m = re.search(rf"^## {re.escape(section)}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if not m:
        raise TableError(f"no section '## {section}'")
    lines = [ln for ln in m.group(1).splitlines() if ln.strip().startswith("|")]
    if len(lines) < 3:
        raise TableError(f"no table under '## {section}'")
    header = [c.lower() for c in _cells(lines[0])]
    if "may import" not in header:
        raise TableError(f"the table under '## {section}' has no 'may import' column")
    col, owns_col = header.index("may import"), 1 if len(header) > 2 else None
    raw = []
    for ln in lines[2:]:
        cells = _cells(ln)
        first = cells[0]
        label = ""
        if ":" in first and ("`" not in first or first.index(":") < first.index("`")):
            label, first = (s.strip() for s in first.split(":", 1))
        names = re.findall(r"`([^`]+)`", first)
        if not names or _phrases(first, [], {"and"})[1]:
            raise TableError(f"row '{cells[0]}': list its modules as `name.py` / `name/`, comma-separated")
        raw.append((label, tuple(parse_target(n, top) for n in names), cells[owns_col] if owns_col else "",
                    cells[col]))
    labels = {label: targets for label, targets, _, _ in raw if label}
    phrases = dict(labels)
    for alias, names in ALIASES.items():
        if any(n in labels for n in names):
            phrases[alias] = tuple(t for n in names for t in labels.get(n, ()))
    if LAB in labels:
        phrases["the library"] = tuple(t for label, targets, _, _ in raw if label != LAB for t in targets)
    rows = []
    for label, targets, owns, cell in raw:
        allowed: list[Allowed] = []
        for clause in cell.split(";"):
            words = clause.split()
            lazily = bool(words) and words[-1] == "lazily"
            if lazily:
                clause = " ".join(words[:-1])
            found, leftover = _phrases(clause, [*phrases, "everything", "nothing"], {"and", "else"})
            if leftover or not clause.strip():
                raise TableError(f"row '{label or targets[0].text}': cannot read '{leftover or cell}' in its "
                                 "may-import cell; name modules as `x.py`, packages as `x/`, or a row's label")
            items = [parse_target(n, top) for n in re.findall(r"`([^`]+)`", clause)]
            items += [t for p in found if p in phrases for t in phrases[p]]
            if "everything" in found:
                items.append(Target("everything", top, True))
            allowed.extend(Allowed(t, lazily) for t in items)
        rows.append(Row(label, targets, owns, cell, tuple(allowed)))
    return rows


def rows_of(mod: str, rows: list[Row]) -> list[tuple[Row, Target]]:
    """The rows naming ``mod`` most specifically (one, where the table is sound), with the naming target."""
    hits = [(t.depth, r, t) for r in rows for t in r.targets if t.matches(mod)]
    best = max((h[0] for h in hits), default=None)
    return [(r, t) for d, r, t in hits if d == best]


def table_violations(modules: dict[str, Module], imports: list[Import], rows: list[Row], base: Path,
                     doc: str = "the table") -> list[str]:
    out = []
    for r in rows:
        for t in r.targets:
            if not any(t.matches(m) for m in modules):
                out.append(f"{doc}: row '{r.title}' names `{t.text}`, which is not in the package")
    for name, mod in modules.items():
        found = rows_of(name, rows)
        if len(found) != 1:
            which = " and ".join(f"'{r.title}'" for r, _ in found) or "no row"
            out.append(f"{where(mod.path, 1, base)} {name} is in {which} of the may-import table: "
                       "put it in exactly one")
    for i in imports:
        found = rows_of(i.src, rows)
        if len(found) != 1 or i.dst == i.src:
            continue
        [(row, own)] = found
        if own.package and own.matches(i.dst):
            continue  # inside its own package
        ok = [a for a in row.allowed if a.target.matches(i.dst)]
        if any(not a.lazily or i.lazy or i.typing_only for a in ok):
            continue
        place = where(modules[i.src].path, i.line, base)
        if ok:
            out.append(f"{place} {i.how} at module level: row '{row.title}' may import it only lazily")
        else:
            out.append(f"{place} {i.how}{i.when}: row '{row.title}' may import only: {row.cell}")
    return out


def torch_violations(modules: dict[str, Module], imports: list[Import], rows: list[Row], base: Path) -> list[str]:
    """A module of a torch-free row that, when loaded, loads a module importing torch at load time."""
    eager: dict[str, set[str]] = {m: {p for p in modules if m.startswith(p + ".")} for m in modules}
    for i in imports:
        if not (i.lazy or i.typing_only):
            dst = i.dst if i.dst in modules else None
            while dst:  # loading a.b.c loads a and a.b first
                eager[i.src].add(dst)
                dst = dst.rpartition(".")[0] if "." in dst else None
    direct = {}
    for name, mod in modules.items():
        for node, lazy, tc in walk(mod.tree):
            if lazy or tc:
                continue
            got = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            if any(g == "torch" or g.startswith("torch.") for g in got):
                direct[name] = node.lineno
                break
    out = []
    for r in rows:
        if not any(mark in f"{r.label} {r.owns}" for mark in TORCH_FREE_MARKS):
            continue
        for name in sorted(m for m in modules if [row for row, _ in rows_of(m, rows)] == [r]):
            path, seen = {name: [name]}, [name]
            for v in seen:
                for w in sorted(eager[v]):
                    if w not in path:
                        path[w] = [*path[v], w]
                        seen.append(w)
            hit = next((m for m in seen if m in direct), None)
            if hit:
                out.append(f"{where(modules[hit].path, direct[hit], base)} imports torch when loaded, and row "
                           f"'{r.title}' is torch-free: {' -> '.join(path[hit])}")
    return out
