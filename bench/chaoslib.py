"""What the chaos benchmarks share: processes found by a tag in their environment, and the marks a
crash leaves in a process's output.

A benchmark starts every process of a run with :func:`tagged_env`; the tag is inherited by whatever
those processes start, so :func:`reap` finds every one left behind (an orphan), counts it and kills it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

#: The variable that marks a benchmark's processes.
TAG = "EAGERLOCO_CHAOS_TAG"
#: Variables of torchrun's and eagerloco's that a benchmark's runs must not inherit from the caller.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER", "EAGERLOCO_REJOIN", "EAGERLOCO_FAULT_KILL",
            "EAGERLOCO_FAULT_EVAL_DELAY", "EAGERLOCO_LAUNCHER_PID", "EAGERLOCO_OUTER_ADDR", "EAGERLOCO_WORKER_ID")
#: What a crash prints: a Python traceback, C++ stack frames, an abort from the C++ runtime.
CRASH_MARKS = ("Traceback (most recent call last)", "frame #", "terminate called")


def tagged_env(tag: str, root: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark's process: ``base`` (default this one's) without the distributed
    variables, with the tag, one thread and ``root`` on PYTHONPATH (after any path already there)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in DIST_ENV}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update({TAG: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(dict.fromkeys([*paths, str(root)]))})
    return env


def tagged(tag: str) -> dict[int, dict[str, str]]:
    """Live processes carrying the tag (zombies excluded): pid -> their RANK (if any)."""
    found: dict[int, dict[str, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            items = (d / "environ").read_bytes().split(b"\0")
            if f"{TAG}={tag}".encode() not in items:
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        kv = dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)
        found[int(d.name)] = {"rank": kv.get("RANK", "")}
    return found


def reap(tag: str, wait_s: float = 30.0) -> int:
    """Wait up to ``wait_s`` for every process carrying the tag to end; SIGKILL those left and return
    how many there were (orphans)."""
    deadline = time.monotonic() + wait_s
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


def crash_marks(text: str) -> int:
    """How many times ``text`` shows a traceback, a C++ frame or a C++ abort (:data:`CRASH_MARKS`)."""
    return sum(text.count(mark) for mark in CRASH_MARKS)


def default_signals() -> None:
    """Give this process (and so its children) the default SIGINT and SIGHUP.

    Started from nohup or as a background job, a benchmark may ignore SIGHUP or SIGINT, and its
    children would inherit that (a signal ignored at start stays ignored).
    """
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


__all__ = ["CRASH_MARKS", "DIST_ENV", "TAG", "crash_marks", "default_signals", "reap", "tagged", "tagged_env"]
