"""Optional packages: each comes with an extra of the package, and a missing one is one line naming it.

Every import of an optional package goes through :func:`require`, so that a missing one is a
:class:`MissingExtraError` naming the extra (``pip install 'eagerloco[plot]'``), never an ImportError traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: Top-level module of each optional package -> the extra that installs it (pyproject.toml).
EXTRAS: dict[str, str] = {
    "matplotlib": "plot",
    "pyarrow": "evals",
    "rdata": "data",
    "tokenizers": "bpe",
    "tensorboard": "tensorboard",
    "transformers": "hf",
    "accelerate": "hf",
    "pytorch_lightning": "lightning",
}


class MissingExtraError(ImportError):
    """An optional package is not installed (or does not import); the message names the extra to install."""


def _missing(module: str, needed_for: str, reason: ImportError | None) -> MissingExtraError:
    top = module.partition(".")[0]
    why = "" if reason is None or reason.name == top else f" (importing it failed: {reason})"
    return MissingExtraError(f"{needed_for} needs the {top} package{why}: pip install 'eagerloco[{EXTRAS[top]}]'",
                             name=top)


def require(module: str, needed_for: str) -> ModuleType:
    """Import an optional module (its top-level package a key of :data:`EXTRAS`), or raise the
    :class:`MissingExtraError` that says what needs it (``needed_for``) and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # the package itself missing: no chained traceback; a failure inside it: chained
        raise _missing(module, needed_for, e) from (None if e.name == module.partition(".")[0] else e)


def check(module: str, needed_for: str) -> None:
    """Raise :class:`MissingExtraError` now if an optional package is missing, without importing it: a command refuses
    at its start what it would otherwise find missing at its end."""
    top = module.partition(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except ImportError as e:
        raise _missing(top, needed_for, e) from None
    if not found:
        raise _missing(top, needed_for, None)
