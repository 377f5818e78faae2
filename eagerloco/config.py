"""Validated settings for the outer algorithm and the link.

Every check runs before any training step and raises :class:`ConfigError` with a message that
names the flag and the values it accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("dp", "diloco", "streaming", "delayed", "eager")
PATTERNS = ("sequential", "strided")
WEIGHTINGS = ("nonlocal", "stale_average")
OUTER_OPTIMIZERS = ("sgd", "adam", "adamw")


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the allowed values."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class OuterConfig:
    """What the outer algorithm does; one object describes every method of the family.

    method:
      dp         gradient mean every inner step (the baseline)
      diloco     H inner steps, blocking exchange of the mean outer gradient (P must be 1)
      streaming  P staggered fragments, each synced once per H steps, optional tau-step overlap
      delayed    naive delayed outer update: apply the mean that arrived, k rounds late
      eager      eager updates: own fresh outer gradient in place of its missing share
    """

    method: str = "diloco"
    inner_steps: int = 50
    fragments: int = 1
    fragment_pattern: str = "strided"
    overlap_steps: int = 0
    alpha: float = 0.0
    eager_rounds: int = 1
    eager_weighting: str = "nonlocal"
    codec: str = "fp32"
    codec_block: int = 32
    stochastic_rounding: bool = False
    outer_optimizer: str = "sgd"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True

    def validate(self, num_blocks: int | None = None) -> OuterConfig:
        """Raise ConfigError on the first invalid setting; returns self for chaining.

        num_blocks: number of transformer blocks of the model, when known, to check P against.
        """
        from eagerloco.codecs import CODEC_NAMES  # local import: codecs imports torch

        _choice("method", self.method, METHODS)
        _choice("fragment_pattern", self.fragment_pattern, PATTERNS)
        _choice("eager_weighting", self.eager_weighting, WEIGHTINGS)
        _choice("codec", self.codec, CODEC_NAMES)
        _choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        _int_at_least("inner_steps", self.inner_steps, 1)
        _int_at_least("fragments", self.fragments, 1)
        _int_at_least("eager_rounds", self.eager_rounds, 1)
        _int_at_least("overlap_steps", self.overlap_steps, 0)
        _int_at_least("codec_block", self.codec_block, 1)
        if not _finite(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{_flag('alpha')} must be in [0, 1] (weight of the local parameters), got {self.alpha}")
        if not _finite(self.outer_lr) or self.outer_lr <= 0:
            raise ConfigError(f"{_flag('outer_lr')} must be a positive number, got {self.outer_lr}")
        if not _finite(self.outer_momentum) or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"{_flag('outer_momentum')} must be in [0, 1), got {self.outer_momentum}")
        if self.outer_nesterov and self.outer_optimizer == "sgd" and self.outer_momentum == 0:
            raise ConfigError(
                f"{_flag('outer_nesterov')} needs {_flag('outer_momentum')} > 0; "
                "pass --no-outer-nesterov for plain SGD"
            )
        if self.method == "diloco" and self.fragments != 1:
            raise ConfigError(
                f"{_flag('method')} diloco synchronizes the whole model at once, so {_flag('fragments')} "
                f"must be 1 (got {self.fragments}); use {_flag('method')} streaming for P > 1"
            )
        if self.method == "dp":
            if self.fragments != 1 or self.overlap_steps != 0:
                raise ConfigError(
                    f"{_flag('method')} dp averages gradients every step: {_flag('fragments')} must be 1 and "
                    f"{_flag('overlap_steps')} 0 (got {self.fragments} and {self.overlap_steps})"
                )
        if self.method in ("delayed", "eager") and self.overlap_steps != 0:
            raise ConfigError(
                f"{_flag('method')} {self.method} already overlaps the exchange with whole rounds "
                f"({_flag('eager_rounds')}); {_flag('overlap_steps')} must be 0, got {self.overlap_steps}"
            )
        if self.method != "dp" and self.fragments > self.inner_steps:
            raise ConfigError(
                f"{_flag('fragments')} ({self.fragments}) must not exceed {_flag('inner_steps')} "
                f"({self.inner_steps}): each fragment needs its own sync step within a round"
            )
        if self.overlap_steps > 0 and self.overlap_steps * self.fragments >= self.inner_steps:
            raise ConfigError(
                f"{_flag('overlap_steps')} must be smaller than H/P = {self.inner_steps}/{self.fragments} "
                f"so one fragment's exchange lands before the next one starts; got {self.overlap_steps}"
            )
        if num_blocks is not None and self.fragments > max(num_blocks, 1):
            raise ConfigError(
                f"{_flag('fragments')} ({self.fragments}) is larger than the model's number of blocks "
                f"({num_blocks}); choose 1..{max(num_blocks, 1)}"
            )
        return self

    @property
    def rounds_in_flight(self) -> int:
        """How many outer rounds an exchange may take before it must be applied."""
        return self.eager_rounds if self.method in ("delayed", "eager") else 0


@dataclass
class LinkConfig:
    """The slow link between workers: bandwidth in Gbit/s (inf: no limit) and one-way latency."""

    bandwidth_gbps: float = math.inf
    latency_ms: float = 0.0
    jitter_ms: float = 0.0

    def validate(self) -> LinkConfig:
        if math.isnan(self.bandwidth_gbps) or self.bandwidth_gbps <= 0:
            raise ConfigError(
                f"--bandwidth-gbps must be a positive number of Gbit/s (inf for no limit), got {self.bandwidth_gbps}"
            )
        for name in ("latency_ms", "jitter_ms"):
            v = getattr(self, name)
            if not _finite(v) or v < 0:
                raise ConfigError(f"{_flag(name)} must be a finite number >= 0, got {v}")
        return self

    def transfer_seconds(self, nbytes: int) -> float:
        """Seconds the link needs to carry nbytes, latency included (jitter is applied by the caller)."""
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbps * 1e9)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{_flag(name)} must be one of {', '.join(allowed)}; got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{_flag(name)} must be an integer >= {low}, got {value!r}")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build a dataclass from a mapping, refusing unknown keys with the list of known ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}")
    return cls(**data)


__all__ = [
    "ConfigError",
    "LinkConfig",
    "METHODS",
    "OuterConfig",
    "PATTERNS",
    "WEIGHTINGS",
    "from_dict",
]
