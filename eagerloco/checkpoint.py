"""Checkpoints that survive crashes: written atomically, verified on load, never half-read.

``<run>/checkpoints/step_00000100/`` holds one ``worker_<m>.pt`` per worker and a ``meta.json`` listing
each file's size and SHA-256, written last; the directory is built under a temporary name and renamed
into place when complete. A corrupt or truncated checkpoint is refused naming the file."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from eagerloco.atomic import fsync_dir

FORMAT_VERSION = 1
_PREFIX = "step_"
_STEP_NAME = re.compile(r"step_(\d{8,})")
#: The files a checkpoint directory holds, and the name of a checkpoint's staging directory.
FILE_NAME = re.compile(r"worker_\d+\.pt|meta\.json")
STAGING_NAME = re.compile(r"\.partial-step_\d{8,}")


#: Write errors that mean "no room here" (a full disk, a quota, a file size limit) or "no writing here".
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message says which file or directory
    is wrong and what to do."""


def intact(root: Path, check: Callable[[dict[str, Any]], str] | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The checkpoints under root that verify (:func:`verify`), newest first, with their meta."""
    for path in reversed(list_checkpoints(root)):
        try:
            meta = verify(path, check)
        except CheckpointError:
            continue
        yield path, meta


def newest_intact(root: Path) -> tuple[Path, int] | None:
    """The newest checkpoint under root that verifies, and its step, without reporting the others."""
    return next(((path, int(meta["step"])) for path, meta in intact(root)), None)


def resume_hint(root: Path) -> str:
    """Which checkpoint a run continues from with --resume (or that there is none yet)."""
    found = newest_intact(root)
    if found is None:
        return f"there is no intact checkpoint under {root} yet, so a rerun starts afresh"
    return f"the newest good checkpoint is {found[0]} (step {found[1]}): run the same command with --resume"


def write_failure(root: Path, step: int, e: OSError) -> CheckpointError:
    """The CheckpointError (naming the directory, the reason and the checkpoint to resume from) for step's
    checkpoint that could not be written under ``root``; its staging directory is removed."""
    shutil.rmtree(staging_dir(root, step), ignore_errors=True)
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the disk of {root} (or pass an --out on a bigger one)"
    elif e.errno == errno.EFBIG:
        fix = f"raise the file size limit (ulimit -f) for {root}"
    else:
        fix = f"make {root} writable"
    return CheckpointError(f"cannot write the checkpoint of step {step} under {root}: {why}; {fix}, then "
                           f"continue: {resume_hint(root)}")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _write_bytes(path: Path, data: bytes) -> None:
    """A file of the staging directory, which is the temporary of :mod:`eagerloco.atomic`'s recipe here: written
    in place and fsynced, renamed into place as a whole by :func:`publish`."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where step's checkpoint is, once published."""
    return root / f"{_PREFIX}{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    """Where the files of step's checkpoint are written before it is published."""
    return root / f".partial-{_PREFIX}{step:08d}"


def write_worker_state(stage: Path, worker: int, state: dict[str, Any]) -> dict[str, Any]:
    """Serialize one worker's state into the staging directory; returns its manifest entry (CheckpointError,
    the staging directory removed, when it cannot be written)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"worker_{worker}.pt"
    try:
        stage.mkdir(parents=True, exist_ok=True)
        _write_bytes(stage / name, data)
    except OSError as e:
        raise write_failure(stage.parent, int(stage.name.rsplit("_", 1)[1]), e) from None
    return {"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def publish(root: Path, step: int, entries: list[dict[str, Any]], meta: dict[str, Any], keep: int = 2) -> Path:
    """Write meta.json last, rename the staging directory into place, prune old checkpoints (CheckpointError,
    the staging directory removed, when meta.json cannot be written)."""
    stage = staging_dir(root, step)
    full = {"format": FORMAT_VERSION, "step": step, "files": entries, **meta}
    try:
        _write_bytes(stage / "meta.json", (json.dumps(full, indent=1, default=str) + "\n").encode())
    except OSError as e:
        raise write_failure(root, step, e) from None
    fsync_dir(stage)
    final = checkpoint_dir(root, step)
    if os.path.lexists(final) and not remove_checkpoint(final):
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint of step {step}: {final} holds files that are not a "
                              f"checkpoint's (or is a link); move it away, then continue: {resume_hint(root)}")
    os.replace(stage, final)
    fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:  # keep 0: [:-0] is empty, every checkpoint stays
        remove_checkpoint(old)
    return final


def remove_checkpoint(path: Path) -> bool:
    """Remove a checkpoint directory's own files (meta.json, worker_<m>.pt) and then the directory, which
    stays when anything else is in it; a symbolic link is left alone. Returns whether it is gone."""
    if path.is_symlink() or not path.is_dir():
        return False
    for f in path.iterdir():
        if FILE_NAME.fullmatch(f.name) and f.is_file() and not f.is_symlink():
            f.unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        return False
    return True


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints (directories ``step_NNNNNNNN``, not links), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_NAME.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(found)]


def verify(path: Path, check: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
    """Meta of a checkpoint whose every file matches its size and checksum; CheckpointError naming the first
    problem. ``check``: the caller's check of its own records (what is wrong, or "")."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{meta_path} is missing: the checkpoint was not completed") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is unreadable or corrupt ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "files" not in meta:
        raise CheckpointError(f"{meta_path} is not an eagerloco checkpoint of format {FORMAT_VERSION}")
    problem = _meta_problem(meta, path.name) or (check(meta) if check is not None else "")
    if problem:  # a hand-edited or foreign file must not crash a resume
        raise CheckpointError(f"{meta_path} is inconsistent: {problem}")
    for entry in meta["files"]:
        f = path / entry["file"]
        try:
            data = f.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{f} is missing or unreadable ({e})") from e
        if len(data) != entry["size"]:
            raise CheckpointError(f"{f} is truncated or padded: {len(data)} bytes, expected {entry['size']}")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{f} fails its SHA-256 check: the file is corrupt")
    return meta


def _meta_problem(meta: dict[str, Any], dirname: str) -> str:
    """What is wrong with the meta.json of the directory ``dirname`` that parses, or "" (a hand-edited or
    foreign file must not crash a resume)."""
    files = meta["files"]
    if not isinstance(files, list) or not files:
        return "'files' must be a non-empty list"
    for entry in files:
        if not isinstance(entry, dict):
            return f"a files entry is {entry!r}, not a table"
        name, size, digest = entry.get("file"), entry.get("size"), entry.get("sha256")
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            return f"a files entry names {name!r}, not a file of the checkpoint"
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"{name}: size {size!r} is not a byte count"
        if not isinstance(digest, str) or len(digest) != 64:
            return f"{name}: sha256 {digest!r} is not a SHA-256 digest"
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is not a step number"
    named = _STEP_NAME.fullmatch(dirname)
    if named and int(named.group(1)) != step:
        return (f"step {step} disagrees with its directory {dirname} (edited, or copied from another checkpoint): "
                "which step its files hold is unknown")
    return ""


def load_worker_state(path: Path, worker: int) -> dict[str, Any]:
    """One worker's (rank's) saved state; CheckpointError when there is no file for it or it cannot be read."""
    f = path / f"worker_{worker}.pt"
    try:
        state: dict[str, Any] = torch.load(f, map_location="cpu", weights_only=False)
        return state
    except FileNotFoundError as e:
        raise CheckpointError(f"{f} is missing: this checkpoint has no state for worker {worker}") from e
    except Exception as e:  # a file that passed its checksum but is no torch file: written by something else
        raise CheckpointError(f"{f} cannot be read as a checkpoint ({type(e).__name__}: {e})") from e


def latest_valid(root: Path, log: Any = None,
                 check: Callable[[dict[str, Any]], str] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint (path, meta) that verifies (:func:`verify`), reporting the corrupt ones skipped;
    None when there is none at all, CheckpointError listing each problem when none verifies."""
    problems = []
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path, check)
        except CheckpointError as e:
            problems.append(str(e))
            print(f"eagerloco: skipping checkpoint {path.name}: {e}", file=log or sys.stderr)
    if problems:
        which = "it" if len(problems) == 1 else f"none of its {len(problems)} checkpoints (each reported above)"
        raise CheckpointError(
            f"no usable checkpoint under {root}: {which} verifies (the newest: {problems[0]}); start a fresh run "
            "(drop --resume) or restore a good copy of the checkpoint directory"
        )
    return None
