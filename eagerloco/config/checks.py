"""What every settings dataclass shares: the error, the checks of one value, and how a field is declared.

A field's name, type, default and docstring are the setting's whole description: the command line, the
TOML schema and the error messages are made from them."""

from __future__ import annotations

import math
from dataclasses import MISSING, field
from typing import Any

from eagerloco.errors import ConfigError


def flag_name(name: str) -> str:
    """The command-line flag of a setting: ``--inner-steps`` for ``inner_steps``."""
    return "--" + name.replace("_", "-")


def setting(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    cli: bool = True,
    shown_default: str | None = None,
    sep: str | None = None,
) -> Any:
    """A dataclass field with what the generated command line needs beyond name, type, default and docstring.

    Args:
        default: the default value (or ``factory``: a callable making it).
        flag: the flag's spelling when not ``--field-name`` (``--non-iid`` for ``iid``).
        choices: the values the flag accepts.
        metavar: the placeholder in ``--help``.
        group: the ``--help`` section, when not the dataclass's.
        cli: False for a setting no flag sets (the launcher passes it through the environment).
        shown_default: what ``--help`` says the default is, when not the value itself.
        sep: a list setting whose flag takes its values in one argument separated by this (``1,0.5``).
    """
    meta = {"flag": flag, "choices": choices, "metavar": metavar, "group": group, "cli": cli,
            "shown_default": shown_default, "sep": sep}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raise ConfigError unless value is one of allowed."""
    if value not in allowed:
        raise ConfigError(f"{flag_name(name)} must be one of {', '.join(allowed)}; got {value!r}")


def check_int_at_least(name: str, value: Any, low: int) -> None:
    """Raise ConfigError unless value is an integer (not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{flag_name(name)} must be an integer >= {low}, got {value!r}")


def host_port(name: str, addr: str) -> tuple[str, int]:
    """The host and port of ``addr`` (``host:port``); ConfigError unless the port is in 1..65535."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"{flag_name(name)} must be host:port with a port in 1..65535, got {addr!r}")
    return host, int(port)


def check_switch(name: str, value: Any) -> None:
    """Raise ConfigError unless value is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"{flag_name(name)} is a switch (true/false), got {value!r}")


def is_finite(v: Any) -> bool:
    """Whether v is a finite int or float (a bool is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


__all__ = ["ConfigError", "check_choice", "check_int_at_least", "check_switch", "flag_name", "host_port", "is_finite",
           "setting"]
