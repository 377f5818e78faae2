"""The on-disk cache shared by every source: its location, checksums and lock."""

from __future__ import annotations

import errno
import hashlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from eagerloco.environment import Environment

# Version of the manifests of the source caches (the document stores). Every file a source
# writes is listed there with its size and sha256, so a second run reads the cache instead of
# downloading, and a damaged file is rebuilt from the cached package instead of downloading it again.
MANIFEST_VERSION = 1


T = TypeVar("T")

#: Errors of a cache that cannot be written: a read-only mount, or a directory of another user.
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class DataError(RuntimeError):
    """The corpus cannot be produced; the message says what to run or pass instead."""


class ReadOnlyCacheError(DataError):
    """The cache lacks something and cannot be written (read-only, or another user's)."""


def default_data_dir(data_dir: str | Path | None = None) -> Path:
    """Argument, else $EAGERLOCO_DATA_DIR, else ~/.cache/eagerloco."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = Environment.read().data_dir
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagerloco"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A cached file's manifest entry: its size and sha256."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def matches(path: Path, entry: Mapping[str, Any]) -> bool:
    """Whether a cached file has the size and sha256 its manifest entry records."""
    return bool(path.stat().st_size == entry["size"] and file_sha256(path) == entry["sha256"])


def built_once(directory: Path, what: str, read: Callable[[], T | None], build: Callable[[], None]) -> T:
    """What ``read`` finds in the cache (None: nothing intact), built when missing by one of the processes
    sharing the cache, under the lock of ``directory``, then read back."""
    found = read()
    if found is not None:
        return found
    with locked(directory, what):
        found = read()  # another process built it while this one waited
        if found is None:
            build()
            found = read()
    if found is None:  # pragma: no cover - only if the disk changes under us
        raise DataError(f"{directory}: {what} could not be read back after writing")
    return found


@contextmanager
def locked(directory: Path, what: str = "what this run needs") -> Iterator[None]:
    """Serialize fetches by processes sharing one cache (torchrun ranks); creates ``directory``. Taken only to
    write, so a read-only cache that holds everything works; ReadOnlyCacheError naming ``what`` is missing
    and the fix when it cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(directory / ".lock")
        lock.acquire()
    except OSError as e:
        if e.errno not in READ_ONLY_ERRNOS:
            raise
        raise ReadOnlyCacheError(
            f"the data cache {directory} cannot be written ({e.strerror}) and lacks {what}: make it writable, "
            f"or pass --data-dir (or set EAGERLOCO_DATA_DIR) with a writable directory; copy the cache there "
            "to keep what it holds"
        ) from None
    try:
        yield
    finally:
        lock.release()


def note(message: str) -> None:
    """One progress line on stderr for slow one-time work (downloads, tokenizer training, encoding)."""
    print(f"eagerloco: {message}", file=sys.stderr, flush=True)
