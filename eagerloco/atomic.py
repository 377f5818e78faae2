"""Files written atomically: a reader sees the old file or the new one, and a crash leaves no half-written file.

A temporary file beside the target, fsynced, renamed over it, then the directory fsynced. Written here rather
than taken from a library: it is six calls, and the library that did it (atomicwrites) is archived.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable; a file system that cannot is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, temp: Path | None = None) -> Iterator[BinaryIO]:
    """A binary file for ``path``'s new content (0644), which replaces ``path`` when the block ends without an error.

    ``temp``: a fixed temporary name, for a file whose leftover a run lists and removes; by default a fresh one, so
    that processes writing the same file at once never share it."""
    if temp is None:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
    else:
        fd, tmp = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), temp
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; what is written here is read by other users and ranks
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written temporary left behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes, temp: Path | None = None) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, temp) as f:
        f.write(data)
