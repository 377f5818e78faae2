"""Process groups of a torch.distributed run: who is which worker, and the groups and store they use.

M workers of R ranks each (``WORLD_SIZE = M * R``, global rank ``w * R + r``). The R ranks of worker
w form its *inner group* (ordinary data parallelism, fast interconnect); the first rank of every
worker forms the *outer group*, the slow link the outer algorithm crosses. With sharded workers
(FSDP, ``sharded_outer``) there are R outer groups instead, the i-th of the i-th rank of every
worker, and every rank exchanges its own shard.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from eagerloco.comm.errors import PeerError, describe_exception, is_transport_failure
from eagerloco.comm.waiting import bounded, wait_for_listener, wait_for_workers
from eagerloco.config import ConfigError
from eagerloco.environment import Environment

#: How long one collective may wait for its peers by default (seconds).
DEFAULT_TIMEOUT_S = 300.0
#: Where the outer communicators keep their heartbeats in the run's store (``eagerloco launch``
#: records the workers' exits under it too).
HEARTBEAT_PREFIX = "eagerloco/outer/"


@dataclass
class DistContext:
    """Where this process sits: its worker, its rank in that worker, and the groups it uses."""

    rank: int  # global rank
    world_size: int
    worker: int  # index of this process's worker (= its rank in the outer group, if a member)
    rank_in_worker: int
    workers: int
    ranks_per_worker: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float
    #: The R ranks of this worker; None when R == 1 (nothing to average inside the worker).
    inner_group: dist.ProcessGroup | None = None
    #: The group this rank exchanges outer gradients in: one rank per worker (each worker's first),
    #: None on the other ranks; with ``sharded_outer`` every rank has one (the i-th rank of every worker).
    outer_group: dist.ProcessGroup | None = None
    #: Client of the rendezvous store for heartbeats (None if it could not be reached).
    store: dist.Store | None = field(default=None, repr=False)
    #: Every rank exchanges its own shard of the outer gradient (FSDP inside the worker): R outer
    #: groups side by side, each carrying 1/R of the payload.
    sharded_outer: bool = False
    #: Each worker is its own job with its own WORLD (:func:`join_outer_group`): global ranks are
    #: ranks of this worker's job, and the outer group spans the jobs.
    separate_jobs: bool = False
    #: The outer TCPStore itself, without a key prefix (separate jobs; worker 0's process hosts it).
    outer_store: dist.Store | None = field(default=None, repr=False)

    @property
    def is_outer_rank(self) -> bool:
        """Whether this rank talks to the other workers (the first rank of its worker, or every rank
        when the exchange is sharded)."""
        return self.sharded_outer or self.rank_in_worker == 0

    @property
    def outer_ranks(self) -> list[int]:
        """The global ranks of this rank's outer group."""
        i = self.rank_in_worker if self.sharded_outer else 0
        if self.separate_jobs:
            return [i] * self.workers  # rank i of every worker's job
        return [w * self.ranks_per_worker + i for w in range(self.workers)]

    @property
    def inner_ranks(self) -> list[int]:
        first = 0 if self.separate_jobs else self.worker * self.ranks_per_worker
        return list(range(first, first + self.ranks_per_worker))

    def worker_names(self) -> dict[int, str]:
        """How errors name each worker (with the global ranks whose logs to read)."""
        r = self.ranks_per_worker
        if r == 1 or self.separate_jobs:
            return {w: f"worker {w}" for w in range(self.workers)}
        return {w: f"worker {w} (global ranks {w * r}..{w * r + r - 1})" for w in range(self.workers)}


def set_worker_threads() -> int:
    """Give this process its share of the cores as intra-op threads; returns the count.

    Several processes on one host each defaulting to all cores oversubscribe them (on a 2-core
    machine 4 processes x 2 threads run slower than 4 x 1). Call before building the model.
    """
    local = Environment.read().local_world_size or 1
    n = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(n)
    return n


