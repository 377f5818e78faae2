"""The errors the outer transport raises, and how a backend's error is shortened for a message."""

from __future__ import annotations

import re


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
