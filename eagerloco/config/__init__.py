"""Validated settings, one module per concern: the outer algorithm and the link (:mod:`.outer`), how workers
are started (:mod:`.runtime`), a whole run (:mod:`.train`), TOML tables (:mod:`.schema`)."""

from eagerloco.config.checks import ConfigError, flag_name, setting
from eagerloco.config.outer import METHODS, OUTER_OPTIMIZERS, LinkConfig, OuterConfig
from eagerloco.config.runtime import RuntimeConfig
from eagerloco.config.schema import SECTIONS, train_config_from_tables
from eagerloco.config.train import TrainConfig, parse_slow_workers
from eagerloco.environment import Environment

__all__ = ["ConfigError", "Environment", "LinkConfig", "METHODS", "OUTER_OPTIMIZERS", "OuterConfig", "RuntimeConfig",
           "SECTIONS", "TrainConfig", "flag_name", "parse_slow_workers", "setting", "train_config_from_tables"]
