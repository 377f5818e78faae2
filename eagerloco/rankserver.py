"""The rank server of `eagerloco launch` (``python -m eagerloco.rankserver FD``): imports torch and the
trainer once, then forks one rank per request that comes over the socket FD (:mod:`eagerloco.launch.ranks`
is the other end, and says why).

Requests: ``{"argv": [...], "env": {...}}`` with the write end of the rank's output pipe; answers:
``{"started": pid}`` (or ``{"failed": why}``), and ``{"exited": pid, "code": status}`` when a rank ends
(negative: the signal that killed it). The server ends when the launcher closes the socket or dies; its
ranks then get SIGTERM, their parent-death signal, as they do when a launcher dies.
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

from eagerloco.environment import Environment
from eagerloco.launch.ranks import receive_message, send_message


def _run_rank(argv: list[str], env: dict[str, str], output: int, ready: int) -> None:
    """In the forked child: become the rank ``python -m eagerloco ARGV`` would be, run it, and exit."""
    code = 1
    try:
        os.setsid()  # its own session, as the launcher starts every rank: Ctrl-C reaches only the launcher
        os.close(ready)  # the server answers once the session exists: the launcher may signal it at once
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        Environment.adopt(env)
        # PYTHONUNBUFFERED, as a started rank has it: every line reaches the launcher as it is written.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                      errors="backslashreplace")
        sys.argv = ["eagerloco", *argv]
        from eagerloco.cli import run_rank

        code = run_rank(argv, env.get("OMP_NUM_THREADS"))
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


def _tell(sock: socket.socket, message: dict[str, object]) -> bool:
    """Send the launcher a message; False when it is gone (then the server ends)."""
    try:
        send_message(sock, message)
    except OSError:
        return False
    return True


def serve(fd: int) -> int:
    """Import what a rank needs, then fork ranks on request until the launcher goes away.

    Args:
        fd: the server's end of the launcher's SOCK_SEQPACKET socket pair.

    Returns:
        0 once the launcher closed the socket.
    """
    sock = socket.socket(fileno=fd)
    # A terminal's Ctrl-C and hang-up go to the launcher's process group, this server included: the launcher
    # handles them (and stops the ranks); the server must outlive them to report how the ranks end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from eagerloco.cli import preload_train

    preload_train()
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
                _run_rank(message["argv"], message["env"], fds[0], ready)
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
