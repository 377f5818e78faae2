"""Process groups of a torch.distributed run: who is which worker, and the groups and store they use.

M workers of R ranks each (``WORLD_SIZE = M * R``, global rank ``w * R + r``). The R ranks of worker
w form its *inner group* (ordinary data parallelism, fast interconnect); the first rank of every
worker forms the *outer group*, the slow link the outer algorithm crosses. With sharded workers
(FSDP, ``sharded_outer``) there are R outer groups instead, the i-th of the i-th rank of every
worker, and every rank exchanges its own shard.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from eagerloco.comm.errors import PeerError
from eagerloco.config import ConfigError

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

    @property
    def is_outer_rank(self) -> bool:
        """Whether this rank talks to the other workers (the first rank of its worker, or every rank
        when the exchange is sharded)."""
        return self.sharded_outer or self.rank_in_worker == 0

    @property
    def outer_ranks(self) -> list[int]:
        """The global ranks of this rank's outer group."""
        i = self.rank_in_worker if self.sharded_outer else 0
        return [w * self.ranks_per_worker + i for w in range(self.workers)]

    @property
    def inner_ranks(self) -> list[int]:
        first = self.worker * self.ranks_per_worker
        return list(range(first, first + self.ranks_per_worker))

    def worker_names(self) -> dict[int, str]:
        """How errors name each worker (with the global ranks whose logs to read)."""
        r = self.ranks_per_worker
        if r == 1:
            return {w: f"worker {w}" for w in range(self.workers)}
        return {w: f"worker {w} (global ranks {w * r}..{w * r + r - 1})" for w in range(self.workers)}


def env_int(name: str) -> int | None:
    """The integer in environment variable name (None if unset or empty; ConfigError if not an integer)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"environment variable {name} must be an integer, got {value!r}") from e


def workers_from_env() -> tuple[int, int] | None:
    """(workers, ranks_per_worker) as set by ``eagerloco launch``, or None under plain torchrun."""
    m, r = env_int("EAGERLOCO_WORKERS"), env_int("EAGERLOCO_RANKS_PER_WORKER")
    return None if m is None else (m, r or 1)


def set_worker_threads() -> int:
    """Give this process its share of the cores as intra-op threads; returns the count.

    Several processes on one host each defaulting to all cores oversubscribe them (on a 2-core
    machine 4 processes x 2 threads run slower than 4 x 1). Call before building the model.
    """
    local = env_int("LOCAL_WORLD_SIZE") or 1
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
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
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
    local_rank = env_int("LOCAL_RANK") or 0
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA, which is not available here; use --backend gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError("torch.distributed is already initialized with a different rank or world size")

    r = ranks_per_worker
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
    host, port = os.environ.get("MASTER_ADDR"), env_int("MASTER_PORT")
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


def shutdown() -> None:
    """Tear down torch.distributed at the end of a run (avoids the at-exit warning)."""
    if dist.is_initialized():
        dist.destroy_process_group()
