"""Optional packages: each comes with an extra of the package, and a missing one is one line naming it.

``pip install eagerloco`` brings what the hook API and training need: torch, numpy, tqdm and filelock. The
rest is installed by extras (``pip install 'eagerloco[plot]'``, ``[all]`` for every one), and every
place that imports an optional package does it through :func:`require`, so that a missing package
is a :class:`MissingExtraError` whose message names the extra, never an ImportError traceback.
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


def install_command(module: str) -> str:
    """``pip install 'eagerloco[EXTRA]'`` for an optional module (a top-level name of :data:`EXTRAS`)."""
    return f"pip install 'eagerloco[{EXTRAS[module.partition('.')[0]]}]'"


def _missing(module: str, needed_for: str, reason: ImportError | None) -> MissingExtraError:
    top = module.partition(".")[0]
    why = "" if reason is None or reason.name == top else f" (importing it failed: {reason})"
    return MissingExtraError(f"{needed_for} needs the {top} package{why}: {install_command(top)}", name=top)


def require(module: str, needed_for: str) -> ModuleType:
    """Import an optional module (``matplotlib.pyplot``), or raise the one line that names its extra.

    Args:
        module: the module to import; its top-level package must be a key of :data:`EXTRAS`.
        needed_for: what needs it, as the message's subject (``"--plot"``, ``"the BPE tokenizer"``).

    Raises:
        MissingExtraError: the package is not installed, or it (or something it imports) failed to import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name == module.partition(".")[0]:
            raise _missing(module, needed_for, e) from None
        raise _missing(module, needed_for, e) from e


def check(module: str, needed_for: str) -> None:
    """Raise :class:`MissingExtraError` now if an optional package is not installed, without importing it:
    for a command to refuse at its start what it would otherwise find missing at its end.
    """
    top = module.partition(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except ImportError as e:
        raise _missing(top, needed_for, e) from None
    if not found:
        raise _missing(top, needed_for, None)


__all__ = ["EXTRAS", "MissingExtraError", "check", "install_command", "require"]
