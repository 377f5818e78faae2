"""The command line of a run, generated from the settings' dataclasses, and how it becomes a TrainConfig.

Each field of :class:`~eagerloco.config.TrainConfig` and its sections is one flag: ``--field-name`` (or
its :func:`~eagerloco.config.setting` spelling), the field's type and choices, and its docstring as the
help. The layers: defaults <- the environment (what a launcher says) <- a TOML file (``--config``) <- flags.

Not tyro or jsonargparse: these flags keep their spellings (``--non-iid``, ``--slow-worker`` repeatable),
tell a flag given from one left at its default (the TOML file sits between), and join the argparse tree
of ``compare`` and ``launch`` with the help texts and messages the tests check; both libraries own the
parser. Walking the dataclasses takes 60 lines. Imports no torch."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import math
import tomllib
import types
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, Self, Union, get_args, get_origin, get_type_hints

from eagerloco.config import SECTIONS, ConfigError, Environment, TrainConfig, flag_name, train_config_from_tables

#: The --help sections, in order, with their titles; a field goes to its setting's group, else its class's.
GROUPS = {"algorithm": "algorithm", "compression": "compression (sparse exchange, error feedback)", "link": "link",
          "training": "training", "device": "device",
          "multi-process": "multi-process (under `eagerloco launch`, torchrun, or one job per worker)",
          "heterogeneous": "workers of unequal speed", "faults": "faults"}
_CLASS_GROUP = {"OuterConfig": "algorithm", "LinkConfig": "link", "TrainConfig": "training"}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source: Python keeps none at run time)."""
    tree = ast.parse(Path(inspect.getfile(cls)).read_text(encoding="utf-8"))  # inspect.getsource would parse twice
    body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__qualname__)
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _value_type(tp: Any) -> Any:
    """int for ``int | None``, str for ``list[str]``: what one flag value converts to."""
    if get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is list:
        tp = get_args(tp)[0]
    return tp


def _shown(f: Field[Any]) -> str | None:
    if f.metadata.get("shown_default") is not None:
        return f.metadata["shown_default"]
    if f.default is MISSING or f.default is None or isinstance(f.default, bool):
        return None
    if isinstance(f.default, float) and math.isinf(f.default):
        return "inf"
    return str(f.default) if f.default != "" else "none"


def add_dataclass_flags(groups: dict[str, Any], cls: type, group: str | None = None) -> None:
    """Add one flag per field of ``cls`` (sections excepted) to the argparse groups, by group name: the
    setting's group, else ``group``, else its class's (training by default)."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in fields(cls):
        meta = f.metadata
        if f.name in SECTIONS or not meta.get("cli", True):
            continue
        tp = hints[f.name]
        text = docs.get(f.name, "")
        shown = _shown(f)
        if shown is not None:
            text += f" (default {shown})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": text.replace("%", "%%")}
        g = groups[meta.get("group") or group or _CLASS_GROUP.get(cls.__name__, "training")]
        if tp is bool:
            on = f.default is not True
            flag = meta.get("flag") or flag_name(f.name if on else "no_" + f.name)
            g.add_argument(flag, action="store_true" if on else "store_false", **kw)
        else:
            kw["type"] = _value_type(tp)
            if get_origin(tp) is list and meta.get("sep"):
                kw["type"] = _separated(kw["type"], meta["sep"])
            elif get_origin(tp) is list:
                kw["action"] = "append"
            for key in ("choices", "metavar"):
                if meta.get(key) is not None:
                    kw[key] = meta[key]
            g.add_argument(meta.get("flag") or flag_name(f.name), **kw)


class FromFlags:
    """A settings dataclass whose flags :func:`add_dataclass_flags` made: :meth:`from_args` builds it from them."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        """The flags given (parsed by a parser with the generated flags, where a flag not given is None)."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if given.get(f.name) is not None})


def _separated(convert: Any, sep: str) -> Any:
    """A flag type reading one argument of values separated by sep (``1,0.5``) into a list."""

    def parse(text: str) -> list[Any]:
        try:
            return [convert(v.strip()) for v in text.split(sep)]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected {convert.__name__} values separated by {sep!r}, e.g. 1{sep}0.5") from None

    return parse


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags of `eagerloco train` (also used by `eagerloco compare`) to a parser."""
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    for cls in (*SECTIONS.values(), TrainConfig):
        add_dataclass_flags(groups, cls)
    p.add_argument("--config", type=Path,
                   help="TOML file: top-level training keys, [outer], [link] and [runtime] tables")


def config_tables(path: Path) -> dict[str, dict[str, Any]]:
    """A ``--config`` file's settings by table ("" for the top level); ConfigError for a missing or invalid file."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; pass a TOML file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file; pass a TOML file (UTF-8)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from e
    tables: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        value = raw.pop(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"--config {path}: [{name}] must be a table of settings "
                              f"(a [{name}] section), got {name} = {value!r}")
        tables[name] = value
    tables[""] = raw
    return tables


def build_train_config(args: argparse.Namespace, env: Environment | None = None) -> TrainConfig:
    """The run's validated settings: defaults <- the environment <- config file (``--config``) <- flags given
    (``args`` from a parser with :func:`add_train_flags`; None: not given). ConfigError naming what is wrong."""
    env = Environment.read() if env is None else env
    tables: dict[str, dict[str, Any]] = {"": {}, **{name: {} for name in SECTIONS}}
    if env.launched and env.workers is not None:  # the worker count given to the launcher
        tables[""]["workers"] = env.workers
    config = getattr(args, "config", None)
    if config is not None:
        for name, table in config_tables(config).items():
            tables[name].update(table)
    given = vars(args)
    for name, cls in (("", TrainConfig), *SECTIONS.items()):
        for f in fields(cls):
            if f.name not in SECTIONS and given.get(f.name) is not None:
                tables[name][f.name] = given[f.name]
    where = f"--config {config}" if config else "the command line"
    if "tokens" in tables[""] and "steps" in tables[""]:
        raise ConfigError(f"pass either steps or tokens (a token budget that sets the steps), not both ({where})")
    return train_config_from_tables(tables, where).validate(env)
