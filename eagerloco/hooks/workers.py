"""The other workers of a hook-API run: joined (an outer rendezvous, a torchrun WORLD, or none), agreed
with before the first step, started from the same weights, and let go at the end."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from eagerloco.comm.agreement import PREFIX as AGREE_PREFIX
from eagerloco.comm.agreement import check_agreement, parameter_digest, publish_and_gather
from eagerloco.comm.base import Communicator
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.groups import DistContext, OuterRendezvous, init_process_groups, join_outer_group, leave_outer_group
from eagerloco.comm.init_sync import broadcast_parameters
from eagerloco.comm.worker import WorkerCommunicator, communicator_for
from eagerloco.config import ConfigError, Environment, LinkConfig, OuterConfig
from eagerloco.outer import OuterSync

#: The n-th outer loop of this process meets the others under its own keys (every worker makes the same ones).
_MEETINGS = itertools.count()


def rendezvous(outer_addr: str | None, worker_id: int | None, workers: int | None,
               env: Environment) -> OuterRendezvous | None:
    """The outer rendezvous of separate jobs from the arguments, else from the environment (None: none)."""
    if outer_addr:
        return OuterRendezvous.parse(outer_addr, worker_id, workers)
    if env.outer_addr:
        return OuterRendezvous.parse(env.outer_addr, env.worker_id, env.workers)
    return None


@dataclass
class Workers:
    """How this process reaches the other workers, and what it must give back at the end.

    Attributes:
        comm: this worker's communicator.
        ctx: where this process sits among the workers (None: a communicator given by the caller, or alone).
        membership: the elastic membership across jobs (elastic=True), else None.
        timeout_s: how long a meeting waits for the others.
    """

    comm: Communicator
    ctx: DistContext | None = None
    membership: Any = None
    timeout_s: float = 300.0
    owns_comm: bool = True
    owns_world: bool = False  # this process initialized torch.distributed's WORLD
    joined: bool = False  # the outer group was formed across jobs (join_outer_group)
    meeting: str = field(default_factory=lambda: f"{AGREE_PREFIX}hooks/{next(_MEETINGS)}/")

    @classmethod
    def given(cls, comm: Communicator) -> Workers:
        """The caller joined the workers itself (``comm=``): nothing to agree on, nothing to release."""
        return cls(comm, owns_comm=False)

    @classmethod
    def connect(cls, outer_addr: str | None, worker_id: int | None, workers: int | None,
                ranks_per_worker: int | None, link: LinkConfig | None, timeout_s: float, seed: int) -> Workers:
        """Join the other workers: an outer rendezvous (arguments or environment), else the torchrun WORLD
        of M workers x R ranks, else this worker alone.

        Raises:
            ConfigError: ``workers`` > 1 without a way to reach the others, or an invalid rendezvous.
            PeerError: the rendezvous did not complete within the timeout.
        """
        from eagerloco.comm.inprocess import InProcessGroup

        env = Environment.read()
        rdzv = rendezvous(outer_addr, worker_id, workers, env)
        if rdzv is not None:
            ctx = join_outer_group(rdzv, timeout_s)
            return cls(communicator_for(ctx, link, seed=seed, timeout_s=timeout_s), ctx, timeout_s=timeout_s,
                       joined=True)
        world = env.world_size or 1
        if world > 1 and env.rank is not None:  # one WORLD of M workers x R ranks
            r = ranks_per_worker or env.ranks_per_worker or 1
            owns_world = not dist.is_initialized()
            ctx = init_process_groups(workers or world // r, r, timeout_s=timeout_s)
            return cls(communicator_for(ctx, link, seed=seed, timeout_s=timeout_s), ctx, timeout_s=timeout_s,
                       owns_world=owns_world)
        if workers not in (None, 1):
            raise ConfigError(f"workers={workers} needs the other workers: pass outer_addr='host:port' and "
                              "worker_id (each worker its own job), or start the workers with torchrun")
        return cls(InProcessGroup(1, link, seed=seed).communicator(0), timeout_s=timeout_s)

    @classmethod
    def connect_elastic(cls, outer_addr: str | None, worker_id: int | None, workers: int | None,
                        link: LinkConfig | None, timeout_s: float, seed: int, config: OuterConfig) -> Workers:
        """Join the other jobs with an elastic membership: survivors of a dead worker go on without it.

        Raises:
            ConfigError: no outer rendezvous, or a job of several processes.
            PeerError: the rendezvous did not complete within the timeout.
        """
        from eagerloco.comm.elastic_jobs import JobsMembership

        env = Environment.read()
        rdzv = rendezvous(outer_addr, worker_id, workers, env)
        if rdzv is None:
            raise ConfigError("elastic=True needs each worker as its own job: pass outer_addr='host:port', worker_id "
                              "and workers (or EAGERLOCO_OUTER_ADDR, ...). In one torchrun WORLD use `eagerloco "
                              "launch --elastic -- <train args>`, whose trainer survives dead workers")
        world = env.world_size or 1
        if world > 1:
            raise ConfigError(f"elastic=True across jobs needs one process per job, but this job has WORLD_SIZE "
                              f"{world}: start each worker as one process, or drop elastic")
        ctx = join_outer_group(rdzv, timeout_s)
        comm = TorchDistCommunicator.from_context(ctx, link, seed=seed, timeout_s=timeout_s, elastic=True)
        membership = JobsMembership(ctx.outer_store, rdzv.worker, rdzv.workers, timeout_s, group=ctx.outer_group,
                                    inner_steps=config.inner_steps, is_dp=config.per_step)
        ctx.outer_group = None  # the membership owns the group (and its successors) from here
        membership.attach(comm, None)
        return cls(comm, ctx, membership, timeout_s=timeout_s, joined=True)

    @property
    def is_reporting_rank(self) -> bool:
        """Whether this process writes the worker's files and logs (rank 0 of its worker)."""
        return self.ctx is None or self.ctx.rank_in_worker == 0

    def meet(self, mine: dict[str, Any], what: str) -> None:
        """Compare ``mine`` with every other worker's, through the run's store.

        Raises:
            ConfigError: naming each difference and each worker's value.
            PeerError: a worker did not arrive within the timeout.
        """
        ctx = self.ctx
        if ctx is None:
            return
        store = dist.PrefixStore("eagerloco/", ctx.outer_store) if ctx.outer_store is not None else ctx.store
        if not ctx.is_outer_rank or store is None:
            return
        everyone = publish_and_gather(store, ctx.worker, list(range(ctx.workers)), mine, self.timeout_s,
                                      lambda w: f"worker {w}", prefix=f"{self.meeting}{what}/")
        fix = ("Pass the same settings to outer_loop on every worker" if what == "settings" else
               "The workers start from different weights: seed every worker the same way, or leave init_sync=True "
               "(worker 0's weights are then sent to all)")
        check_agreement(everyone, lambda w: f"worker {w}", fix)

    def start_weights(self, model: nn.Module, sync: OuterSync, init_sync: bool) -> None:
        """Before the first step of a run that starts afresh: take worker 0's parameters (init_sync) and
        start the outer copies from them, or check that every worker has the same."""
        ctx = self.ctx
        if ctx is None or sync.step != 0:  # alone, or resumed: each worker continues from its own state
            return
        params = list(model.parameters())
        if not init_sync:
            self.meet({"initial parameters": parameter_digest(params)}, "weights")
            return
        outer = self.comm.outer if isinstance(self.comm, WorkerCommunicator) else self.comm
        group = outer.group if ctx.is_outer_rank and isinstance(outer, TorchDistCommunicator) else None
        broadcast_parameters(params, ctx, group)
        sync.restart_from_model()

    def release(self, cancel: bool) -> None:
        """Close the communicator (cancel: drop what is queued), the membership and the groups this took."""
        if self.owns_comm:
            self.comm.close(cancel=cancel)
        if self.membership is not None:
            self.membership.teardown()
        if self.joined and self.ctx is not None:
            leave_outer_group(self.ctx)
        if self.owns_world:
            from eagerloco.comm.groups import shutdown

            shutdown()


__all__ = ["Workers", "rendezvous"]
