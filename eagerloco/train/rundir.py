"""The run directory (``--out``), guarded: checked before the first step, locked while a run writes it.

A run refuses to start in a directory that holds another run's files unless it continues it
(``--resume``) or replaces it (``--overwrite``), and a lock file naming the holder's process and
host keeps two runs out of one directory. A lock left by a process that no longer exists on this
host is taken over with a message.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.procs import pid_alive

LOCK_NAME = ".eagerloco.lock"
#: What a run leaves in its directory; any of them marks the directory as another run's.
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "tensorboard")


def check_out_dir(out: str) -> Path:
    """The ``--out`` directory, made if needed and checked writable before anything runs.

    Raises:
        ConfigError: empty, a file, under a file, or not writable; the message names it and the fix.
    """
    if not isinstance(out, str) or not out.strip():
        raise ConfigError("--out must name a directory for the run's files, got an empty path")
    path = Path(out)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is" if parent == path else f"is under {parent}, which is"
            raise ConfigError(f"--out {out} {where} a file, not a directory; pass a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {out} is not a writable directory ({e.strerror or e}); "
                          "pass a directory you can write to") from None
    return path


def earlier_run(path: Path) -> list[str]:
    """The files of a run already in ``path`` (empty when there is none)."""
    found = []
    for name in RUN_FILES:
        target = path / name
        if not target.exists():
            continue
        if name == "checkpoints":
            steps = sorted(p.name for p in target.glob("step_*"))
            if not steps and not any(target.iterdir()):
                continue
            found.append(f"checkpoints ({steps[0]} .. {steps[-1]})" if steps else "checkpoints")
        else:
            found.append(name)
    return found


def check_fresh_start(cfg: TrainConfig, path: Path) -> None:
    """Refuse to start a new run over another run's files; with ``--overwrite``, remove them.

    Raises:
        ConfigError: the directory holds another run and neither --resume nor --overwrite was given.
    """
    if cfg.resume:
        return
    found = earlier_run(path)
    if not found:
        return
    if not cfg.overwrite:
        raise ConfigError(
            f"--out {path} holds an earlier run ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to replace it, or another --out"
        )


def clear_earlier_run(path: Path) -> None:
    """Remove an earlier run's files (``--overwrite``), leaving anything else in the directory alone."""
    for name in RUN_FILES:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def remove_leftovers(path: Path) -> None:
    """Remove what a run that stopped mid-write left in ``path`` (unfinished checkpoints, a summary.json.tmp),
    with a line saying so. Call while no process of the run writes."""
    from eagerloco.checkpoint import checkpoint_root, remove_staging

    gone = [str(p.name) for p in remove_staging(checkpoint_root(path))]
    tmp = path / "summary.json.tmp"
    if tmp.exists():
        tmp.unlink()
        gone.append(tmp.name)
    if gone:
        print(f"eagerloco: removed what an earlier run left unfinished in {path}: {', '.join(gone)}",
              file=sys.stderr, flush=True)


    return True


class RunLock:
    """``<out>/.eagerloco.lock`` held while a run writes its directory.

    Args:
        path: the run directory (checked by :func:`check_out_dir`).
    """

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock, or take over a stale one.

        Raises:
            ConfigError: a live process (on this host, or any process on another host) holds it.
        """
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # written between our try and our read, or torn: look again
                if holder.get("host") != me["host"] or pid_alive(int(holder.get("pid", -1))):
                    raise ConfigError(
                        f"--out {self.path.parent} is in use by another run (process {holder.get('pid')} on "
                        f"{holder.get('host')}); wait for it to finish or pass another --out "
                        f"(if that run is gone, delete {self.path})"
                    ) from None
                print(f"eagerloco: taking over {self.path} from process {holder.get('pid')}, which no longer "
                      "runs", file=sys.stderr, flush=True)
                self.path.unlink(missing_ok=True)
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except OSError:  # a full disk: leave no empty lock behind
                self.path.unlink(missing_ok=True)
                raise
            self.held = True
            return self
        raise ConfigError(f"--out {self.path.parent}: could not take the run lock {self.path}; "
                          "another run keeps taking it: pass another --out")

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            age = time.time() - self.path.stat().st_mtime if self.path.exists() else 0.0
            return {"pid": -1, "host": socket.gethostname()} if age > 5.0 else None
        return holder if isinstance(holder, dict) else None

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(cfg: TrainConfig) -> RunLock:
    """Check ``--out``, lock it and check it holds no other run (clearing it with ``--overwrite``).

    Returns:
        The held lock; release it (or use it as a context manager) when the run ends.

    Raises:
        ConfigError: see :func:`check_out_dir`, :meth:`RunLock.acquire` and :func:`check_fresh_start`.
    """
    path = check_out_dir(cfg.out)
    lock = RunLock(path).acquire()
    try:
        check_fresh_start(cfg, path)
        if cfg.overwrite and not cfg.resume:
            clear_earlier_run(path)
        remove_leftovers(path)
    except BaseException:
        lock.release()
        raise
    return lock


def guard_run_dir(cfg: TrainConfig, reporting: bool) -> RunLock | None:
    """The run-directory guard of one process of a multi-process run.

    The reporting process claims the directory (:func:`claim`); every other process checks, before
    the processes meet, that it holds no other run, so that a refused start fails on every process
    with the same message.

    Returns:
        The held lock on the reporting process, else None.
    """
    if reporting:
        return claim(cfg)
    if not cfg.overwrite:
        check_fresh_start(cfg, Path(cfg.out))
    return None


__all__ = ["LOCK_NAME", "guard_run_dir", "RunLock", "check_fresh_start", "check_out_dir", "claim", "clear_earlier_run",
           "earlier_run", "remove_leftovers"]
