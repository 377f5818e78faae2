"""Processes on this host (torch-free)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["pid_alive"]
