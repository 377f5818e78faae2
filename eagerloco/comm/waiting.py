"""Waits at a rendezvous that are bounded by the timeout, say what they wait for, and end at once on Ctrl-C.

A TCPStore that connects to an address nobody answers, or a gloo group whose peers never come, blocks
in C++: no line for minutes, Ctrl-C ignored, C++ frames at the end. Here the store's client is made
only once something listens at its address (:func:`wait_for_listener`, plain sockets: the client's
own retries print C++ stack frames, and one left retrying at exit aborts the process), such a call
runs on a daemon thread that this one polls (:func:`bounded`), and the workers' arrival is watched
through the store before the group is formed (:func:`wait_for_workers`), naming whoever is missing.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from eagerloco.comm.errors import PeerError, describe_exception, is_transport_failure
from eagerloco.config import ConfigError

T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout_s: float, waiting: str, report_every_s: float = 10.0,
            slack_s: float = 5.0, started: float | None = None) -> T:
    """``fn()``, which may block in C++ (a TCPStore connecting, a gloo group forming), waited on so that
    the wait is bounded, says what it waits for every ``report_every_s`` and ends at once on Ctrl-C.

    ``fn`` runs on a daemon thread; this thread polls it. A call left running after a timeout or Ctrl-C
    dies with the process. ``started``: the ``time.monotonic()`` at which the wait began, where an
    earlier step of it (:func:`wait_for_listener`) already took some of the timeout (default: now).

    Raises:
        TimeoutError: ``fn`` did not return within timeout_s plus ``slack_s`` (its own timeout, where it
            has one, should end it first and say why).
        Exception: what ``fn`` raised.
    """
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # handed to the waiting thread
            result.append((False, e))

    t = threading.Thread(target=run, name="eagerloco-rendezvous", daemon=True)
    start = time.monotonic() if started is None else started
    last = time.monotonic()
    t.start()
    while not result:
        t.join(0.1)
        now = time.monotonic()
        if now - start > timeout_s + slack_s:
            raise TimeoutError(f"{waiting}: no answer within {timeout_s:g} s")
        if now - last >= report_every_s:
            last = now
            print(f"eagerloco: {waiting} ({now - start:.0f} s of {timeout_s:g})", file=sys.stderr, flush=True)
    ok, value = result[0]
    if not ok:
        raise value
    return value


def wait_for_listener(host: str, port: int, timeout_s: float, waiting: str, report_every_s: float = 10.0) -> None:
    """Wait until something accepts connections at ``host:port`` (worker 0's store listening), probing with
    plain connections closed at once; says what it waits for every ``report_every_s``; Ctrl-C ends it.

    Raises:
        TimeoutError: nothing accepted a connection within timeout_s.
        OSError: the host name cannot be resolved (socket.gaierror).
    """
    start = last = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except socket.gaierror:
            raise
        except OSError:  # refused, unreachable, timed out: not there yet
            pass
        now = time.monotonic()
        if now - start >= timeout_s:
            raise TimeoutError(f"{waiting}: no answer within {timeout_s:g} s")
        if now - last >= report_every_s:
            last = now
            print(f"eagerloco: {waiting} ({now - start:.0f} s of {timeout_s:g})", file=sys.stderr, flush=True)
        time.sleep(0.2)


def wait_for_workers(store: dist.Store, me: int, workers: int, timeout_s: float, where: str,
                     report_every_s: float = 10.0) -> None:
    """Wait until all ``workers`` joined the outer store (each set ``eagerloco/join/<id>`` and its M), saying
    whom it waits for every ``report_every_s``; Ctrl-C ends the wait at once.

    Raises:
        ConfigError: a worker was started with another number of workers (named, with both numbers).
        PeerError: a worker did not join within the timeout (named), or, on a worker other than 0, the
            store went away meanwhile (worker 0, which hosts it, stopped: it waited no longer, or failed).
    """
    start = last = time.monotonic()
    missing = [w for w in range(workers) if w != me]
    while True:
        names = ", ".join(f"worker {w}" for w in missing)
        try:
            present = [w for w in missing if store.check([f"eagerloco/join/{w}"])]
            sizes = {w: int(store.get(f"eagerloco/size/{w}").decode()) if store.check([f"eagerloco/size/{w}"])
                     else workers for w in present}
        except Exception as e:
            if me == 0 or not is_transport_failure(e):
                raise
            raise PeerError(f"worker {me}: worker 0 stopped while the workers waited for {names} at {where} (its "
                            f"outer store is gone: {describe_exception(e)}); start all {workers} workers with the "
                            "same --outer-addr and --workers, and see worker 0's log", [0, *missing]) from None
        for w, other in sizes.items():
            if other != workers:
                raise ConfigError(f"the workers at {where} were started with different --workers: worker {me} with "
                                  f"{workers}, worker {w} with {other}; start every worker with the same --workers")
        missing = [w for w in missing if w not in present]
        if not missing:
            return
        now = time.monotonic()
        names = ", ".join(f"worker {w}" for w in missing)
        if now - start >= timeout_s:
            raise PeerError(f"worker {me}: {names} did not join the outer rendezvous at {where} within "
                            f"{timeout_s:g} s; start all {workers} workers with the same --outer-addr and --workers",
                            missing)
        if now - last >= report_every_s:
            last = now
            print(f"eagerloco: worker {me}: waiting for {names} at {where} ({now - start:.0f} s of {timeout_s:g})",
                  file=sys.stderr, flush=True)
        time.sleep(0.1)


__all__ = ["bounded", "wait_for_listener", "wait_for_workers"]
