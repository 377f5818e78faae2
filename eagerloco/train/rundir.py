"""The run directory (``--out``), guarded: checked before the first step, locked while a run writes it, and
``<out>/.eagerloco-run.json``, the manifest of the files the run created there.

A run refuses a directory holding another run's files unless it continues it (``--resume``) or replaces
it (``--overwrite``, which removes exactly the files the earlier run's manifest lists and refuses
anything else at a run's paths). The reporting process lists each path before (or as) it creates it,
rewriting the manifest atomically and rereading it first (a new reporter extends it). :func:`remove` never
removes through a symbolic link, nor an entry no longer of the kind the run made, nor a directory someone
else put a file in."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagerloco import checkpoint as ckpt
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.procs import pid_alive

MANIFEST_NAME = ".eagerloco-run.json"
LOCK_NAME = ".eagerloco.lock"
FORMAT = 1
#: The name's start of the empty file that checks ``--out`` is writable (removed at once).
WRITE_PROBE = ".write-test-"
#: The files a run writes at the top of its directory, by what they hold (each a regular file or absent).
RUN_FILES = {"metrics.jsonl": "metrics", "summary.json": "summary", "summary.json.tmp": "summary while it is written"}
#: eagerloco's own bookkeeping files: never a reason to refuse a directory, never removed by --overwrite.
OWN_FILES = {LOCK_NAME: "run lock", MANIFEST_NAME: "list of the run's files",
             MANIFEST_NAME + ".tmp": "list of the run's files while it is written"}
#: The directories a run writes at the top of its directory.
RUN_DIRS = ("checkpoints", "tensorboard")
#: The largest process id a lock may name (a C int, as the system's calls take it).
MAX_PID = 2**31 - 1

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
    for name, role in {**RUN_FILES, **OWN_FILES}.items():
        kind = kind_of(path / name)
        if kind not in (None, "file"):
            what = {"link": "a symbolic link", "dir": "a directory"}.get(kind, "not a regular file")
            raise ConfigError(f"{path / name} is {what}; eagerloco keeps the run's {role} in that file and never "
                              "writes through or removes anything else: move it away or pass another --out")
    for name, needed in zip(RUN_DIRS, (True, cfg.tensorboard), strict=True):
        target = path / name
        if needed and kind_of(target) is not None and not target.is_dir():
            what = "a link to nothing" if kind_of(target) == "link" else "a file"
            raise ConfigError(f"{target} is {what}, not a directory; eagerloco keeps the run's {name} in that "
                              "directory: move it away or pass another --out")


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

    def write(self, entries: Entries) -> None:
        """Replace the manifest (atomically)."""
        write_json_atomic(self.out / MANIFEST_NAME, {"format": FORMAT, "written_by": "eagerloco",
                                                     "entries": dict(sorted(entries.items()))})

    def record(self, add: Entries | None = None, drop: Iterable[str] = ()) -> None:
        """Add entries and drop others, rereading the file first (the reporting process can change)."""
        entries = read_manifest(self.out) or {}
        for rel in drop:
            entries.pop(rel, None)
        entries.update(add or {})
        self.write(entries)

    def staging(self, step: int) -> Entries:
        """The entry of the staging directory of step's checkpoint (list it before any process writes it)."""
        return {ckpt.staging_dir(ckpt.checkpoint_root(self.out), step).relative_to(self.out).as_posix(): "dir"}

    def record_checkpoint(self, final: Path, files: Iterable[str], next_step: int | None = None) -> None:
        """A published checkpoint: its directory, meta.json and files; its staging directory and the
        checkpoints pruned since are dropped, and the next checkpoint's staging directory listed."""
        root, name = final.parent.relative_to(self.out).as_posix(), final.name
        pruned = [r for r in read_manifest(self.out) or {}
                  if r.startswith(root + "/step_") and kind_of(self.out / r) is None]
        add = {f"{root}/{name}": "dir", f"{root}/{name}/meta.json": "file",
               **{f"{root}/{name}/{f}": "file" for f in files}}
        if next_step is not None:
            add.update(self.staging(next_step))
        self.record(add, drop=[*pruned, f"{root}/.partial-{name}"])


def survey(out: Path, listed: Entries) -> tuple[Entries, list[str]]:
    """(The listed entries present as the kind listed, with the checkpoint files in listed staging
    directories; the paths at a run's names that are not the run's, each named at its topmost point)."""
    try:
        ours = {rel: kind for rel, kind in listed.items() if rel not in OWN_FILES and kind_of(out / rel) == kind}
        for rel in [r for r, k in ours.items() if k == "dir" and ckpt.STAGING_NAME.fullmatch(r.rsplit("/", 1)[-1])]:
            for child in (out / rel).iterdir():
                if ckpt.FILE_NAME.fullmatch(child.name) and kind_of(child) == "file":
                    ours[f"{rel}/{child.name}"] = "file"
        foreign: list[str] = []
        for name in (*RUN_FILES, *RUN_DIRS):
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
        if rel in OWN_FILES or kind_of(path) != kind:
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


def _summarize(ours: Entries) -> list[str]:
    found: list[str] = [name for name in RUN_FILES if name in ours]
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
    tops = {rel.split("/", 1)[0] for rel in ours} | {*OWN_FILES, *RUN_FILES, *RUN_DIRS}
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
    listed = read_manifest(path)
    ours, foreign = survey(path, listed or {})
    how = f"no {MANIFEST_NAME} lists them" if listed is None else f"{path / MANIFEST_NAME} does not list them"
    if cfg.overwrite:
        if listed is None and not foreign:
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
    """Write the run's manifest: the earlier run's entries kept (``--resume``) or removed (``--overwrite``), less
    what a run that stopped mid-write left (unfinished checkpoints, a summary.json.tmp: removed, with a line
    saying so), plus the lock and the directories this run will create. Call while no process of the run writes."""
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
    staged = [r for r, k in entries.items() if k == "dir" and r.rsplit("/", 1)[-1].startswith(".partial-")]
    unfinished = [r for r in entries if r in staged or r == "summary.json.tmp"
                  or any(r.startswith(s + "/") for s in staged)]
    removed, _ = remove(path, {r: entries[r] for r in unfinished})
    gone = [r.rsplit("/", 1)[-1] for r in removed if r in staged or r == "summary.json.tmp"]
    if gone:
        print(f"eagerloco: removed what an earlier run left unfinished in {path}: {', '.join(gone)}",
              file=sys.stderr, flush=True)
    for rel in removed:
        del entries[rel]
    if kind_of(path / (MANIFEST_NAME + ".tmp")) == "file":
        (path / (MANIFEST_NAME + ".tmp")).unlink()
    entries[LOCK_NAME] = "file"
    for name, used in zip(RUN_DIRS, (cfg.checkpoint_every > 0, cfg.tensorboard), strict=True):
        if used and kind_of(path / name) is None:
            entries[name] = "dir"
    RunManifest(path).write(entries)


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
        return {"pid": holder["pid"], "host": holder["host"]}

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


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
