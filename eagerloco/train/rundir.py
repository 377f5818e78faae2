"""The run directory (``--out``), guarded: checked before the first step, locked while a run writes it.

A run refuses a directory holding another run's files unless it continues it (``--resume``) or replaces
it (``--overwrite``, which removes exactly the files the earlier run's manifest lists and refuses
anything else at a run's paths)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, cast

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.procs import pid_alive
from eagerloco.train.manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    OWN_NAMES,
    RUN_NAMES,
    Entries,
    RunManifest,
    kind_of,
    read_manifest,
    remove,
    survey,
)

#: The name's start of the empty file that checks ``--out`` is writable (removed at once).
WRITE_PROBE = ".write-test-"
#: The files a run writes at the top of its directory, by what they hold (each must be a regular file or absent).
RUN_FILE_ROLES = {"metrics.jsonl": "metrics", "summary.json": "summary",
                  "summary.json.tmp": "summary while it is written", LOCK_NAME: "run lock",
                  MANIFEST_NAME: "list of the run's files",
                  MANIFEST_NAME + ".tmp": "list of the run's files while it is written"}


def check_out_dir(out: str) -> Path:
    """The ``--out`` directory, made if needed and checked writable; ConfigError naming the fix if not."""
    if not isinstance(out, str) or not out.strip():
        raise ConfigError("--out must name a directory for the run's files, got an empty path")
    path = Path(out)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            where = "is" if parent == path else f"is under {parent}, which is"
            raise ConfigError(f"--out {out} {where} a file, not a directory; pass a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f"{WRITE_PROBE}{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {out} is not a writable directory ({e.strerror or e}); "
                          "pass a directory you can write to") from None
    return path


def check_kinds(cfg: TrainConfig, path: Path) -> None:
    """Raise ConfigError unless each file a run writes in ``path`` is a regular file or absent (never a link
    or a directory), and ``checkpoints`` (and ``tensorboard`` when used) a directory or absent."""
    for name, role in RUN_FILE_ROLES.items():
        kind = kind_of(path / name)
        if kind not in (None, "file"):
            what = {"link": "a symbolic link", "dir": "a directory"}.get(kind, "not a regular file")
            raise ConfigError(f"{path / name} is {what}; eagerloco keeps the run's {role} in that file and never "
                              "writes through or removes anything else: move it away or pass another --out")
    for name, needed in (("checkpoints", True), ("tensorboard", cfg.tensorboard)):
        target = path / name
        if needed and kind_of(target) is not None and not target.is_dir():
            what = "a link to nothing" if kind_of(target) == "link" else "a file"
            raise ConfigError(f"{target} is {what}, not a directory; eagerloco keeps the run's {name} in that "
                              "directory: move it away or pass another --out")


def run_files(path: Path) -> tuple[Entries, list[str], bool]:
    """(The earlier run's entries present, by its manifest; the other paths at a run's names; whether
    ``path`` has no manifest)."""
    listed = read_manifest(path)
    ours, foreign = survey(path, listed or {})
    return ours, foreign, listed is None


def _summarize(ours: Entries) -> list[str]:
    found: list[str] = [name for name in ("metrics.jsonl", "summary.json", "summary.json.tmp") if name in ours]
    files = [r for r, k in ours.items() if k == "file"]
    steps = sorted({r.split("/")[1] for r in files if r.startswith("checkpoints/step_")}, key=lambda s: int(s[5:]))
    if steps:
        found.append(f"checkpoints ({steps[0]} .. {steps[-1]})")
    elif any(r.startswith("checkpoints/") for r in files):
        found.append("checkpoints")
    if any(r.startswith("tensorboard/") for r in files):
        found.append("tensorboard")
    return found


def _unlisted_top(path: Path, ours: Entries) -> list[str]:
    """The names at the top of ``path`` other than a run's paths (:func:`survey` looked into those) and
    eagerloco's bookkeeping."""
    tops = {rel.split("/", 1)[0] for rel in ours} | set(OWN_NAMES) | set(RUN_NAMES)
    try:
        names = os.listdir(path) if path.is_dir() else []  # compare checks a run's directory before making it
        return sorted(n for n in names if n not in tops and not n.startswith(WRITE_PROBE))
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror or e}); make it readable or pass another --out") from None


