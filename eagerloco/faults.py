"""Faults at run time: rejoining an elastic run, and fault injection for tests and benchmarks.

The fault settings (``elastic``, ``rejoin``, ``slow_workers``) are fields of
:class:`eagerloco.config.TrainConfig`; the membership protocol is in :mod:`eagerloco.comm.elastic`.

Fault injection: ``EAGERLOCO_FAULT_KILL="WORKER:STEP[:DELAY_S]"`` makes that worker's first
incarnation SIGKILL itself DELAY_S seconds after finishing inner step STEP (so the kill lands at a
known step, mid-way through the next one). It is an environment variable, not a flag, because no
real run should ever ask for it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from eagerloco.config import ConfigError, TrainConfig

FAULT_KILL_ENV = "EAGERLOCO_FAULT_KILL"
#: Set by ``eagerloco launch --elastic`` on a process it restarts: join the live workers.
REJOIN_ENV = "EAGERLOCO_REJOIN"


def rejoining(cfg: TrainConfig) -> bool:
    """Whether this process comes back into a running elastic run (flag or launcher restart)."""
    return bool(cfg.rejoin) or os.environ.get(REJOIN_ENV, "") == "1"


def kill_hook(worker: int) -> tuple[int, float] | None:
    """(step, delay_s) at which this process must kill itself, from EAGERLOCO_FAULT_KILL.

    Raises:
        ConfigError: the variable is set but malformed.
    """
    spec = os.environ.get(FAULT_KILL_ENV, "")
    if not spec or os.environ.get(REJOIN_ENV, "") == "1":
        return None
    parts = spec.split(":")
    try:
        w, step = int(parts[0]), int(parts[1])
        delay = float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ConfigError(f"{FAULT_KILL_ENV}={spec!r}: expected WORKER:STEP[:DELAY_S]") from None
    return (step, delay) if w == worker else None


def kill_self(delay_s: float) -> None:
    """SIGKILL this process after delay_s seconds (no cleanup, no goodbye: a real crash)."""
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if delay_s <= 0:
        die()
    t = threading.Timer(delay_s, die)
    t.daemon = True
    t.start()


def fault_injection(worker: int) -> Callable[[int], None] | None:
    """The per-step EAGERLOCO_FAULT_KILL hook for this worker, or None when the environment asks for none."""
    kill = kill_hook(worker)
    if kill is None:
        return None

    def on_step(step: int) -> None:
        if step == kill[0]:
            kill_self(kill[1])

    return on_step


__all__ = ["FAULT_KILL_ENV", "REJOIN_ENV", "fault_injection", "kill_hook", "kill_self", "rejoining"]