def init_process_groups(
    workers: int,
    ranks_per_worker: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    outer_backend: str | None = "gloo",
    sharded_outer: bool = False,
) -> DistContext:
    """Join the run started by torchrun or ``eagerloco launch`` and build the inner and outer groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. backend: "nccl" when CUDA is
    available, else "gloo". The outer group uses gloo by default even on GPUs: the outer payload is
    decoded and summed on the CPU anyway, it is small and rare next to inner traffic, and gloo
    reports a dead peer as an exception where NCCL's watchdog would abort the process; pass
    ``outer_backend=None`` to use the main backend.

    sharded_outer: instead of one outer group of the workers' first ranks, R outer groups, the i-th
    of the i-th rank of every worker, so that every rank exchanges its own shard (FSDP).

    Every rank creates every group, in the same order (torch.distributed requires it).
    """
    for name, value in (("workers", workers), ("ranks_per_worker", ranks_per_worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if not (timeout_s > 0):
        raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    env = Environment.read()
    rank, world = env.rank, env.world_size
    if rank is None or world is None:
        raise ConfigError(
            "RANK and WORLD_SIZE are not set: start the processes with `eagerloco launch --workers M "
            "[--ranks-per-worker R] -- <train args>` or "
            "`torchrun --nproc-per-node M*R -m eagerloco train ...`"
        )
    expected = workers * ranks_per_worker
    if world != expected:
        raise ConfigError(
            f"--workers {workers} x --ranks-per-worker {ranks_per_worker} needs {expected} processes, but "
            f"WORLD_SIZE is {world}: start {expected} processes (torchrun --nproc-per-node {expected}) or "
            f"set --workers/--ranks-per-worker so that their product is {world}"
        )
    local_rank = env.local_rank or 0
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA, which is not available here; use --backend gloo")
    r = ranks_per_worker
    local_world = env.local_world_size or 1
    # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", then
    # "invalid usage" at the first collective): say so before any group is built.
    if backend == "nccl":
        _refuse_shared_gpu("--backend", range(local_world))
    if (outer_backend or backend) == "nccl":
        for i in range(r if sharded_outer else 1):  # the i-th rank of each worker on this machine
            _refuse_shared_gpu("--outer-backend", range(i, local_world, r))
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        init_world(backend, timeout_s, env)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError("torch.distributed is already initialized with a different rank or world size")

    worker, rank_in_worker = divmod(rank, r)
    inner = None
    if r > 1:
        for w in range(workers):  # every rank creates every inner group, in order
            g = dist.new_group(list(range(w * r, w * r + r)), timeout=timeout)
            if w == worker:
                inner = g
    outer = None
    for i in range(r if sharded_outer else 1):  # every rank creates every outer group, in order
        g = dist.new_group([w * r + i for w in range(workers)], timeout=timeout, backend=outer_backend or backend)
        if i == rank_in_worker:
            outer = g
    ctx = DistContext(
        rank=rank, world_size=world, worker=worker, rank_in_worker=rank_in_worker, workers=workers,
        ranks_per_worker=r, local_rank=local_rank, device=device, backend=backend, timeout_s=timeout_s,
        inner_group=inner, outer_group=outer, sharded_outer=sharded_outer,
    )
    ctx.store = heartbeat_store(timeout_s) if ctx.is_outer_rank else None
    return ctx



def init_world(backend: str, timeout_s: float, env: Environment) -> None:
    """``dist.init_process_group`` over the launcher's variables (env://), with a wait that is bounded by the
    timeout, says every 10 s what it waits for, and ends at once on Ctrl-C or SIGTERM: in C++ it ignores
    them and prints nothing until its own timeout.

    Raises:
        PeerError: the run's other processes did not all arrive, or the rendezvous store cannot be reached.
    """
    rank, world = env.rank or 0, env.world_size or 1
    where = f"{env.master_addr or 'localhost'}:{env.master_port or '?'}"
    me = f"rank {rank}"
    fix = (f"start all {world} processes of the run (WORLD_SIZE) with the same MASTER_ADDR and MASTER_PORT "
           "(eagerloco launch and torchrun do), and see the other ranks' logs")
    waiting = f"{me}: waiting for the run's {world} processes at {where}"
    # The current GPU is per thread: the waiting thread starts NCCL on this thread's.
    gpu = torch.cuda.current_device() if backend == "nccl" and torch.cuda.is_available() else None

    def init() -> None:
        if gpu is not None:
            torch.cuda.set_device(gpu)
        dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))

    started = time.monotonic()
    try:
        if rank != 0 and env.master_port is not None:  # the store's client retries with C++ frames: connect once
            wait_for_listener(env.master_addr or "localhost", env.master_port, timeout_s, waiting)  # it listens
        bounded(init, timeout_s, waiting, started=started)
    except TimeoutError:
        raise PeerError(f"{me}: the run's {world} processes did not all arrive at {where} within {timeout_s:g} s; "
                        f"{fix}", []) from None
    except Exception as e:
        if not (is_transport_failure(e) or isinstance(e, OSError)):
            raise
        raise PeerError(f"{me}: the run's rendezvous at {where} failed ({describe_exception(e)}); {fix}", []) from None


