"""Debian packages as a text source: `apt-get download` (never install), `dpkg-deb -x` into the cache, where the
.deb files stay so that a damaged document is rebuilt without the archive.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagerloco.data.cache import DataError, file_entry, note
from eagerloco.data.store import Doc


class _BadDeb(DataError):
    """A cached .deb that dpkg-deb cannot unpack: worth one fresh download."""


_APT_NEEDS_UPDATE = re.compile(
    r"Unable to locate package|has no installation candidate|Can't select (candidate )?version|No packages found"
)


def _apt_hint(packages: Sequence[str]) -> str:
    return (
        f"run `apt-get download {' '.join(packages)}` (no install) on a Debian/Ubuntu machine that reaches its "
        "package archive, or pass --data with another source or your own .txt files"
    )


def _cached_deb(directory: Path, package: str) -> Path | None:
    found = sorted(directory.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def _apt_download(directory: Path, packages: Sequence[str]) -> None:
    """Fetch the .deb files of ``packages`` into ``directory`` (each appears whole or not at all)."""
    if shutil.which("apt-get") is None:
        raise DataError(f"{', '.join(packages)}: not cached and apt-get is not on PATH: {_apt_hint(packages)}")
    note(f"fetching {', '.join(packages)} with apt-get download into {directory} (once)")
    work = Path(tempfile.mkdtemp(dir=directory, prefix=".apt-download-"))
    try:
        cmd = ["apt-get", "download", *packages]
        try:
            proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise DataError(f"`{' '.join(cmd)}` failed ({e}): {_apt_hint(packages)}") from e
        got = {p: _cached_deb(work, p) for p in packages}
        if proc.returncode != 0 or None in got.values():
            out = (proc.stderr or "") + (proc.stdout or "")
            if _APT_NEEDS_UPDATE.search(out):
                raise DataError(
                    f"`{' '.join(cmd)}` cannot find the packages: the package lists are empty or stale. "
                    f"Run `apt-get update` first (as root), then retry.\n{out.strip()[-800:]}"
                )
            raise DataError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {out.strip()[-800:]}\n"
                            + _apt_hint(packages))
        for p, path in got.items():
            assert path is not None
            old = _cached_deb(directory, p)
            if old is not None:
                old.unlink()
            os.replace(path, directory / path.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dpkg_extract(deb: Path, dest: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        raise DataError(f"dpkg-deb is not on PATH: it unpacks {deb.name} (the `dpkg` package provides it)")
    try:
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"`dpkg-deb -x {deb.name}` failed: {e}") from e
    if proc.returncode != 0:
        raise _BadDeb(f"`dpkg-deb -x {deb}` failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")


def from_debs(
    directory: Path, packages: Sequence[str], parse: Callable[[Path], list[Doc]]
) -> tuple[list[Doc], dict[str, Any]]:
    """Unpack the packages' .deb files (cached ones first; one that will not unpack is downloaded again) into a scratch
    tree in the cache, parse it and remove it."""
    for attempt in range(2):
        if attempt == 1 or any(_cached_deb(directory, p) is None for p in packages):
            _apt_download(directory, packages)
        debs = [d for p in packages if (d := _cached_deb(directory, p)) is not None]
        if len(debs) != len(packages):  # pragma: no cover - _apt_download raises first
            raise DataError(f"{directory}: .deb files of {', '.join(packages)} missing after download")
        tree = Path(tempfile.mkdtemp(dir=directory, prefix=".unpacked-"))
        try:
            for deb in debs:
                _dpkg_extract(deb, tree)
            return parse(tree), {"debs": {d.name: file_entry(d) for d in debs}}
        except _BadDeb:
            if attempt == 1:
                raise
            for deb in debs:
                deb.unlink(missing_ok=True)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    raise AssertionError("unreachable")  # pragma: no cover
