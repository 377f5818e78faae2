"""The errors the outer transport raises, and how a backend's error is shortened for a message."""

from __future__ import annotations

import re

#: The exit status of a process that stopped because a peer failed (the command line's, for PeerError).
PEER_EXIT_CODE = 3
#: The exit status of a process whose workers launched different exchanges (ScheduleMismatchError).
MISMATCH_EXIT_CODE = 4


class PeerError(RuntimeError):
    """Another worker died, hung or left: the exchange cannot complete.

    ``workers`` lists the outer-group indices of the workers held responsible (may be empty when
    no heartbeat information is available).
    """

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
