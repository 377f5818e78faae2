"""eagerloco: DiLoCo, Streaming DiLoCo and eager outer updates for training across slow links.

The public names are loaded on first use (PEP 562), so tools that need no torch (the simulator,
``eagerloco simulate``) start without importing it.
"""

__version__ = "0.1.0"

#: Public name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "CODEC_NAMES": "eagerloco.codecs",
    "get_codec": "eagerloco.codecs",
    "Communicator": "eagerloco.comm.base",
    "Handle": "eagerloco.comm.base",
    "WorkerStats": "eagerloco.comm.base",
    "InProcessGroup": "eagerloco.comm.inprocess",
    "PeerError": "eagerloco.comm.errors",
    "ConfigError": "eagerloco.config",
    "MissingExtraError": "eagerloco.extras",
    "LinkConfig": "eagerloco.config",
    "OuterConfig": "eagerloco.config",
    "CombinedOptimizer": "eagerloco.optim",
    "muon_parameters": "eagerloco.optim",
    "muon_with_adamw": "eagerloco.optim",
    "OuterLoop": "eagerloco.hooks",
    "OuterSync": "eagerloco.outer",
    "after_inner_step_all": "eagerloco.outer",
    "before_inner_step_all": "eagerloco.outer",
    "exit_on_errors": "eagerloco.hooks",
    "outer_loop": "eagerloco.hooks",
}

__all__ = sorted(_EXPORTS)


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
