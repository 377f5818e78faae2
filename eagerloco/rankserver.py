"""The rank server of `eagerloco launch` (``python -m eagerloco.rankserver FD``): imports torch and the
trainer once, then forks one rank per request on the socket FD (:mod:`eagerloco.launch.ranks` is the other end).

Requests: ``{"argv", "env"[, "cwd"]}`` with the write end of the rank's output (and of its stderr where that
goes elsewhere); answers: ``{"started": pid}`` or ``{"failed": why}``, then ``{"exited": pid, "code": status}``
(negative: the killing signal). The server ends with the launcher's socket; its ranks then get SIGTERM, their
parent-death signal.
"""

from __future__ import annotations

import io
import os
import selectors
import signal
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from eagerloco.environment import Environment
from eagerloco.launch.ranks import receive_message, send_message

#: What runs in a forked child: the request, its output's descriptors (stdout, and stderr where it goes
#: elsewhere), the handshake's write end.
Child = Callable[[dict[str, Any], list[int], int], None]


def become_child(message: dict[str, Any], output: list[int], ready: int) -> None:
    """In a forked child: become the process a launcher would have started for this request.

    Its own session (announced by closing ``ready``), stdout and stderr on ``output`` (closed here once duplicated),
    line-buffered; default signal handlers; the request's environment and working directory."""
    os.setsid()
    os.dup2(output[0], 1)
    os.dup2(output[-1], 2)
    for fd in output:
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.close(ready)  # announced with the signals' own handlers: the server ignores SIGINT and SIGHUP
    Environment.adopt(message["env"])
    if message.get("cwd"):
        os.chdir(message["cwd"])
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                  errors="backslashreplace")


def _run_rank(message: dict[str, Any], output: list[int], ready: int) -> None:
    """In the forked child: become the rank ``python -m eagerloco ARGV`` would be, run it, and exit."""
    code = 1
    try:
        become_child(message, output, ready)
        argv = message["argv"]
        sys.argv = ["eagerloco", *argv]
        from eagerloco.cli import run_rank

        code = run_rank(argv, message["env"].get("OMP_NUM_THREADS"))
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as `python -m eagerloco` would, then the rank ends
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _preload_ranks() -> None:
    from eagerloco.cli import preload_train

    preload_train()


def _tell(sock: socket.socket, message: dict[str, object]) -> bool:
    """Send the launcher a message; False when it is gone (then the server ends)."""
    try:
        send_message(sock, message)
    except OSError:
        return False
    return True


def serve(fd: int, preload: Callable[[], None] = _preload_ranks, child: Child = _run_rank) -> int:
    """Run ``preload`` once, then fork a child running ``child`` per request until the launcher goes away; 0 then.

    ``child`` gets the request, its output's descriptors and the handshake's, calls :func:`become_child` first
    and never returns (the project's tests fork their job scripts this way)."""
    sock = socket.socket(fileno=fd)
    # A terminal's Ctrl-C and hang-up go to the launcher's process group, this server included: the launcher
    # handles them (and stops the ranks); the server must outlive them to report how the ranks end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    preload()
    # Python 3.12 warns on fork in a process with threads: here numpy's BLAS pool, which registers its own
    # fork handlers; nothing else runs a thread in this process.
    warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    live: set[int] = set()
    while True:
        if selector.select(timeout=0.05):
            message, fds = receive_message(sock)
            if message is None:
                return 0
            wait_ready, ready = os.pipe()
            try:
                pid = os.fork()
            except OSError as e:
                for f in (*fds, wait_ready, ready):
                    os.close(f)
                if not _tell(sock, {"failed": str(e)}):
                    return 0
                continue
            if pid == 0:
                selector.close()
                sock.close()
                os.close(wait_ready)
                child(message, fds, ready)
            for f in (*fds, ready):
                os.close(f)
            os.read(wait_ready, 1)  # end of file: the child has its session (or has died)
            os.close(wait_ready)
            live.add(pid)
            if not _tell(sock, {"started": pid}):
                return 0
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            if not _tell(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)}):
                return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
