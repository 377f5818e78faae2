"""Settings from a mapping (a TOML file's tables): every key and value checked against the dataclasses'
type hints.

Not jsonargparse or tyro: their messages are not these (one line naming the key, the file, the expected
type, and the known keys for an unknown one), they would own the parser the flags share with ``compare``
and ``launch``, and the check of a handful of flat types takes 40 lines."""

from __future__ import annotations

import types
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar, Union, get_args, get_origin, get_type_hints

from eagerloco.config.checks import ConfigError
from eagerloco.config.outer import LinkConfig, OuterConfig
from eagerloco.config.runtime import RuntimeConfig
from eagerloco.config.train import TrainConfig

#: The sections of a TrainConfig: TOML tables of the same names.
SECTIONS: dict[str, type] = {"outer": OuterConfig, "link": LinkConfig, "runtime": RuntimeConfig}


def type_name(tp: Any) -> str:
    """How an error message calls a field's type: "an integer", "a number or absent", ..."""
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args) + (" (or absent)" if type(None) in get_args(tp) else "")
    if get_origin(tp) is list:
        return f"a list of {type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, f"a [{getattr(tp, '__name__', tp)}] table")


def type_ok(value: Any, tp: Any) -> bool:
    """Whether value has the declared type, strictly: a bool is not an int, "no" is not a bool."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(type_ok(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(type_ok(v, get_args(tp)[0]) for v in value)
    return isinstance(value, tp)


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def from_dict(cls: type[C], data: Any, where: str) -> C:
    """Build ``cls`` from the mapping ``data``, checking every key and value against the field's type; not yet
    validated for ranges (call ``validate()``). ConfigError for an unknown key (listing the known ones) or
    a value of the wrong type, naming the key, ``where`` (e.g. ``--config run.toml``) and the type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table of settings, got {data!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}")
    for key, value in data.items():
        if not type_ok(value, hints[key]):
            raise ConfigError(f"{key} = {value!r} in {where}: expected {type_name(hints[key])}")
    return cls(**data)


def train_config_from_tables(tables: dict[str, dict[str, Any]], where: str) -> TrainConfig:
    """A TrainConfig from its top-level settings (``tables[""]``) and its sections (``tables["outer"]``, ...)."""
    cfg = from_dict(TrainConfig, tables.get("", {}), where)
    for name, cls in SECTIONS.items():
        setattr(cfg, name, from_dict(cls, tables.get(name, {}), f"[{name}] of {where}"))
    return cfg
