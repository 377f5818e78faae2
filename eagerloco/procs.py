"""Processes on this host (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path


def _state(pid: int) -> str | None:
    """The process's state letter in ``/proc`` (R, S, T, Z, ...); None where ``/proc`` is missing or it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The state follows the command name, which is in parentheses and may itself hold spaces or ')'.
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one of another user's counts as alive; a zombie, dead
    but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != "Z"


def pid_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP: state T), so that it can handle no other
    signal until continued. False where ``/proc`` is missing or the process is gone."""
    return _state(pid) == "T"
