"""Start a multi-process run on this machine: M workers x R ranks of ``python -m eagerloco train`` (:func:`launch`)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, suppress
from datetime import timedelta
from typing import IO, Any, Protocol

from eagerloco.config.checks import check_int_at_least
from eagerloco.environment import (
    LAUNCHER_PID_ENV,
    RANKS_PER_WORKER_ENV,
    REJOIN_ENV,
    WORKERS_ENV,
    Environment,
)
from eagerloco.launch.ranks import RankProcess, rank_server
from eagerloco.procs import pid_stopped
from eagerloco.signals import STOP_SIGNALS, STOPPING_KEY, handled, signal_name

#: Seconds the other processes get to exit on their own after one fails (they notice a dead peer
#: at once, or within their collective timeout if it hangs) before they are terminated.
DEFAULT_GRACE_S = 30.0
_KILL_AFTER_S = 5.0  # between SIGTERM and SIGKILL
_STOP_GRACE_S = 10.0  # after a forwarded stop signal (Ctrl-C, SIGTERM, SIGHUP), before SIGTERM / SIGKILL


class LinkShaping(Protocol):
    """A link between workers shaped on this machine (``--kernel-link-gbps``; the lab's
    :class:`eagerloco.lab.launch.KernelShaping`): each worker's processes start behind it."""

    def check(self, argv: list[str], outer_addr: str | None) -> None:
        """ValueError for train arguments (``argv``) or an ``outer_addr`` this link cannot shape, before anything
        starts."""

    def link(self, argv: list[str], workers: int, worker_id: int | None,
             out: IO[str]) -> AbstractContextManager[tuple[Any, list[str]]]:
        """The link of a launch's ``workers`` workers (with ``worker_id``: of that worker, its own job) and the train
        arguments behind it (an --outer-addr rewritten to where the link reaches the coordinator), said on ``out``.
        The link gives each process its ``env()`` and ``command(cmd, worker)``."""


def launch(
    argv_for_train: Sequence[str],
    workers: int,
    ranks_per_worker: int = 1,
    master_port: int | None = None,
    timeout_s: float = DEFAULT_GRACE_S,
    *,
    command: Sequence[str] | None = None,
    out: IO[str] | None = None,
    elastic: bool = False,
    max_restarts: int = 0,
    shaping: LinkShaping | None = None,
    outer_addr: str | None = None,
    worker_id: int | None = None,
    fork_ranks: bool = True,
) -> int:
    """Run workers * ranks_per_worker local processes; return 0 if all succeed, else the first failure's code.

    Each process gets torchrun's environment plus EAGERLOCO_WORKERS and EAGERLOCO_RANKS_PER_WORKER. Not
    torch.distributed.run: its agent tears every rank down at the first failure, where here the others get
    ``timeout_s`` to notice the dead peer and exit naming it, and it cannot run an arbitrary ``command``. Kept from
    torchrun: the launcher hosts the TCPStore (TORCHELASTIC_USE_AGENT_STORE), so it outlives any rank.

    ``elastic``: a failed rank does not stop the others; its exit is recorded in the store and, with
    ``max_restarts``, it is started again as a returning worker. ``shaping``: each worker behind a kernel-shaped
    link. ``outer_addr``, ``worker_id``: start only that worker, meeting the others at the coordinator.
    ``fork_ranks``: fork the default command's ranks from this process's rank server (:mod:`eagerloco.launch.ranks`).
    """
    check_int_at_least("workers", workers, 1)
    check_int_at_least("ranks_per_worker", ranks_per_worker, 1)
    check_int_at_least("max_restarts", max_restarts, 0)
    if not (isinstance(timeout_s, (int, float)) and timeout_s >= 0 and timeout_s != float("inf")):
        raise ValueError(f"--grace-s must be a finite number of seconds >= 0, got {timeout_s!r}")
    if master_port is not None and not 0 <= master_port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535 (0: any free port), got {master_port}")
    argv_for_train = list(argv_for_train)
    run_workers = workers
    if outer_addr is not None or worker_id is not None:
        argv_for_train = _one_job(argv_for_train, workers, ranks_per_worker, outer_addr, worker_id, max_restarts)
        workers = 1  # this job starts one process: its worker; the others are jobs of their own
    elastic = elastic or "--elastic" in argv_for_train
    if elastic and command is None and "--elastic" not in argv_for_train:
        argv_for_train.append("--elastic")
    if max_restarts and not elastic:
        raise ValueError("--max-restarts needs --elastic: without it a failed rank stops the whole run")
    if elastic and ranks_per_worker != 1:
        raise ValueError("--elastic supports one rank per worker (--ranks-per-worker 1)")
    if shaping is None:
        return _launch(argv_for_train, workers, ranks_per_worker, master_port, timeout_s, command, out, elastic,
                       max_restarts, None, fork_ranks)
    shaping.check(argv_for_train, outer_addr)
    with shaping.link(argv_for_train, run_workers, worker_id, out or sys.stdout) as (link, argv):
        return _launch(argv, workers, ranks_per_worker, master_port, timeout_s, command, out, elastic, max_restarts,
                       link, False)


