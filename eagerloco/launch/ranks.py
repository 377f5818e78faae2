"""How `eagerloco launch` starts a rank: forked from a server that has imported torch and the trainer once
(Linux), or as a process of its own (``python -m eagerloco train``).

The rank server (:mod:`eagerloco.rankserver`) pays the imports (about 4 CPU-seconds) once per launcher and
forks a rank on each request: its own session, output pipe, environment and exit status, as a started one.
A rank whose start-time variables (:func:`start_keys`) differ from the server's is started as a process.
Not :mod:`multiprocessing`'s fork server: one per process, with the environment of that moment, and it cannot
give a child its own session and output pipe before it runs, nor report a status without a ``Process``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import IO, Any

#: The server's module (``python -m``), and the longest a message may be (its environment is most of it).
SERVER_MODULE = "eagerloco.rankserver"
MAX_MESSAGE = 1 << 20
#: Variables an interpreter, torch or its libraries read when they start (the server's, for a forked rank).
_START_PREFIXES = ("PYTHON", "LD_", "TORCH_", "MKL_", "KMP_", "GOMP_", "OMP_", "OPENBLAS_")
#: ... except those a forked rank applies itself.
_APPLIED_BY_RANK = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")


def start_keys(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that take effect when a process starts (``PYTHON*``, ``LD_*``, ``TORCH_*``, thread
    libraries), less those a forked rank applies itself (``PYTHONUNBUFFERED``, ``OMP_NUM_THREADS``)."""
    return {k: v for k, v in env.items() if k.startswith(_START_PREFIXES) and k not in _APPLIED_BY_RANK}


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One JSON message (and file descriptors, copied for the receiver) over a SOCK_SEQPACKET socket, one a packet."""
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def receive_message(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) when the other end is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    except (ConnectionError, OSError):
        return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


class ForkedRank:
    """A rank forked by the server, with the part of :class:`subprocess.Popen` the launcher uses
    (``pid``, ``stdout``, ``poll``, ``wait``, ``kill``, ``returncode``)."""

    def __init__(self, server: RankServer, pid: int, stdout: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        """The exit status once the rank has ended (negative: killed by that signal), else None."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the rank has ended (subprocess.TimeoutExpired after ``timeout`` seconds)."""
        if self.returncode is None:
            code = self._server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank, if it still runs."""
        if self.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class RankServer:
    """The client side of one :mod:`eagerloco.rankserver` process: start it, ask it for ranks, learn
    how they end. Thread-safe; the server ends when this process closes its socket (or dies)."""

    def __init__(self, env: Mapping[str, str], command: Sequence[str] = (sys.executable, "-m", SERVER_MODULE)) -> None:
        """Start the server with ``env`` (its start-time variables are every child's); ``command`` is its command line,
        to which its socket's descriptor is appended (default: :mod:`eagerloco.rankserver`'s)."""
        self.start_env = start_keys(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.process = subprocess.Popen(
            [*command, str(theirs.fileno())], env=dict(env), pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._replies: list[int | str] = []  # a forked rank's pid, or why the server could not fork it
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="rank-server", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            message, fds = receive_message(self._sock)
            for fd in fds:
                os.close(fd)
            with self._changed:
                if message is None:  # the server is gone; its ranks got SIGTERM (parent-death signal)
                    self._gone = True
                    for pid in self._live:
                        self._exits.setdefault(pid, -int(signal.SIGTERM))
                    self._live.clear()
                    self._changed.notify_all()
                    return
                if "started" in message:
                    self._replies.append(int(message["started"]))
                    self._live.add(int(message["started"]))
                elif "failed" in message:
                    self._replies.append(str(message["failed"]))
                elif "exited" in message:
                    self._exits[int(message["exited"])] = int(message["code"])
                    self._live.discard(int(message["exited"]))
                self._changed.notify_all()

    @property
    def alive(self) -> bool:
        """Whether the server still runs and answers."""
        return not self._gone and self.process.poll() is None

    @property
    def busy(self) -> bool:
        """Whether ranks it forked still run."""
        with self._changed:
            return bool(self._live)

    def start(self, argv: Sequence[str], env: Mapping[str, str], timeout_s: float = 600.0, *,
              cwd: str | None = None, output: int | None = None, errors: int | None = None) -> ForkedRank:
        """Fork a rank running ``eagerloco ARGV`` with this environment; its stdout and stderr on its ``stdout``, or
        on ``output`` (``errors``: stderr apart). RuntimeError when the server is gone or silent past timeout_s."""
        read_end, write_end = os.pipe() if output is None else (-1, output)
        request: dict[str, Any] = {"argv": list(argv), "env": dict(env)}
        if cwd is not None:
            request["cwd"] = str(cwd)
        try:
            with self._lock:
                send_message(self._sock, request, [write_end] if errors is None else [write_end, errors])
                with self._changed:
                    if not self._changed.wait_for(lambda: self._replies or self._gone, timeout_s) or not self._replies:
                        raise RuntimeError("the rank server did not start the rank (it is gone or did not answer in "
                                           f"{timeout_s:g} s); see its output above")
                    pid = self._replies.pop(0)
            if isinstance(pid, str):
                raise RuntimeError(f"the rank server could not start the rank: {pid}")
        except BaseException:
            if output is None:
                os.close(read_end)
            raise
        finally:
            if output is None:
                os.close(write_end)
        return ForkedRank(self, pid, os.fdopen(read_end, "rb") if output is None else None)

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """How the rank ``pid`` ended (negative: the signal that killed it), waiting for it at most ``timeout`` seconds
        (None: until it ends); None while it runs."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server: it stops reading and exits (a rank still running gets its parent-death SIGTERM).
        An idle one is stopped at once: it may still be importing, and reads its socket only after."""
        idle = not self.busy
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if idle and self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


#: What the launcher needs of a rank's process (pid, stdout, poll, wait, kill): a started or a forked one.
RankProcess = subprocess.Popen | ForkedRank

_server: RankServer | None = None
_server_lock = threading.Lock()


def rank_server(env: Mapping[str, str]) -> RankServer | None:
    """This process's rank server for ranks started with ``env``, started on first use; None where a rank must be
    a process of its own (not Linux, or start-time variables that differ while the server has ranks running)."""
    global _server
    if not sys.platform.startswith("linux"):
        return None
    with _server_lock:
        if _server is not None and (not _server.alive or _server.start_env != start_keys(env)):
            if _server.alive and _server.busy:
                return None
            _server.close()
            _server = None
        if _server is None:
            _server = RankServer(env)
        return _server


def close_rank_server() -> None:
    """End this process's rank server, if it has one (at exit, and once its ranks are done)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


atexit.register(close_rank_server)  # a no-op in a process that never started one
