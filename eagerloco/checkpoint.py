"""Checkpoints that survive crashes: written atomically, verified on load, never half-read.

Layout: ``<run>/checkpoints/step_00000100/`` holds one ``worker_<m>.pt`` per worker and a
``meta.json`` listing every file with its size and SHA-256. The directory is built under a
temporary name and renamed into place only when complete, so a crash mid-write leaves the
previous checkpoint as the newest one. Loading verifies every checksum; a corrupt or truncated
checkpoint is refused with a message naming the file, and the previous one is used.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
_PREFIX = "step_"


#: Write errors that mean "no room here" (a full disk, a quota, a file size limit) or "no writing here".
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message says which file or directory
    is wrong and what to do."""


def newest_intact(root: Path) -> tuple[Path, int] | None:
    """The newest checkpoint under root that verifies, and its step, without reporting the others."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, int(verify(path)["step"])
        except CheckpointError:
            continue
    return None


def resume_hint(root: Path) -> str:
    """Which checkpoint a run continues from with --resume (or that there is none yet)."""
    found = newest_intact(root)
    if found is None:
        return f"there is no intact checkpoint under {root} yet, so a rerun starts afresh"
    return f"the newest good checkpoint is {found[0]} (step {found[1]}): run the same command with --resume"


def write_failure(root: Path, step: int, e: OSError) -> CheckpointError:
    """The error for a checkpoint that could not be written, its staging directory removed.

    Args:
        root: the checkpoints directory; step: the checkpoint's step; e: the write error.

    Returns:
        A CheckpointError naming the directory, the reason, and the checkpoint to resume from.
    """
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


def _fsync_dir(path: Path) -> None:
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


def _write_bytes(path: Path, data: bytes) -> None:
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
    """Serialize one worker's state into the staging directory; returns its manifest entry.

    Raises:
        CheckpointError: the file cannot be written (a full disk...); the staging directory is removed.
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"worker_{worker}.pt"
    try:
        stage.mkdir(parents=True, exist_ok=True)
        _write_bytes(stage / name, data)
    except OSError as e:
        raise write_failure(stage.parent, _stage_step(stage), e) from None
    return {"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _stage_step(stage: Path) -> int:
    return int(stage.name.rsplit("_", 1)[1])


def publish(root: Path, step: int, entries: list[dict[str, Any]], meta: dict[str, Any], keep: int = 2) -> Path:
    """Write meta.json last, rename the staging directory into place, prune old checkpoints.

    Raises:
        CheckpointError: meta.json cannot be written (a full disk...); the staging directory is removed.
    """
    stage = staging_dir(root, step)
    full = {"format": FORMAT_VERSION, "step": step, "files": entries, **meta}
    try:
        _write_bytes(stage / "meta.json", (json.dumps(full, indent=1, default=str) + "\n").encode())
    except OSError as e:
        raise write_failure(root, step, e) from None
    _fsync_dir(stage)
    final = checkpoint_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    _fsync_dir(root)
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save(root: Path, step: int, states: dict[int, dict[str, Any]], meta: dict[str, Any], keep: int = 2) -> Path:
    """Save every worker's state of a process that holds them all (the in-process runtime)."""
    stage = staging_dir(root, step)
    if stage.exists():
        shutil.rmtree(stage)
    entries = [write_worker_state(stage, m, s) for m, s in sorted(states.items())]
    return publish(root, step, entries, meta, keep)


def remove_staging(root: Path) -> list[Path]:
    """Remove what checkpoints that were never completed left under root (a crash, a full disk).

    Call only while no process of the run writes checkpoints. Returns the directories removed.
    """
    gone = sorted(root.glob(f".partial-{_PREFIX}*")) if root.is_dir() else []
    for stage in gone:
        shutil.rmtree(stage, ignore_errors=True)
    return gone


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def verify(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Meta of a checkpoint whose every file matches its size and checksum.

    Args:
        path: the checkpoint directory.
        required: meta keys that must hold a table (the caller's own records, e.g. "config").

    Raises:
        CheckpointError: naming the first problem found.
    """
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{meta_path} is missing: the checkpoint was not completed") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is unreadable or corrupt ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "files" not in meta:
        raise CheckpointError(f"{meta_path} is not an eagerloco checkpoint of format {FORMAT_VERSION}")
    problem = _meta_problem(meta) or next(
        (f"it records no {key!r} table" for key in required if not isinstance(meta.get(key), dict)), "")
    if problem:
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


def _meta_problem(meta: dict[str, Any]) -> str:
    """What is wrong with a meta.json that parses, or "" (a hand-edited or foreign file must not crash a resume)."""
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
    return ""


def load_worker_state(path: Path, worker: int) -> dict[str, Any]:
    """One worker's (rank's) saved state.

    Raises:
        CheckpointError: the checkpoint has no file for this worker, or it cannot be read.
    """
    f = path / f"worker_{worker}.pt"
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except FileNotFoundError as e:
        raise CheckpointError(f"{f} is missing: this checkpoint has no state for worker {worker}") from e
    except Exception as e:  # a file that passed its checksum but is no torch file: written by something else
        raise CheckpointError(f"{f} cannot be read as a checkpoint ({type(e).__name__}: {e})") from e


def latest_valid(root: Path, log: Any = None, required: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (see :func:`verify`), skipping (and reporting) corrupt ones.

    Returns:
        Its path and meta, or None when there is no checkpoint at all.

    Raises:
        CheckpointError: there are checkpoints but none verifies; each problem is listed.
    """
    problems = []
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path, required)
        except CheckpointError as e:
            problems.append(str(e))
            print(f"eagerloco: skipping checkpoint {path.name}: {e}", file=log or sys.stderr)
    if problems:
        raise CheckpointError(
            "no usable checkpoint under " + str(root) + ":\n  " + "\n  ".join(problems)
            + "\nstart a fresh run (drop --resume) or restore a good copy of the checkpoint directory"
        )
    return None
