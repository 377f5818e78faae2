"""`--tune KEY=V1,V2,...`: the settings a per-method sweep tries, and how it picks one (no torch)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from eagerloco.config import ConfigError, LinkConfig, OuterConfig, TrainConfig
from eagerloco.lab.compare.grid import PER_ENTRY_FLAGS, GridEntry

#: Settings a sweep may not change: the run's identity and output, the seed, the method (the grid's
#: entries choose it) and the tables.
NOT_TUNABLE = {"seed", "out", "resume", "progress", "rejoin", "elastic", "outer", "link", "tokens", *PER_ENTRY_FLAGS}
_SECTIONS = {"train": TrainConfig, "outer": OuterConfig, "link": LinkConfig}


@dataclass(frozen=True)
class TuneAxis:
    """One swept setting: its field name, which config holds it (train, outer or link), its values."""

    key: str
    section: str
    values: tuple[Any, ...]


def _field_type(section: str, key: str) -> str:
    f = next(f for f in fields(_SECTIONS[section]) if f.name == key)
    return str(f.type)


def _parse_value(text: str, kind: str, key: str) -> Any:
    text = text.strip()
    try:
        if kind.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            v = float(text)
            if not math.isfinite(v):
                raise ValueError(text)
            return v
    except ValueError as e:
        raise ConfigError(f"--tune {key}: {text!r} is not a valid {kind.split()[0]}") from e
    return text


def parse_tune(specs: list[str]) -> list[TuneAxis]:
    """``["outer_lr=0.2,0.35", "lr=1e-3,3e-3"]`` (dashes or underscores) into axes in order, duplicate values dropped;
    ConfigError for a spec without values, an unknown or untunable key, a key given twice or a mistyped value."""
    axes: list[TuneAxis] = []
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key = key.strip().replace("-", "_")
        values_text = [v for v in raw.split(",") if v.strip()]
        if not sep or not key or not values_text:
            raise ConfigError(f"--tune takes KEY=V1,V2,... (e.g. outer_lr=0.2,0.35,0.5,0.7,1.0), got {spec!r}")
        section = section_of(key)
        if section is None or key in NOT_TUNABLE:
            known = sorted({f.name for cls in _SECTIONS.values() for f in fields(cls)} - NOT_TUNABLE)
            raise ConfigError(f"--tune: {key!r} is not a setting a sweep can change; choose from {', '.join(known)}")
        if any(a.key == key for a in axes):
            raise ConfigError(f"--tune: {key} is given twice; list all its values in one --tune {key}=...")
        kind = _field_type(section, key)
        values = tuple(dict.fromkeys(_parse_value(v, kind, key) for v in values_text))
        axes.append(TuneAxis(key, section, values))
    return axes


def settings_for(entry: GridEntry, axes: list[TuneAxis]) -> list[dict[str, Any]]:
    """The settings the sweep tries for ``entry``, the product of the axes it does not fix; ``[{}]`` (one run at the
    base settings) when it fixes every swept key."""
    free = [a for a in axes if not entry.fixes(a.key)]
    return [dict(zip((a.key for a in free), combo, strict=True))
            for combo in itertools.product(*(a.values for a in free))]


def section_of(key: str) -> str | None:
    """Which settings hold ``key``: "train", "outer", "link", or None for no such field."""
    return next((s for s, cls in _SECTIONS.items() if key in {f.name for f in fields(cls)}), None)


def apply_setting(cfg: TrainConfig, setting: dict[str, Any]) -> TrainConfig:
    """A copy of ``cfg`` (not validated) with the swept values set in their sections; ConfigError for a key that is
    no setting."""
    by: dict[str, dict[str, Any]] = {"train": {}, "outer": {}, "link": {}}
    for k, v in setting.items():
        section = section_of(k)
        if section is None:
            raise ConfigError(f"{k!r} is not a training, outer or link setting")
        by[section][k] = v
    return replace(cfg, **by["train"], outer=replace(cfg.outer, **by["outer"]), link=replace(cfg.link, **by["link"]))


def value_text(v: Any) -> str:
    """A setting's value as the reports and commands write it: a float in its shortest form (``0.35``, ``1e-05``)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def setting_text(setting: dict[str, Any]) -> str:
    """``outer_lr=0.35,lr=0.003``, or ``base`` for the empty setting; also a run directory's name."""
    return ",".join(f"{k}={value_text(v)}" for k, v in setting.items()) or "base"


def choose(losses: list[float], diverged: list[bool]) -> int:
    """Index of the lowest finite held-out loss among the runs that did not diverge (among all finite ones when every
    run diverged), the first of equal ones; ValueError for no candidate or no finite loss."""
    if not losses or len(losses) != len(diverged):
        raise ValueError("choose needs one divergence flag per loss, and at least one candidate")
    finite = [i for i, v in enumerate(losses) if math.isfinite(v)]
    if not finite:
        raise ValueError("every candidate's loss is not finite: nothing to choose")
    pool = [i for i in finite if not diverged[i]] or finite
    return min(pool, key=lambda i: (losses[i], i))
