"""Jobs for the tests: ``python SCRIPT ...`` or ``python -m MODULE ...`` as a process of its own, forked from a
server that has imported torch, eagerloco, transformers and Lightning once.

Each such job (a hook-API script, an example, ``eagerloco train --outer-addr``) used to pay for its own
interpreter and imports, 4-7 CPU-seconds before its first line; the suite starts about a hundred. As
``eagerloco launch`` does for its ranks (:mod:`eagerloco.rankserver`), each test process starts one server
(this file, run as ``python tests/jobs.py FD``) on first use and forks every job from it. A forked job is a
process of its own: its own pid and session, its output on the pipe or file given, the environment and
working directory given, its exit status (negative: the signal that ended it), and it ends as an
interpreter does (atexit, the threads' and objects' teardown), since the script's exit leaves the server's
frames for the interpreter's own exit.

It differs from a started interpreter in what is read when one starts: a job whose start-time variables
(``PYTHONPATH``, ``TORCH_*``, ...) differ from the server's is started as a process (the test faults, which
the server installed as every test process's interpreter does, read each job's own environment); so is
any other command, and a job of a test that passes ``fork=False`` because it examines the interpreter
itself. Its ``/proc/PID/environ`` is the server's: tests that find processes by their environment start them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from eagerloco.launch.ranks import ForkedRank, RankServer, start_keys


class Job:
    """A forked job with the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, rank: ForkedRank, args: list[str], text: bool, errors: IO[bytes] | None) -> None:
        self.args, self.pid, self._rank = args, rank.pid, rank
        self.returncode: int | None = None
        self._text = text
        # Pipes are drained at once, so that a chatty job never blocks on a full one.
        self._out = _Drain(rank.stdout) if rank.stdout is not None else None
        self._err = _Drain(errors) if errors is not None else None

    def poll(self) -> int | None:
        self.returncode = self._rank.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._rank.wait(timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """(stdout, stderr) once it has ended (None for what is not a pipe); subprocess.TimeoutExpired if it
        runs on past timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = (lambda: None) if deadline is None else (lambda: max(0.0, deadline - time.monotonic()))
        for drain in (self._out, self._err):
            if drain is not None and not drain.done(left()):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(left())
        return tuple(None if d is None else d.text() if self._text else d.data() for d in (self._out, self._err))


class _Drain:
    """Reads a pipe to its end on a thread of its own."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[bytes]) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read1(1 << 16), b""):
                self._chunks.append(chunk)

    def done(self, timeout: float | None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def data(self) -> bytes:
        return b"".join(self._chunks)

    def text(self) -> str:
        return self.data().decode(errors="replace")


_server: RankServer | None = None
_lock = threading.Lock()


def _server_for(env: Mapping[str, str]) -> RankServer | None:
    global _server
    if not sys.platform.startswith("linux"):
        return None
    with _lock:
        if _server is not None and not _server.alive:
            _server = None
        if _server is None:
            # This process's environment, not the job's (a test's marks on its jobs would be the server's too,
            # in /proc/PID/environ), with the job's start-time variables.
            own = {k: v for k, v in os.environ.items() if k not in start_keys(os.environ)}
            _server = RankServer({**own, **start_keys(env)}, command=(sys.executable, str(Path(__file__).resolve())))
        return _server if _server.start_env == start_keys(env) else None


def _close() -> None:
    with _lock:
        if _server is not None:
            _server.close()


atexit.register(_close)


def popen(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, fork: bool = True) -> Job | subprocess.Popen:
    """``subprocess.Popen(args, ...)``, forked from this process's job server where it can be (see the module):
    args of ``python SCRIPT ...`` or ``python -m MODULE ...``."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    server = None
    python = len(args) > 1 and args[0] == sys.executable and (args[1] == "-m" or not args[1].startswith("-"))
    if fork and python and args[2:3] != ["torch.distributed.run"]:
        server = _server_for(env)
    if server is None:
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    with contextlib.ExitStack() as opened:
        def descriptor(where: Any, default: int) -> int:
            if where is None:
                return default
            if where == subprocess.DEVNULL:
                return opened.enter_context(open(os.devnull, "wb")).fileno()
            return where.fileno() if hasattr(where, "fileno") else int(where)

        errors, err_pipe = None, None
        if stderr == subprocess.PIPE:
            read_end, write_end = os.pipe()
            err_pipe = os.fdopen(read_end, "rb")
            errors = opened.enter_context(os.fdopen(write_end, "wb")).fileno()
        elif stderr != subprocess.STDOUT:
            errors = descriptor(stderr, 2)
        output = None if stdout == subprocess.PIPE else descriptor(stdout, 1)
        rank = server.start(args[1:], env, cwd=None if cwd is None else str(cwd), output=output, errors=errors)
    return Job(rank, args, text, err_pipe)


# -- the server ----------------------------------------------------------------------------------------------

def _preload() -> None:
    """What the jobs import: torch (and the compiler stack its optimizers load), eagerloco's hook API and
    trainer, and the frameworks the examples use where they are installed."""
    from eagerloco.cli import preload_train

    preload_train()
    import eagerloco.hooks  # noqa: F401

    for name in ("transformers", "pytorch_lightning"):
        try:
            __import__(name)
        except ImportError:
            pass


def _run_python(message: dict[str, Any], output: list[int], ready: int) -> None:
    """In the forked child: run ``python ARGV`` and leave through the interpreter's own exit."""
    from eagerloco.rankserver import become_child

    become_child(message, output, ready)
    import torch

    threads = message["env"].get("OMP_NUM_THREADS")
    if threads:  # read by a started interpreter's OpenMP when it loads
        torch.set_num_threads(max(1, int(threads)))
    argv = message["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    # Out through the server's frames to the interpreter's exit: atexit, and the teardown a script's process has.
    raise SystemExit(0)


if __name__ == "__main__":
    from eagerloco.rankserver import serve

    sys.exit(serve(int(sys.argv[1]), _preload, _run_python))
