"""The errors the outer transport raises, how a backend's error is shortened for a message, and how an error
that names command-line flags is said through the Python API (the arguments' names)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import fields
from typing import ParamSpec, TypeVar

from eagerloco.config import ConfigError, OuterConfig

P = ParamSpec("P")
R = TypeVar("R")

#: The exit status of a process that stopped because a peer failed (the command line's, for PeerError).
PEER_EXIT_CODE = 3
#: The exit status of a process whose workers launched different exchanges (ScheduleMismatchError).
MISMATCH_EXIT_CODE = 4


class PeerError(RuntimeError):
    """Another worker died, hung or left: the exchange cannot complete; ``workers`` lists the outer-group indices of
    the workers held responsible (may be empty)."""

    def __init__(self, message: str, workers: list[int] | None = None) -> None:
        super().__init__(message)
        self.workers = list(workers or [])


class ScheduleMismatchError(RuntimeError):
    """Workers launched different exchanges at the same position (a bug in the caller's schedule)."""


class TransportError(Exception):
    """A collective failed (peer gone, timeout); wraps the backend's exception."""


def describe_exception(e: BaseException) -> str:
    """The gist of a backend error: first sentence, without the source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:200]


def is_transport_failure(e: BaseException) -> bool:
    """Whether e is a raw error of the collective backend (a peer gone, a timeout), not one of ours."""
    if isinstance(e, (PeerError, ScheduleMismatchError)) or not isinstance(e, Exception):
        return False
    if type(e).__name__ in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("gloo" in text or "Connection reset by peer" in text
                                            or "Connection closed by peer" in text)


#: Flags named by settings' errors, and the argument of outer_loop each one is.
# resume: the command line resumes with a flag; the API loads the checkpoint's outer state into the loop.
_API_NAMES = {"dist-timeout": "timeout_s", "no-outer-nesterov": "outer_nesterov=False", "resume": "load_state_dict()"}


def api_message(text: str) -> str:
    """A settings error as the Python API says it: the argument (``inner_steps``) where the command
    line's message names its flag (``--inner-steps``)."""
    known = {f.name for f in fields(OuterConfig)} | {"outer_addr", "worker_id", "workers", "ranks_per_worker"}

    def name(m: re.Match[str]) -> str:
        flag = m.group(1)
        arg = _API_NAMES.get(flag, flag.replace("-", "_"))
        return arg if arg in known or flag in _API_NAMES else m.group(0)

    return re.sub(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)", name, text)


def api_error(e: BaseException) -> BaseException:
    """``e`` as the Python API says it: a ConfigError, PeerError or ScheduleMismatchError naming the arguments
    where its message names flags (:func:`api_message`; a PeerError keeps the workers it blames), else ``e``."""
    if not isinstance(e, (ConfigError, PeerError, ScheduleMismatchError)) or api_message(str(e)) == str(e):
        return e
    text = api_message(str(e))
    if isinstance(e, PeerError):
        return PeerError(text, e.workers)
    return ConfigError(text) if isinstance(e, ConfigError) else ScheduleMismatchError(text)


def api_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Settings and peer errors raised by ``fn`` name the arguments (:func:`api_error`), on their own: no chain."""
    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, PeerError, ScheduleMismatchError) as e:
            raise api_error(e) from None

    return wrapped
