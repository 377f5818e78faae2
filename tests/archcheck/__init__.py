"""The house rules of a package, checked from its source with ``ast`` (never by importing it).

Each ``*_violations`` function returns one readable line per violation, ``path:line`` first:

- ``circle_violations``: import circles; every import counts, also those inside functions, under
  ``if TYPE_CHECKING:``, and ``importlib.import_module("pkg.x")`` / ``__import__("pkg.x")`` calls
  with a literal name;
- ``table_violations``: imports that the "may import" table of docs/architecture.md does not allow
  (``parse_table`` reads it; the rules for reading it are written under the table);
- ``torch_violations``: a module of a torch-free row whose imports at load time reach torch;
- ``private_violations``: ``_private`` names reached across modules (see ``private_uses``);
- ``outside_violations``: the same in tests, benchmarks and examples, for names of the package;
- ``length_violations``: files over ``MAX_LINES`` lines;
- ``environment_violations``: ``os.environ`` read (or written) outside the modules allowed to.

Known limits: a name built at run time (``getattr(m, name)``) is not followed, and ``obj._x`` is
allowed wherever this module defines some ``_x`` of its own, whatever ``obj`` is.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from archcheck.circles import circle_violations
from archcheck.environ import environment_violations
from archcheck.private import outside_violations, private_violations
from archcheck.source import all_imports, load_package
from archcheck.table import TableError, parse_table, table_violations, torch_violations

MAX_LINES = 600


def stale_exceptions(exceptions: dict[tuple[str, str], str], base: Path) -> list[str]:
    """Exceptions whose file no longer exists or no longer mentions the name."""
    return [f"exception ({f}, {n}) is stale: {f} does not use {n}; remove it" for f, n in sorted(exceptions)
            if not (base / f).is_file() or n not in (base / f).read_text()]


def length_violations(paths: Iterable[Path], base: Path, limit: int = MAX_LINES) -> list[str]:
    return [f"{p.relative_to(base)} has {n} lines, over {limit}: split it by concern"
            for p in sorted(paths) if (n := len(p.read_text().splitlines())) > limit]


def check_repo(repo: Path, top: str, doc: Path, outside: Iterable[str],
               package_exceptions: dict[tuple[str, str], str],
               outside_exceptions: dict[tuple[str, str], str],
               environment_readers: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Every rule on the package ``repo/top``, its table in ``doc`` and the code in ``outside`` folders;
    with ``environment_readers`` (module names), also that no other module reads the environment."""
    modules = load_package(repo / top)
    imports = all_imports(modules, top)
    found = {"import circles": circle_violations(modules, imports, repo)}
    doc_name = str(doc.relative_to(repo))
    try:
        rows = parse_table(doc.read_text(), top)
    except TableError as e:
        found["may-import table"] = [f"{doc_name}: {e}"]
    else:
        found["may-import table"] = table_violations(modules, imports, rows, repo, doc_name)
        found["torch-free rows"] = torch_violations(modules, imports, rows, repo)
    found["private names in the package"] = (private_violations(modules, top, repo, package_exceptions)
                                             + stale_exceptions(package_exceptions, repo))
    files = [p for d in outside if (repo / d).is_dir() for p in (repo / d).rglob("*.py")]
    found["private names outside the package"] = (outside_violations(files, modules, top, repo, outside_exceptions)
                                                  + stale_exceptions(outside_exceptions, repo))
    found["long files"] = length_violations((m.path for m in modules.values()), repo)
    if environment_readers is not None:
        found["environment reads"] = environment_violations(modules, environment_readers, repo)
    return found


def report(found: dict[str, list[str]]) -> str:
    """All violations, grouped by rule, one per line."""
    parts = [f"{rule} ({len(v)}):\n" + "\n".join(f"  {line}" for line in v) for rule, v in found.items() if v]
    return f"{sum(map(len, found.values()))} violations of the house rules\n" + "\n".join(parts)
