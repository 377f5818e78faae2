"""eagerloco: DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links."""

from eagerloco.codecs import CODEC_NAMES, get_codec
from eagerloco.comm.base import Communicator, Handle, WorkerStats
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, LinkConfig, OuterConfig
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all

__version__ = "0.1.0"

__all__ = [
    "CODEC_NAMES",
    "Communicator",
    "ConfigError",
    "Handle",
    "InProcessGroup",
    "LinkConfig",
    "OuterConfig",
    "OuterSync",
    "WorkerStats",
    "after_inner_step_all",
    "before_inner_step_all",
    "get_codec",
]