def _named(paths: list[str], most: int = 6) -> str:
    shown = ", ".join(paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def check_fresh_start(cfg: TrainConfig, path: Path) -> None:
    """Refuse (ConfigError) to start over files the run would mix with or write over; with ``--overwrite``,
    over files other than an earlier eagerloco run's. Reads only."""
    check_kinds(cfg, path)
    if cfg.resume:
        return
    ours, foreign, unlisted = run_files(path)
    how = f"no {MANIFEST_NAME} lists them" if unlisted else f"{path / MANIFEST_NAME} does not list them"
    if cfg.overwrite:
        if unlisted and not foreign:
            foreign = _unlisted_top(path, ours)
            if foreign:
                fix = ("move them away or pass another --out" if _summarize(ours) else
                       "drop --overwrite to start a run beside them, or pass another --out")
                raise ConfigError(
                    f"--out {path} has no {MANIFEST_NAME} (the list of an eagerloco run's files) and holds "
                    f"{_named(foreign)}, which eagerloco did not write; --overwrite takes such a directory only when "
                    f"it holds nothing but an eagerloco run, so nothing was removed: {fix}")
        if foreign:
            raise ConfigError(
                f"--out {path} holds {_named(foreign)}, which eagerloco did not write ({how}); a run that replaces "
                "an earlier one (--overwrite) deletes only the files eagerloco wrote, so nothing was removed: move "
                "them away or pass another --out"
            )
        return
    earlier = _summarize(ours)
    if earlier and foreign:
        raise ConfigError(
            f"--out {path} holds an earlier run ({', '.join(earlier)}) and {_named(foreign)}, which eagerloco did not "
            f"write ({how}); pass --resume to continue the run, or another --out (--overwrite would remove nothing "
            "while they are there)"
        )
    if earlier:
        raise ConfigError(
            f"--out {path} holds an earlier run ({', '.join(earlier)}); pass --resume to continue it, "
            "--overwrite to replace it, or another --out"
        )
    if foreign:
        raise ConfigError(f"--out {path} holds {_named(foreign)}, which eagerloco did not write ({how}); a run never "
                          "writes over nor deletes them: move them away or pass another --out")


def start_manifest(cfg: TrainConfig, path: Path) -> None:
    """Write the run's manifest: the earlier run's entries kept (``--resume``) or removed (``--overwrite``),
    plus the lock and the directories this run will create."""
    ours, _ = survey(path, read_manifest(path) or {})
    if cfg.resume:
        entries = ours
    elif cfg.overwrite:
        removed, kept = remove(path, ours)
        if removed:
            print(f"eagerloco: --overwrite removed the earlier run's {sum(ours[r] == 'file' for r in removed)} "
                  f"files from {path}", file=sys.stderr, flush=True)
        entries = {r: "dir" for r in kept}
    else:
        entries = {r: k for r, k in ours.items() if k == "dir"}  # an earlier run's directories, emptied by hand
    entries[LOCK_NAME] = "file"
    for name, used in (("checkpoints", cfg.checkpoint_every > 0), ("tensorboard", cfg.tensorboard)):
        if used and kind_of(path / name) is None:
            entries[name] = "dir"
    RunManifest(path).write(entries)


def remove_leftovers(path: Path) -> None:
    """Remove what a run that stopped mid-write left in ``path`` (unfinished checkpoints, a summary.json.tmp),
    as far as the manifest lists it, with a line saying so. Call while no process of the run writes."""
    manifest = RunManifest(path)
    listed = manifest.entries()
    ours, _ = survey(path, listed)
    staged = [r for r, k in ours.items() if k == "dir" and r.rsplit("/", 1)[-1].startswith(".partial-")]
    files = [r for r in ours if r == "summary.json.tmp" or any(r.startswith(s + "/") for s in staged)]
    removed, _ = remove(path, {r: ours[r] for r in [*staged, *files]})
    if kind_of(path / (MANIFEST_NAME + ".tmp")) == "file":
        (path / (MANIFEST_NAME + ".tmp")).unlink()
    gone = [r.rsplit("/", 1)[-1] for r in removed if r in staged or r == "summary.json.tmp"]
    if gone:
        print(f"eagerloco: removed what an earlier run left unfinished in {path}: {', '.join(gone)}",
              file=sys.stderr, flush=True)
        manifest.record(drop=removed)


class RunLock:
    """``<out>/.eagerloco.lock`` held while a run writes its directory.

    Our own rather than filelock's: a refusal must name the holder (process and host), a holder dead on this
    host is taken over with a line saying so, and it must hold across hosts sharing the directory, where a
    flock may go unseen. filelock records no holder (FileLock) or takes over silently (SoftFileLock)."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock, or take over a stale one; ConfigError when a live process (or another host) holds it."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # written between our try and our read, or gone: look again
                pid = holder["pid"]
                if holder["host"] != me["host"] or (pid is not None and pid_alive(pid)):
                    raise ConfigError(
                        f"--out {self.path.parent} is in use by another run (process {pid} on "
                        f"{holder['host']}); wait for it to finish or pass another --out "
                        f"(if that run is gone, delete {self.path})"
                    ) from None
                which = f"process {pid}, which no longer runs" if pid is not None else "a run that stopped writing it"
                print(f"eagerloco: taking over {self.path} from {which}", file=sys.stderr, flush=True)
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
        """The holder, ``{"pid": int, "host": str}`` (pid None: a torn lock older than 5 s); None while it is
        being written or once gone. ConfigError for a lock unreadable or not eagerloco's."""
        try:
            text = self.path.read_text()
            holder = json.loads(text)
        except FileNotFoundError:
            return None
        except ValueError:  # torn (a writer that died mid-write) or being written
            age = time.time() - self.path.stat().st_mtime if self.path.exists() else 0.0
            return {"pid": None, "host": socket.gethostname()} if age > 5.0 else None
        except OSError as e:
            raise ConfigError(f"cannot read the run lock {self.path} ({e.strerror or e}); make it readable, or "
                              f"delete it if no run uses {self.path.parent}") from None
        problem = _lock_problem(holder)
        if problem:
            shown = text.strip() if len(text.strip()) <= 60 else text.strip()[:57] + "..."
            raise ConfigError(f"the run lock {self.path} holds {shown}: {problem}, so eagerloco did not write it; "
                              f"if no run uses {self.path.parent}, delete {self.path}")
        return cast("dict[str, Any]", holder)  # a table: _lock_problem checked it

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: The largest process id a lock may name (a C int, as the system's calls take it).
MAX_PID = 2**31 - 1


def _lock_problem(holder: Any) -> str:
    if not isinstance(holder, dict):
        return "it is not a table"
    pid, host = holder.get("pid"), holder.get("host")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid <= MAX_PID:
        return f"pid {pid!r} is not a process id"
    if not isinstance(host, str) or not host:
        return f"host {host!r} is not a host name"
    return ""


def claim(cfg: TrainConfig) -> RunLock:
    """Check ``--out``, lock it, refuse another run in it (or remove an earlier one with ``--overwrite``),
    start the run's manifest; returns the held lock."""
    path = check_out_dir(cfg.out)
    check_kinds(cfg, path)  # the lock's path too, before it is taken
    lock = RunLock(path).acquire()
    try:
        check_fresh_start(cfg, path)
        start_manifest(cfg, path)
        remove_leftovers(path)
    except BaseException:
        lock.release()
        raise
    return lock


def guard_run_dir(cfg: TrainConfig, reporting: bool) -> RunLock | None:
    """The run-directory guard of one process of a multi-process run: the reporting process claims the
    directory (returning the lock), the others only check it, so a refused start fails everywhere alike."""
    if reporting:
        return claim(cfg)
    if cfg.overwrite:  # what the reporting process removes is in flux: check only what it cannot change
        check_kinds(cfg, Path(cfg.out))
    else:
        check_fresh_start(cfg, Path(cfg.out))
    return None


__all__ = ["LOCK_NAME", "MAX_PID", "RUN_FILE_ROLES", "RunLock", "check_fresh_start", "check_kinds", "check_out_dir",
           "claim", "guard_run_dir", "remove_leftovers", "run_files", "start_manifest"]