def shared_gpu(local_ranks: Iterable[int], device_count: int) -> tuple[int, int] | None:
    """The first two of these local ranks that land on the same GPU (local rank modulo the GPUs), if any.

    Args:
        local_ranks: the local ranks of one process group's members on this machine.
        device_count: the machine's GPUs.

    Returns:
        (first, second) local ranks sharing a GPU, or None when each has its own.
    """
    seen: dict[int, int] = {}
    for lr in local_ranks:
        if lr % device_count in seen:
            return seen[lr % device_count], lr
        seen[lr % device_count] = lr
    return None


def _refuse_shared_gpu(flag: str, local_ranks: Iterable[int]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError(f"{flag} nccl needs CUDA, which is not available here; use {flag} gloo")
    pair = shared_gpu(local_ranks, n)
    if pair is not None:
        raise ConfigError(
            f"{flag} nccl: local ranks {pair[0]} and {pair[1]} would share GPU {pair[0] % n} (this machine has {n}), "
            f"and NCCL refuses two ranks of one group on one GPU; use {flag} gloo, or start at most one rank "
            "of the group per GPU")


#: Where the outer group's gloo rendezvous keeps its keys in the store worker 0 hosts.
OUTER_PG_PREFIX = "eagerloco/outer-pg/"


@dataclass(frozen=True)
class OuterRendezvous:
    """Where the workers of a run find each other when each is its own job: worker 0 hosts a
    TCPStore at host:port, every worker's first rank connects to it."""

    host: str
    port: int
    worker: int
    workers: int

    @classmethod
    def parse(cls, addr: str, worker: int | None, workers: int | None) -> OuterRendezvous:
        """From ``host:port``, this worker's id and the number of workers; ConfigError if invalid."""
        host, sep, port = str(addr).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"--outer-addr must be host:port with a port in 1..65535, got {addr!r}")
        if workers is None or isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"--workers must be an integer >= 1 with --outer-addr, got {workers!r}")
        if worker is None or isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < workers:
            raise ConfigError(f"--worker-id must be an integer in 0..{workers - 1} (one per job), got {worker!r}")
        return cls(host.strip("[]"), int(port), worker, workers)


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group over ``store`` that is not part of this process's WORLD.

    torch.distributed's ``new_group`` only makes subgroups of WORLD; a group across jobs is built
    the way ``init_process_group`` builds WORLD (a ProcessGroup with a gloo backend), without
    registering it as WORLD, so it works whether or not (and however) the job initialized its own.
    The collectives (``dist.all_reduce(..., group=g)``) accept it; ``dist.get_rank(g)`` does not:
    use ``g.rank()`` and ``g.size()``.
    """
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def join_outer_group(rdzv: OuterRendezvous, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the other workers as one job of several: this job's WORLD is the worker's inner group.

    The job's WORLD (torchrun's, or one process alone) is left as it is: its ranks are the worker's
    data-parallel (or FSDP) ranks, and a framework may wrap the model in DDP over it. If RANK and
    WORLD_SIZE say the job has several processes and nobody initialized WORLD yet, it is initialized
    here (env://). The job's rank 0 connects to the TCPStore worker 0 hosts at ``host:port`` (worker
    0's first rank starts it) and forms the outer gloo group of the M workers under its own key
    prefix, so the job's own store and groups never see it. Heartbeats go to the same store.

    Raises:
        ConfigError: an invalid setting, two jobs with the same worker id, or workers that disagree on M.
        PeerError: the rendezvous did not complete within timeout_s (a worker did not start, or the
            address is wrong).
    """
    if not (timeout_s > 0):
        raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    env = Environment.read()
    rank, world = env.rank or 0, env.world_size or 1
    if not dist.is_initialized() and world > 1:
        init_world("nccl" if torch.cuda.is_available() else "gloo", timeout_s, env)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    else:
        backend = "gloo"
    local_rank = env.local_rank or 0
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    ctx = DistContext(
        rank=rank, world_size=world, worker=rdzv.worker, rank_in_worker=rank, workers=rdzv.workers,
        ranks_per_worker=world, local_rank=local_rank, device=device, backend=backend, timeout_s=timeout_s,
        separate_jobs=True,
    )
    if rank != 0:
        return ctx
    where = f"{rdzv.host}:{rdzv.port}"
    me = f"worker {rdzv.worker}"
    what = "start the outer store at" if rdzv.worker == 0 else "reach worker 0's outer store at"
    waiting = f"{me}: waiting for worker 0's outer store at {where}"
    started = time.monotonic()
    try:  # a connection that never answers must not hold the job past the timeout, nor ignore Ctrl-C
        if rdzv.worker != 0:  # the store's client only once worker 0 listens: its own retries print C++ frames
            wait_for_listener(rdzv.host, rdzv.port, timeout_s, waiting)
        store = bounded(lambda: dist.TCPStore(rdzv.host, rdzv.port, is_master=rdzv.worker == 0,
                                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s)),
                        timeout_s, waiting, started=started)
    except TimeoutError:
        raise PeerError(f"{me} cannot {what} {where}: no answer within {timeout_s:g} s; check --outer-addr and "
                        "that worker 0 runs", [0]) from None
    except Exception as e:
        raise PeerError(f"{me} cannot {what} {where} ({describe_exception(e)}); check --outer-addr and that "
                        "worker 0 runs", [0]) from None
    claimed = store.add(f"eagerloco/join/{rdzv.worker}", 1)
    if claimed != 1:
        raise ConfigError(f"two jobs joined {where} as worker {rdzv.worker}: give each job its own --worker-id "
                          f"in 0..{rdzv.workers - 1} (or use a fresh --outer-addr port for a new run)")
    store.set(f"eagerloco/size/{rdzv.worker}", str(rdzv.workers))
    wait_for_workers(store, rdzv.worker, rdzv.workers, timeout_s, where)
    try:
        group = bounded(lambda: gloo_group(dist.PrefixStore(OUTER_PG_PREFIX, store), rdzv.worker, rdzv.workers,
                                           timeout_s), timeout_s, f"{me}: forming the outer group at {where}")
    except Exception as e:
        raise PeerError(f"{me}: the outer rendezvous at {where} did not complete within {timeout_s:g} s "
                        f"({describe_exception(e)}); start all {rdzv.workers} workers with the same --outer-addr "
                        "and --workers", []) from None
    ctx.outer_group = group
    ctx.outer_store = store
    ctx.store = dist.PrefixStore(HEARTBEAT_PREFIX, store)
    return ctx


