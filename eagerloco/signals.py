"""Faults at run time: signals, a launcher that dies, rejoining an elastic run, and fault injection.

Signals: SIGTERM and SIGHUP stop a run as Ctrl-C (SIGINT) does, by raising :class:`RunStopped` in
the main thread (:func:`stop_on_signals`), so that every ``finally`` runs (locks released,
communicators cancelled) and the command line ends with one line naming the signal and the newest
checkpoint. A process started by ``eagerloco launch`` also asks the kernel for SIGTERM when the
launcher dies, however it dies (:func:`die_with_launcher`): no training process outlives it.

The fault settings (``elastic``, ``rejoin``, ``slow_workers``) are fields of
:class:`eagerloco.config.TrainConfig`; the membership protocol is in :mod:`eagerloco.comm.elastic`.

Fault injection: ``EAGERLOCO_FAULT_KILL="WORKER:STEP[:DELAY_S]"`` makes that worker's first
incarnation SIGKILL itself DELAY_S seconds after finishing inner step STEP (so the kill lands at a
known step, mid-way through the next one). It is an environment variable, not a flag, because no
real run should ever ask for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from eagerloco.config import ConfigError, TrainConfig

FAULT_KILL_ENV = "EAGERLOCO_FAULT_KILL"
#: Seconds the evaluating process spends on each evaluation on top of the real work (tests of an
#: evaluation that outlasts --dist-timeout).
FAULT_EVAL_DELAY_ENV = "EAGERLOCO_FAULT_EVAL_DELAY"
#: Set by ``eagerloco launch --elastic`` on a process it restarts: join the live workers.
REJOIN_ENV = "EAGERLOCO_REJOIN"
#: Set by ``eagerloco launch`` on every process it starts: the launcher's process id.
LAUNCHER_PID_ENV = "EAGERLOCO_LAUNCHER_PID"
#: The signals that stop a run (SIGINT raises KeyboardInterrupt on its own).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


class RunStopped(BaseException):
    """A signal asked this process to stop (a BaseException, as KeyboardInterrupt: no ``except Exception``
    swallows it).

    Args:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}")


def signal_name(signum: int) -> str:
    """SIGTERM for 15, and so on (the number where the name is unknown)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block SIGTERM and SIGHUP raise :class:`RunStopped` in the main thread, SIGINT
    KeyboardInterrupt; after the first, the others are ignored until the block is left (cleanup runs once).

    A signal ignored when the block starts (``nohup``'s SIGHUP) stays ignored. Outside the main
    thread (where Python cannot install handlers) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for s in (signal.SIGINT, *STOP_SIGNALS):  # one stop: a second signal must not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise RunStopped(signum)

    # A signal ignored from the start (nohup's SIGHUP, a background job's SIGINT) stays ignored.
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, *STOP_SIGNALS) if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def die_with_launcher() -> None:
    """Have the kernel send SIGTERM to this process when ``eagerloco launch`` dies (Linux).

    Under a launcher (LAUNCHER_PID_ENV set) a process whose launcher is already gone exits at once.
    Elsewhere, or where prctl is unavailable, nothing happens.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the launcher's own stop is all there is
        return
    if launcher.isdigit() and os.getppid() != int(launcher):  # it died before prctl: no signal will come
        raise RunStopped(signal.SIGTERM)


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


def eval_delay() -> None:
    """Sleep EAGERLOCO_FAULT_EVAL_DELAY seconds (none when unset): an evaluation that takes long.

    Raises:
        ConfigError: the variable is set but not a number of seconds.
    """
    spec = os.environ.get(FAULT_EVAL_DELAY_ENV, "")
    if not spec:
        return
    try:
        seconds = float(spec)
    except ValueError:
        raise ConfigError(f"{FAULT_EVAL_DELAY_ENV}={spec!r}: expected seconds") from None
    time.sleep(max(0.0, seconds))


def fault_injection(worker: int) -> Callable[[int], None] | None:
    """The per-step EAGERLOCO_FAULT_KILL hook for this worker, or None when the environment asks for none."""
    kill = kill_hook(worker)
    if kill is None:
        return None

    def on_step(step: int) -> None:
        if step == kill[0]:
            kill_self(kill[1])

    return on_step


__all__ = [
    "FAULT_EVAL_DELAY_ENV",
    "FAULT_KILL_ENV",
    "LAUNCHER_PID_ENV",
    "REJOIN_ENV",
    "RunStopped",
    "STOP_SIGNALS",
    "die_with_launcher",
    "eval_delay",
    "fault_injection",
    "kill_hook",
    "kill_self",
    "rejoining",
    "signal_name",
    "stop_on_signals",
]