def _one_job(argv: list[str], workers: int, ranks_per_worker: int, outer_addr: str | None, worker_id: int | None,
             max_restarts: int) -> list[str]:
    """The train arguments of one worker started as its own job; ValueError for what does not fit."""
    if outer_addr is None or worker_id is None:
        raise ValueError("--outer-addr and --worker-id go together: each worker its own job needs both")
    if ranks_per_worker != 1:
        raise ValueError("with --outer-addr `eagerloco train` runs one process per worker: drop --ranks-per-worker "
                         "(a worker of several ranks: the hook API, eagerloco.outer_loop, under torchrun)")
    if max_restarts:
        raise ValueError("--max-restarts restarts workers of one launch; a worker that is its own job (--outer-addr) "
                         "does not come back into the running run")
    given = {a.split("=")[0] for a in argv}
    for flag in ("--outer-addr", "--worker-id", "--workers"):
        if flag in given:
            raise ValueError(f"{flag} is given to launch with --outer-addr: do not repeat it after --")
    return [*argv, "--outer-addr", outer_addr, "--worker-id", str(worker_id), "--workers", str(workers)]


def _launch(argv_for_train: list[str], workers: int, ranks_per_worker: int, master_port: int | None, timeout_s: float,
            command: Sequence[str] | None, out: IO[str] | None, elastic: bool, max_restarts: int, link: Any,
            fork_ranks: bool) -> int:
    import torch.distributed as dist  # here, not at module level: `eagerloco --help` stays fast

    nproc = workers * ranks_per_worker
    try:
        store = dist.TCPStore(
            "127.0.0.1", master_port or 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError (a RuntimeError): the port is taken
        if not master_port:
            raise
        raise ValueError(
            f"--master-port {master_port} cannot be used for the rendezvous ({_first_line(e)}); another run or "
            f"program has it: pass another port, or leave --master-port out and a free one is picked"
        ) from None
    port = store.port
    out = out or sys.stdout
    lock = threading.Lock()
    cmd = list(command or [sys.executable, "-m", "eagerloco", "train"]) + list(argv_for_train)
    threads_each = max(1, (os.cpu_count() or 1) // nproc)
    procs: list[RankProcess] = []
    readers: list[threading.Thread] = []
    fork = fork_ranks and command is None and link is None

    def spawn(rank: int, incarnation: int = 0) -> RankProcess:
        ours = Environment.for_child()  # what every rank inherits; a rank server is chosen by it
        env = dict(ours, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                   PYTHONUNBUFFERED="1")
        env.update({WORKERS_ENV: str(workers), RANKS_PER_WORKER_ENV: str(ranks_per_worker),
                    LAUNCHER_PID_ENV: str(os.getpid())})  # it dies with us (die_with_launcher)
        if incarnation:
            env[REJOIN_ENV] = "1"
        env.setdefault("OMP_NUM_THREADS", str(threads_each))  # as torchrun: no core oversubscription
        argv = cmd
        if link is not None:  # in the worker's network namespace, behind its shaped uplink
            env.update(link.env())
            argv = link.command(cmd, rank // ranks_per_worker)
        server = rank_server(ours) if fork else None
        if server is not None:  # forked in a session of its own; it dies with the server, which dies with us
            env[LAUNCHER_PID_ENV] = str(server.process.pid)
            p: RankProcess = server.start(["train", *argv_for_train], env)
        else:  # own session: a terminal's Ctrl-C reaches only the launcher, which forwards it exactly once
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        tag = f"[rank {rank}] " if not incarnation else f"[rank {rank}.{incarnation}] "
        t = threading.Thread(target=_pump, args=(p, tag, out, lock), daemon=True)
        t.start()
        readers.append(t)
        return p

    for rank in range(nproc):
        procs.append(spawn(rank))

    def say(msg: str) -> None:
        with lock:
            out.write(f"[launch] {msg}\n")
            out.flush()

    terminated = _Stop()
    try:
        # A terminal's Ctrl-C reaches only the launcher, which passes it on as the other stop signals; SIGHUP must
        # not kill the launcher alone: the ranks, in sessions of their own, would be left behind.
        with handled((signal.SIGINT, *STOP_SIGNALS), terminated.on_signal):
            # Exits are recorded by worker, under the workers' heartbeat prefix
            # (eagerloco.comm.groups.heartbeat_store): errors name a dead worker at once.
            exits = _ExitBoard(dist.PrefixStore("eagerloco/outer/", store), ranks_per_worker)
            code = _supervise(procs, timeout_s, say, terminated, exits, elastic, spawn, max_restarts)
    finally:
        for t in readers:
            t.join(timeout=5.0)
        del store
    return code


class _ExitBoard:
    """Records in the store how each worker's process ended (``exited/<worker>``, with the global rank
    that ended in ``exited-rank/<worker>``) and each rank's (``rank/exited/<rank>``), once per exit."""

    def __init__(self, store: Any, ranks_per_worker: int) -> None:
        self.store, self.r = store, ranks_per_worker
        self.seen: set[tuple[int, int]] = set()

    def stopping(self, signum: int) -> None:
        """The launcher got a stop signal and passes it on (``stopping``): a rank whose collective then fails
        because another rank stopped first says it was stopped by the signal, not that the other failed."""
        with suppress(Exception):  # only words a message
            self.store.set(STOPPING_KEY, str(signum))

    def record(self, rank: int, pid: int, rc: int) -> None:
        if (rank, pid) in self.seen:
            return
        self.seen.add((rank, pid))
        with suppress(Exception):  # only speeds up diagnosis
            self.store.set(f"exited/{rank // self.r}", str(rc))
            self.store.set(f"exited-rank/{rank // self.r}", str(rank))  # which of the worker's ranks
            self.store.set(f"rank/exited/{rank}", str(rc))


def _supervise(procs: list[RankProcess], grace_s: float, say: Any, terminated: _Stop, exits: _ExitBoard,
               elastic: bool, spawn: Any, max_restarts: int) -> int:
    """Wait until every rank's (latest) process has exited. Without ``elastic``, the others get grace_s after the
    first failure, then are stopped, and that failure's code is the result. Elastic: a failed rank is started again
    (as a returning worker) while it has restarts left, the others go on; after the first rank finishes the rest get
    grace_s; success if some rank finished the run."""
    restarts = [0] * len(procs)
    final: list[int | None] = [None] * len(procs)
    first: tuple[int, int] | None = None  # the first failure: (rank, code)
    deadline, after = None, ""
    while True:
        for rank, p in enumerate(procs):
            rc = p.poll()
            if rc is None or final[rank] is not None:
                continue
            exits.record(rank, p.pid, rc)  # the survivors read it: no need to wait for a stale heartbeat
            if elastic and rc != 0 and restarts[rank] < max_restarts and deadline is None:
                restarts[rank] += 1
                say(f"rank {rank} exited with code {rc}; restarting it to rejoin the run "
                    f"(restart {restarts[rank]} of {max_restarts})")
                procs[rank] = spawn(rank, restarts[rank])
                continue
            final[rank] = rc
            running = sum(q.poll() is None for q in procs)
            if rc != 0 and running and (elastic or first is None):
                say(f"rank {rank} exited with code {rc}; the other {running} process(es) "
                    + ("go on (elastic)" if elastic else f"get {grace_s:g} s to finish before they are stopped"))
            if rc != 0 and first is None:
                first = (rank, rc)
            if deadline is None and (rc == 0) == elastic:  # elastic: the first to finish; else the first failure
                deadline, after = time.monotonic() + grace_s, "the run finished" if elastic else f"rank {rank} failed"
        if all(c is not None for c in final):
            break
        if terminated.is_set():  # pass it on, give the processes time to save and say so, then kill what still runs
            say(f"launcher got {signal_name(terminated.signum)}: stopping every process")
            exits.stopping(terminated.signum)
            _signal_all(procs, terminated.signum)
            _wait_all(procs, _STOP_GRACE_S)
            _stop(procs, say)
            return 128 + terminated.signum
        if deadline is not None and time.monotonic() >= deadline and any(p.poll() is None for p in procs):
            say(f"stopping the processes still running {grace_s:g} s after {after}")
            _stop(procs, say)
        elif deadline is not None and not elastic:
            _kill_frozen(procs, say)
        time.sleep(0.05)
    if elastic and 0 in final:
        lost = [r for r, c in enumerate(final) if c != 0]
        if lost:
            say(f"the run finished without rank(s) {lost} (elastic)")
        return 0
    if first is None:
        return 0
    rc = first[1]
    return rc if rc > 0 else 128 - rc  # killed by signal s: 128 + s, as a shell reports it


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:200]


def _pump(p: RankProcess, prefix: str, out: IO[str], lock: threading.Lock) -> None:
    """Copy a process's output line by line, each line prefixed with its rank."""
    assert p.stdout is not None
    for raw in iter(p.stdout.readline, b""):
        line = raw.decode(errors="replace")
        with suppress(OSError, ValueError), lock:  # our output gone (closed pipe): keep draining the child's
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    p.stdout.close()


def _signal_all(procs: list[RankProcess], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, sig)  # the process and anything it started


def _wait_all(procs: list[RankProcess], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _kill_frozen(procs: list[RankProcess], say: Any) -> None:
    """After a failure: if every process still running is stopped by a signal (frozen: it can neither
    finish nor handle SIGTERM), kill those now rather than wait out the grace period."""
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    if not running or not all(pid_stopped(procs[r].pid) for r in running):
        return
    say(f"rank(s) {', '.join(map(str, running))} are stopped by a signal and cannot finish: killing them now")
    for r in running:
        procs[r].kill()
        procs[r].wait()


def _stop(procs: list[RankProcess], say: Any) -> None:
    """SIGTERM what still runs, then SIGKILL what ignores it."""
    if not any(p.poll() is None for p in procs):
        return
    _signal_all(procs, signal.SIGTERM)
    _wait_all(procs, _KILL_AFTER_S)
    if any(p.poll() is None for p in procs):
        say("some processes ignored SIGTERM: killing them")
        _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


class _Stop(threading.Event):
    """Set by a stop signal (SIGINT, SIGTERM, SIGHUP) the launcher got, for the supervisor loop; ``signum`` says
    which."""

    signum = int(signal.SIGTERM)

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self.set()


# --------------------------------------------------------------------------------------------------
# Command line: eagerloco launch --workers M [--ranks-per-worker R] -- <train args>


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``launch`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "launch",
        help="run M workers x R ranks of `eagerloco train` as local processes",
        description="Start workers * ranks-per-worker local processes of `python -m eagerloco train` "
        "with torchrun's environment; everything after `--` goes to train. For several machines "
        "use torchrun instead.",
    )
    p.add_argument("--workers", type=int, required=True, help="number of workers M (outer group size)")
    p.add_argument("--ranks-per-worker", type=int, default=1,
                   help="data-parallel ranks inside each worker (R); M*R processes in all")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: any free one)")
    p.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                   help="after one process fails, seconds the others get to exit before being stopped")
    p.add_argument("--elastic", action="store_true",
                   help="a failed rank does not stop the others (passes --elastic to train)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --elastic: start a failed rank again, at most N times, to rejoin the run (default 0)")
    p.add_argument("--kernel-link-gbps", type=float, default=None, metavar="GBPS",
                   help="shape the link in the kernel instead of emulating it: each worker runs in its own "
                   "network namespace and its uplink carries GBPS Gbit/s (Linux, root, iproute2; latency and "
                   "jitter stay emulated). Do not pass --bandwidth-gbps to train then. With --outer-addr "
                   "127.0.0.1:PORT: jobs of one machine, each worker in its own namespace on a bridge they share")
    p.add_argument("--outer-addr", metavar="HOST:PORT", default=None,
                   help="each worker its own job: start only worker --worker-id of --workers, which meets the others "
                   "at the coordinator at HOST:PORT (eagerloco coordinator; passed on to train)")
    p.add_argument("--worker-id", type=int, default=None, metavar="I", help="with --outer-addr: this job's worker")
    p.add_argument("--spawn-ranks", action="store_true",
                   help="start each rank as its own `python -m eagerloco train` (each imports torch: seconds per "
                   "rank) instead of forking it from one process that has imported it (Linux); for tools that "
                   "find ranks by their command line or /proc/PID/environ")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of `eagerloco train`")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, shaping: LinkShaping | None = None) -> int:
    """``eagerloco launch``; ``shaping``: the link its ``--kernel-link-gbps`` asks for, which the command line
    (:mod:`eagerloco.cli`) takes from the lab."""
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    try:
        return launch(train_args, args.workers, args.ranks_per_worker, args.master_port, args.grace_s,
                      elastic=args.elastic, max_restarts=args.max_restarts, shaping=shaping,
                      outer_addr=args.outer_addr, worker_id=args.worker_id, fork_ranks=not args.spawn_ranks)
    except ValueError as e:  # ConfigError (and so LinkShapingError) is a ValueError too
        print(f"eagerloco launch: error: {e}", file=sys.stderr)
        return 2
