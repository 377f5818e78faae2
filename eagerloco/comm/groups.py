"""Process groups of a torch.distributed run: who is which worker, and the groups and store they use.

M workers of R ranks (global rank ``w * R + r``): the R ranks of a worker form its inner group, the first
rank of every worker the outer group (with ``sharded_outer``, R outer groups, the i-th of the i-th rank of
every worker).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
    #: This process's client of the run's store, under the heartbeats' prefix (None if it could not be reached).
    store: dist.Store | None = field(default=None, repr=False)
    #: Every rank exchanges its own shard of the outer gradient (FSDP inside the worker): R outer
    #: groups side by side, each carrying 1/R of the payload.
    sharded_outer: bool = False
    #: Each worker is its own job with its own WORLD (:func:`eagerloco.comm.rendezvous.join_outer_group`): global
    #: ranks are ranks of this worker's job, and the outer group spans the jobs.
    separate_jobs: bool = False
    #: The coordinator's store, without a key prefix (separate jobs: a CoordinatorClient).
    outer_store: Any = field(default=None, repr=False)
    #: This worker arrived after the run's first outer group was formed: the elastic membership admits it.
    joining: bool = False

    @property
    def is_outer_rank(self) -> bool:
        """Whether this rank talks to the other workers (the first rank of its worker, or every rank
        when the exchange is sharded)."""
        return self.sharded_outer or self.rank_in_worker == 0

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
    """Give this process its share of the cores as intra-op threads (processes on one host would oversubscribe
    them); returns the count. Call before building the model."""
    local = Environment.read().local_world_size or 1
    n = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(n)
    return n


def world_backend(workers: int, ranks_per_worker: int, backend: str | None, timeout_s: float,
                  outer_backend: str | None, sharded_outer: bool) -> tuple[str, torch.device]:
    """Check M x R against RANK and WORLD_SIZE, and choose the backend ("nccl" with CUDA, else "gloo") and this
    rank's device (made current under NCCL). ConfigError names a bad setting or two ranks on one GPU."""
    for name, value in (("workers", workers), ("ranks_per_worker", ranks_per_worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if not (timeout_s > 0):
        raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    env = Environment.read()
    if env.rank is None or env.world_size is None:
        raise ConfigError("RANK and WORLD_SIZE are not set: start the processes with `eagerloco launch --workers M "
                          "[--ranks-per-worker R] -- <train args>` or `torchrun --nproc-per-node M*R -m eagerloco "
                          "train ...`")
    r, world = ranks_per_worker, env.world_size
    if world != workers * r:
        raise ConfigError(f"--workers {workers} x --ranks-per-worker {r} needs {workers * r} processes, but "
                          f"WORLD_SIZE is {world}: start {workers * r} processes (torchrun --nproc-per-node "
                          f"{workers * r}) or set --workers/--ranks-per-worker so that their product is {world}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA, which is not available here; use --backend gloo")
    local_world = env.local_world_size or 1
    # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", then
    # "invalid usage" at the first collective): say so before any group is built.
    if backend == "nccl":
        refuse_shared_gpu("--backend", range(local_world))
    if (outer_backend or backend) == "nccl":
        for i in range(r if sharded_outer else 1):  # the i-th rank of each worker on this machine
            refuse_shared_gpu("--outer-backend", range(i, local_world, r))
    if backend != "nccl":
        return backend, torch.device("cpu")
    device = torch.device("cuda", (env.local_rank or 0) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return backend, device


def process_groups(workers: int, ranks_per_worker: int, backend: str, device: torch.device, timeout_s: float,
                   outer_backend: str | None, sharded_outer: bool) -> DistContext:
    """The inner and outer groups of M workers x R ranks over the initialized WORLD; every rank creates every group.

    The outer group is gloo even on GPUs: the outer payload is decoded and summed on the CPU anyway, and gloo
    reports a dead peer as an exception where NCCL's watchdog aborts the process (``outer_backend=None``: the main one).
    """
    rank, world, r = dist.get_rank(), dist.get_world_size(), ranks_per_worker
    timeout = timedelta(seconds=timeout_s)
    worker, rank_in_worker = divmod(rank, r)
    inner = outer = None
    if r > 1:
        for w in range(workers):  # every rank creates every inner group, in order
            g = dist.new_group(list(range(w * r, w * r + r)), timeout=timeout)
            inner = g if w == worker else inner
    for i in range(r if sharded_outer else 1):  # every rank creates every outer group, in order
        g = dist.new_group([w * r + i for w in range(workers)], timeout=timeout, backend=outer_backend or backend)
        outer = g if i == rank_in_worker else outer
    ctx = DistContext(rank=rank, world_size=world, worker=worker, rank_in_worker=rank_in_worker, workers=workers,
                      ranks_per_worker=r, local_rank=Environment.read().local_rank or 0, device=device,
                      backend=backend, timeout_s=timeout_s, inner_group=inner, outer_group=outer,
                      sharded_outer=sharded_outer)
    ctx.store = heartbeat_store(timeout_s)  # every rank's: the outer ranks' heartbeats, the runtime's waits
    return ctx


def shared_gpu(local_ranks: Iterable[int], device_count: int) -> tuple[int, int] | None:
    """The first two of these local ranks that land on the same GPU (local rank modulo the GPUs), if any."""
    seen: dict[int, int] = {}
    for lr in local_ranks:
        if lr % device_count in seen:
            return seen[lr % device_count], lr
        seen[lr % device_count] = lr
    return None


def refuse_shared_gpu(flag: str, local_ranks: Iterable[int]) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError(f"{flag} nccl needs CUDA, which is not available here; use {flag} gloo")
    pair = shared_gpu(local_ranks, n)
    if pair is not None:
        raise ConfigError(
            f"{flag} nccl: local ranks {pair[0]} and {pair[1]} would share GPU {pair[0] % n} (this machine has {n}), "
            f"and NCCL refuses two ranks of one group on one GPU; use {flag} gloo, or start at most one rank "
            "of the group per GPU")


#: Where the outer group's gloo rendezvous keeps its keys in the coordinator's store.
OUTER_PG_PREFIX = "eagerloco/outer-pg/"


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group over ``store`` outside this process's WORLD (``new_group`` only makes subgroups of
    WORLD). Collectives accept it; ``dist.get_rank(g)`` does not: use ``g.rank()`` and ``g.size()``."""
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def heartbeat_store(timeout_s: float) -> dist.Store | None:
    """This process's client of the run's store at MASTER_ADDR:MASTER_PORT, under the heartbeats' prefix; None where
    there is none: heartbeats only improve error messages, so an unreachable store is a warning. timeout_s is capped
    at 30 s: diagnosis must stay quick."""
    env = Environment.read()
    host, port = env.master_addr, env.master_port
    if not host or port is None:
        return None
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(timeout_s, 30.0)),
                               wait_for_workers=False)
    except Exception as e:
        warnings.warn(f"no heartbeat store: cannot reach the run's store at {host}:{port} ({e}); is the launcher still "
                      "running? Peer errors will not name the worker", stacklevel=2)
        return None
    return dist.PrefixStore(HEARTBEAT_PREFIX, client)


def shutdown() -> None:
    """Tear down torch.distributed at the end of a run (avoids the at-exit warning)."""
    if dist.is_initialized():
        dist.destroy_process_group()
