"""The per-run logs (metrics.jsonl) of a finished comparison, packed into one archive and back.

    python bench/archive_metrics.py pack bench/results/compare_seeds      # -> compare_seeds/metrics.tar.xz
    python bench/archive_metrics.py unpack bench/results/compare_seeds    # every log back in its run dir

``pack`` puts every ``metrics.jsonl`` below the directory into ``<dir>/metrics.tar.xz`` (adding to
what the archive already holds; a log on disk replaces its copy there), checks the archive against
the files, and removes them. The archive is reproducible: members sorted by path, no directories,
mtime 0, owner 0:0 without names, mode 0644, so the same logs give the same bytes. ``unpack``
writes the logs back where they were; the archive stays. ``tar -xJf <dir>/metrics.tar.xz -C <dir>``
does the same.

The logs matter to ``eagerloco compare``: it reuses a finished run only where both its summary.json
and its metrics.jsonl are there, and draws the curves (and the spiked mark) from the logs. Unpack
before rerunning a comparison's command; pack again when it is done.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

ARCHIVE = "metrics.tar.xz"
LOG = "metrics.jsonl"


def _read(archive: Path) -> dict[str, bytes]:
    if not archive.is_file():
        return {}
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _write(archive: Path, logs: dict[str, bytes]) -> None:
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", format=tarfile.GNU_FORMAT, preset=9) as tar:
        for name in sorted(logs):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(logs[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(logs[name]))
    tmp.replace(archive)


def pack(directory: Path) -> tuple[int, int]:
    """Pack the logs below ``directory``; returns (logs packed from disk, logs in the archive)."""
    archive = directory / ARCHIVE
    on_disk = {str(p.relative_to(directory)): p for p in sorted(directory.rglob(LOG))}
    logs = _read(archive) | {name: p.read_bytes() for name, p in on_disk.items()}
    _write(archive, logs)
    if _read(archive) != logs:
        raise SystemExit(f"{archive}: reads back different from the logs; nothing removed")
    for p in on_disk.values():
        p.unlink()
    return len(on_disk), len(logs)


def unpack(directory: Path) -> int:
    """Write every log of ``directory``'s archive back in its place; returns how many."""
    logs = _read(directory / ARCHIVE)
    for name, data in logs.items():
        target = (directory / name).resolve()
        if directory.resolve() not in target.parents or not name.endswith(LOG):
            raise SystemExit(f"{directory / ARCHIVE}: member {name!r} is not a {LOG} below {directory}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return len(logs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("dirs", nargs="+", type=Path, help="comparison directories, e.g. bench/results/compare_seeds")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not d.is_dir():
            print(f"{d}: no such directory", file=sys.stderr)
            return 2
        if args.action == "pack":
            new, total = pack(d)
            print(f"{d / ARCHIVE}: {total} logs ({new} packed now)")
        else:
            if not (d / ARCHIVE).is_file():
                print(f"{d / ARCHIVE}: no such archive", file=sys.stderr)
                return 2
            print(f"{d}: {unpack(d)} logs unpacked from {ARCHIVE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