def outer_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in an outer group, whether a subgroup of WORLD or one across jobs."""
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return group.rank(), group.size()


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client connection of this process's own to the run's rendezvous store.

    Args:
        timeout_s: how long each store operation may wait, in seconds.

    Returns:
        A TCPStore client of the store at MASTER_ADDR:MASTER_PORT (no key prefix).

    Raises:
        ConfigError: MASTER_ADDR or MASTER_PORT is not set.
        PeerError: the store cannot be reached (the launcher is gone).
    """
    env = Environment.read()
    host, port = env.master_addr, env.master_port
    if not host or port is None:
        raise ConfigError("MASTER_ADDR and MASTER_PORT (the launcher's store) are not set; start the run with "
                          "`eagerloco launch` or torchrun")
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as e:
        raise PeerError(f"cannot reach the run's store at {host}:{port} ({e}); is the launcher still running?") from e


def heartbeat_store(timeout_s: float) -> dist.Store | None:
    """The store the outer communicators publish heartbeats in, or None where there is none.

    Heartbeats only improve error messages (they name a dead worker), so a missing or unreachable
    store is a warning, not an error. timeout_s is capped at 30 s: diagnosis must stay quick.
    """
    try:
        client = store_client(min(timeout_s, 30.0))
    except ConfigError:
        return None
    except PeerError as e:
        warnings.warn(f"no heartbeat store: {e}; peer errors will not name the worker", stacklevel=2)
        return None
    return dist.PrefixStore(HEARTBEAT_PREFIX, client)


def leave_outer_group(ctx: DistContext) -> None:
    """Shut down a group formed across jobs (:func:`join_outer_group`) now, and free it and its store.

    Such a group is not WORLD's, so ``destroy_process_group`` does not know it, and gloo's
    ``shutdown()`` stops none of its threads: they end only when the group is freed. Left to the
    interpreter's exit (a framework's trainer holding the loop in a reference cycle), the group is
    freed while Python is being torn down, which can abort the process ("terminate called without
    an active exception", status 134) after a run that succeeded. The communicator has let go of it
    at its close; the cycles that still hold it are collected here, so that its threads, sockets and
    the store's connection end now.
    """
    group = ctx.outer_group
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        group.shutdown()
    ctx.outer_group = None
    ctx.store = ctx.outer_store = None
    del group
    gc.collect()


def shutdown() -> None:
    """Tear down torch.distributed at the end of a run (avoids the at-exit warning)."""
    if dist.is_initialized():
        dist.destroy_process_group()
