"""Signals that stop a run, and a launcher that dies.

SIGTERM and SIGHUP stop a run as Ctrl-C does, by raising :class:`RunStopped` in the main thread, so that every
``finally`` runs; a process of ``eagerloco launch`` also gets SIGTERM when its launcher dies, however it dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from eagerloco.config import Environment

#: The signals that stop a run (SIGINT raises KeyboardInterrupt on its own).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


#: Where ``eagerloco launch`` notes, in the run's store, the stop signal it passes on to every rank.
STOPPING_KEY = "launch/stopping"


def launcher_stopping(store: Any) -> int | None:
    """The stop signal the launcher noted in the run's store for the ranks (read by a rank whose collective failed
    because another stopped first); None when none was noted or the store cannot be read."""
    try:
        return int(store.get(STOPPING_KEY).decode()) if store.check([STOPPING_KEY]) else None
    except Exception:  # a store gone with the launcher: nothing known
        return None


def stopped_by(signum: int) -> RunStopped:
    """The RunStopped of a stop signal learned of other than through the handler (the launcher's note); the stop
    signals are ignored from now on, as after the handler's first."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, *STOP_SIGNALS):
            if signal.getsignal(s) not in (signal.SIG_IGN, None):
                signal.signal(s, signal.SIG_IGN)
    return RunStopped(signum)


class RunStopped(BaseException):
    """A signal asked this process to stop; a BaseException, as KeyboardInterrupt, so ``except Exception`` misses it."""

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
def handled(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Within this block ``handler`` takes each of ``signals`` in the main thread (elsewhere nothing changes); a signal
    ignored from the start (nohup's SIGHUP, a background job's SIGINT) stays ignored, here and in what it starts."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(signum: int, frame: object) -> None:
    for s in (signal.SIGINT, *STOP_SIGNALS):  # one stop: a second signal must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise RunStopped(signum)


def stop_on_signals() -> AbstractContextManager[None]:
    """Within this block SIGTERM and SIGHUP raise :class:`RunStopped` in the main thread, SIGINT KeyboardInterrupt;
    after the first the others are ignored (cleanup runs once)."""
    return handled((signal.SIGINT, *STOP_SIGNALS), _stop)


def die_with_launcher(env: Environment) -> None:
    """Have the kernel send SIGTERM to this process when its launcher (``env.launcher_pid``) dies (Linux); one whose
    launcher is already gone stops at once."""
    launcher = env.launcher_pid
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the launcher's own stop is all there is
        return
    if os.getppid() != launcher:  # it died before prctl: no signal will come
        raise RunStopped(signal.SIGTERM)
