"""``<out>/.eagerloco-run.json``: the files a run created in its directory, so that ``--overwrite``
removes exactly those.

The reporting process lists each path before (or as) it creates it, rewriting the list atomically and
rereading it first (a new reporter extends it). :func:`remove` never removes through a symbolic link,
nor an entry no longer of the kind the run made, nor a directory someone else put a file in."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagerloco import checkpoint as ckpt
from eagerloco.config import ConfigError
from eagerloco.jsonfiles import write_json_atomic

MANIFEST_NAME = ".eagerloco-run.json"
LOCK_NAME = ".eagerloco.lock"
FORMAT = 1
#: What a run writes at the top of its directory, besides the lock and the manifest.
RUN_NAMES = ("metrics.jsonl", "summary.json", "summary.json.tmp", "checkpoints", "tensorboard")
#: Those of them that are directories.
RUN_DIRS = ("checkpoints", "tensorboard")
#: eagerloco's own bookkeeping files: never a reason to refuse a directory, never removed by --overwrite.
OWN_NAMES = (LOCK_NAME, MANIFEST_NAME, MANIFEST_NAME + ".tmp")


#: Paths relative to the run directory ("checkpoints/step_00000002/meta.json") -> "file" or "dir".
Entries = dict[str, str]


def kind_of(path: Path) -> str | None:
    """"link", "dir", "file", "other", or None (nothing there), from one lstat: a file another rank renames
    into place meanwhile is seen as absent or as a file, never as something else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def read_manifest(out: Path) -> Entries | None:
    """The entries of ``out``'s manifest (None: none); ConfigError for one that is not eagerloco's or unreadable."""
    path = out / MANIFEST_NAME
    kind = kind_of(path)
    if kind is None:
        return None
    fix = f"restore it, or move the run's files out of {out} and delete it"
    if kind != "file":
        raise ConfigError(f"{path} is a {'symbolic link' if kind == 'link' else kind}, not the list of the files of "
                          f"the eagerloco run in {out}: {fix}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); it lists the files of the eagerloco run in {out}: "
                          f"{fix}") from None
    problem = _manifest_problem(raw)
    if problem:
        raise ConfigError(f"{path}: {problem}; {fix}")
    return dict(raw["entries"])


def _manifest_problem(raw: Any) -> str:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return f"not an eagerloco run manifest of format {FORMAT}"
    entries = raw.get("entries")
    if not isinstance(entries, dict):
        return "'entries' must be a table of paths"
    for rel, kind in entries.items():
        if kind not in ("file", "dir"):
            return f"entry {rel!r} has kind {kind!r}, not 'file' or 'dir'"
        parts = rel.split("/")
        if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts) or rel == MANIFEST_NAME:
            return f"entry {rel!r} is not a path inside the run directory"
    return ""


class RunManifest:
    """The manifest of the run directory ``out``; only the process that reports writes it."""

    def __init__(self, out: Path | str) -> None:
        self.out = Path(out)
        self.path = self.out / MANIFEST_NAME

    def entries(self) -> Entries:
        """The listed entries (none without a manifest)."""
        return read_manifest(self.out) or {}

    def write(self, entries: Entries) -> None:
        """Replace the manifest (atomically)."""
        write_json_atomic(self.path, {"format": FORMAT, "written_by": "eagerloco",
                                      "entries": dict(sorted(entries.items()))})

    def record(self, add: Entries | None = None, drop: Iterable[str] = ()) -> None:
        """Add entries and drop others, rereading the file first (the reporting process can change)."""
        entries = self.entries()
        for rel in drop:
            entries.pop(rel, None)
        entries.update(add or {})
        self.write(entries)

    def rel(self, path: Path) -> str:
        """``path`` relative to the run directory, as listed."""
        return path.relative_to(self.out).as_posix()

    def staging(self, step: int) -> Entries:
        """The entry of the staging directory of step's checkpoint (list it before any process writes it)."""
        return {self.rel(ckpt.staging_dir(ckpt.checkpoint_root(self.out), step)): "dir"}

    def record_checkpoint(self, final: Path, files: Iterable[str], next_step: int | None = None) -> None:
        """A published checkpoint: its directory, meta.json and files; its staging directory and the
        checkpoints pruned since are dropped, and the next checkpoint's staging directory listed."""
        root, name = self.rel(final.parent), final.name
        entries = self.entries()
        pruned = [r for r in entries if r.startswith(root + "/step_") and kind_of(self.out / r) is None]
        add = {f"{root}/{name}": "dir", f"{root}/{name}/meta.json": "file",
               **{f"{root}/{name}/{f}": "file" for f in files}}
        if next_step is not None:
            add.update(self.staging(next_step))
        self.record(add, drop=[*pruned, f"{root}/.partial-{name}"])


def survey(out: Path, listed: Entries) -> tuple[Entries, list[str]]:
    """(The listed entries present as the kind listed, with the checkpoint files in listed staging
    directories; the paths under :data:`RUN_NAMES` that are not the run's, each named at its topmost point)."""
    try:
        ours = {rel: kind for rel, kind in listed.items() if rel not in OWN_NAMES and kind_of(out / rel) == kind}
        for rel in [r for r, k in ours.items() if k == "dir" and ckpt.STAGING_NAME.fullmatch(r.rsplit("/", 1)[-1])]:
            for child in (out / rel).iterdir():
                if ckpt.FILE_NAME.fullmatch(child.name) and kind_of(child) == "file":
                    ours[f"{rel}/{child.name}"] = "file"
        foreign: list[str] = []
        for name in RUN_NAMES:
            _foreign(out, name, ours, foreign, top=True)
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename or out} ({e.strerror or e}); make it readable or pass another "
                          "--out") from None
    return ours, foreign


def _foreign(out: Path, rel: str, ours: Entries, found: list[str], top: bool = False) -> None:
    path = out / rel
    kind = kind_of(path)
    if kind is None:
        return
    # A run's directories are looked into, a symbolic link to one at the top too (a `checkpoints` on another disk).
    top_dir = top and rel in RUN_DIRS
    if (kind == "dir" and (top_dir or rel in ours)) or (top_dir and kind == "link" and path.is_dir()):
        for child in sorted(path.iterdir()):
            _foreign(out, f"{rel}/{child.name}", ours, found)
    elif rel not in ours:
        found.append(rel)


def remove(out: Path, entries: Entries) -> tuple[list[str], list[str]]:
    """Remove the run's entries, deepest first, a directory only once empty, nothing no longer of the kind
    listed; returns (what was removed, the directories kept). ConfigError naming a file that cannot go."""
    removed: list[str] = []
    kept: list[str] = []
    for rel in sorted(entries, key=lambda r: (-r.count("/"), entries[r] == "dir", r)):
        path, kind = out / rel, entries[rel]
        if rel in OWN_NAMES or kind_of(path) != kind:
            continue
        try:
            if kind == "file":
                path.unlink()
            else:
                path.rmdir()
        except OSError as e:
            if kind == "dir" and e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                kept.append(rel)
                continue
            raise ConfigError(f"--overwrite: cannot remove {path} ({e.strerror or e}); make it writable or pass "
                              "another --out") from None
        removed.append(rel)
    return removed, kept


__all__ = ["Entries", "LOCK_NAME", "MANIFEST_NAME", "OWN_NAMES", "RUN_NAMES", "RunManifest", "kind_of",
           "read_manifest", "remove", "survey"]
