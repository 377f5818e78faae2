"""MkDocs hook: the generated parts of the reference pages, made at build time so they cannot drift.

A page holds a marker comment that this hook replaces:
- ``<!-- generated: api -->``: one mkdocstrings entry per public name of ``eagerloco`` (its ``__all__``);
- ``<!-- generated: cli -->``: every flag of every command, from ``eagerloco.cli.make_parser()``, the
  parser the command line itself uses (built from the config dataclasses).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

API_MARKER = "<!-- generated: api -->"
CLI_MARKER = "<!-- generated: cli -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the markers of a page with the generated Markdown."""
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown


def object_path(name: str) -> str:
    """The dotted path where a public name of ``eagerloco`` is defined (what mkdocstrings looks up)."""
    import eagerloco

    obj = getattr(eagerloco, name)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and module.startswith("eagerloco.") and qualname:
        return f"{module}.{qualname}"
    # A constant knows no module: the deepest eagerloco module that holds it is the one that defines it.
    holders = [m for m, mod in sys.modules.items()
               if m.startswith("eagerloco.") and getattr(mod, name, None) is obj]
    if not holders:
        raise RuntimeError(f"eagerloco.{name}: no module of eagerloco defines it")
    return f"{max(holders, key=lambda m: m.count('.'))}.{name}"


def api_reference() -> str:
    """One ``::: path`` entry per name of ``eagerloco.__all__``, in its order."""
    import eagerloco

    return "\n\n".join(f"::: {object_path(name)}" for name in eagerloco.__all__) + "\n"


def _cell(text: object) -> str:
    """Plain text as one Markdown table cell or paragraph (argparse's texts may hold ``<out>`` or ``|``)."""
    return str(text).replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


def _help(action: argparse.Action) -> str:
    """An action's help text with argparse's ``%(default)s``-style fields filled in, as --help prints it."""
    text = action.help or ""
    try:
        return text % {**vars(action), "prog": "eagerloco"}
    except (KeyError, TypeError, ValueError):
        return text


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    """A table per argument group of one command: its flags (or positional arguments), defaults and help."""
    out: list[str] = []
    # argparse has no public list of a parser's groups and actions; these attributes are what its own
    # format_help() walks, stable across Python 3.11-3.14.
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += ["", f"**{group.title}**", "", "| flag | meaning |", "|---|---|"]
        for a in actions:
            names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
            if a.choices is not None:
                names += "<br>one of " + ", ".join(f"`{c}`" for c in a.choices)
            elif a.option_strings and a.nargs != 0:
                names += f" `{a.metavar or a.dest.upper()}`"
            meaning = _help(a)
            # The config flags state their default in the help (theirs is SUPPRESS: a TOML value may stand).
            if "default" not in meaning and a.default not in (None, False, argparse.SUPPRESS):
                meaning += f" (default {a.default})"
            out.append(f"| {names} | {_cell(meaning)} |")
    return out


def cli_reference() -> str:
    """A section per command of ``eagerloco``: its description and every flag, from the CLI's own parser."""
    from eagerloco.cli import make_parser

    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    lines: list[str] = []
    for name, command in sub.choices.items():
        lines += ["", f"## eagerloco {name}", "", _cell(helps.get(name) or ""), ""]
        if command.description:
            lines += [_cell(command.description), ""]
        lines += ["```text", command.format_usage().strip(), "```"]
        lines += _flag_rows(command)
    return "\n".join(lines) + "\n"
