"""Validated settings: the outer algorithm, the link, the runtime and a whole training run.

One module per concern: :mod:`.outer` (the algorithm and the link), :mod:`.runtime` (how workers
are started), :mod:`.train` (the run), :mod:`.environment` (the one reader of the process
environment), :mod:`.schema` (settings from TOML tables), :mod:`.checks` (what they share).
"""

from eagerloco.config.checks import ConfigError, flag_name, setting
from eagerloco.config.outer import METHODS, OUTER_OPTIMIZERS, TRANSPORTS, WEIGHTINGS, LinkConfig, OuterConfig
from eagerloco.config.runtime import BACKENDS, RUNTIMES, RuntimeConfig
from eagerloco.config.schema import SECTIONS, from_dict, train_config_from_tables
from eagerloco.config.train import TrainConfig, parse_slow_workers
from eagerloco.environment import Environment
from eagerloco.schedule import PATTERNS

__all__ = [
    "BACKENDS",
    "ConfigError",
    "Environment",
    "LinkConfig",
    "METHODS",
    "OUTER_OPTIMIZERS",
    "OuterConfig",
    "PATTERNS",
    "RUNTIMES",
    "RuntimeConfig",
    "SECTIONS",
    "TRANSPORTS",
    "TrainConfig",
    "WEIGHTINGS",
    "flag_name",
    "from_dict",
    "parse_slow_workers",
    "setting",
    "train_config_from_tables",
]
