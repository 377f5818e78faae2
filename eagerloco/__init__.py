"""eagerloco: DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links.

The public names are what a user of the hook API (:func:`outer_loop` on one's own loop, :func:`connect`
to the other workers) and of the trainer's settings needs. They are loaded on first use (PEP 562), so
tools that need no torch (the simulator, ``eagerloco simulate``) start without importing it; a type
checker sees each one's own type through the imports under ``TYPE_CHECKING``.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from eagerloco.comm.base import Communicator, Handle, WorkerStats
    from eagerloco.comm.connect import Connection, connect
    from eagerloco.comm.errors import PeerError
    from eagerloco.comm.inprocess import InProcessGroup
    from eagerloco.config import ConfigError, LinkConfig, OuterConfig, TrainConfig
    from eagerloco.extras import MissingExtraError
    from eagerloco.hooks import OuterLoop, exit_on_errors, outer_loop
    from eagerloco.outer import OuterSync

#: Public name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "Communicator": "eagerloco.comm.base",
    "Handle": "eagerloco.comm.base",
    "WorkerStats": "eagerloco.comm.base",
    "Connection": "eagerloco.comm.connect",
    "connect": "eagerloco.comm.connect",
    "PeerError": "eagerloco.comm.errors",
    "InProcessGroup": "eagerloco.comm.inprocess",
    "ConfigError": "eagerloco.config",
    "LinkConfig": "eagerloco.config",
    "OuterConfig": "eagerloco.config",
    "TrainConfig": "eagerloco.config",
    "MissingExtraError": "eagerloco.extras",
    "OuterLoop": "eagerloco.hooks",
    "exit_on_errors": "eagerloco.hooks",
    "outer_loop": "eagerloco.hooks",
    "OuterSync": "eagerloco.outer",
}

__all__ = ["Communicator", "ConfigError", "Connection", "Handle", "InProcessGroup", "LinkConfig", "MissingExtraError",
           "OuterConfig", "OuterLoop", "OuterSync", "PeerError", "TrainConfig", "WorkerStats", "connect",
           "exit_on_errors", "outer_loop"]


def __getattr__(name: str) -> object:
    """Import the module defining a public name on first access and cache the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eagerloco' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API only (what ``__all__`` lists, and ``__version__``), loaded or not."""
    return sorted([*__all__, "__version__"])
