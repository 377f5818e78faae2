"""Connecting the workers of a run, for every entry point: :func:`connect` and :meth:`Connection.outer` join
through :mod:`eagerloco.comm.rendezvous` and return a :class:`Connection`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.comm.base import Communicator
from eagerloco.comm.elastic import Membership
from eagerloco.comm.errors import PeerError, api_errors
from eagerloco.comm.groups import DEFAULT_TIMEOUT_S, DistContext
from eagerloco.comm.rendezvous import (
    Meeting,
    OuterRendezvous,
    check_agreement,
    init_process_groups,
    join_outer_group,
    leave_outer_group,
    prefixed,
)
from eagerloco.config import ConfigError, LinkConfig, OuterConfig
from eagerloco.environment import Environment


# ---------------------------------------------------------------------------------------------- a connection
@dataclass
class Connection:
    """How this process reaches the other workers, and what it must give back at the end.

    ``ctx``: where this process sits (None: a given communicator, or alone); ``membership``: the elastic
    membership across jobs; ``init_sync``: start from worker 0's parameters (else each keeps its own, checked equal).
    A worker that arrives at an elastic run under way has no communicator until :meth:`settle` admits it.
    """

    opened: Communicator | None
    ctx: DistContext | None = None
    membership: Membership | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    seed: int = 0
    init_sync: bool = True
    owns_comm: bool = True
    owns_world: bool = False  # this process initialized torch.distributed's WORLD
    joined: bool = False  # the outer group was formed across jobs (join_outer_group)
    meeting: Meeting | None = None
    late: Callable[[], None] | None = None  # arrived at an elastic run under way: how it opens once admitted (settle)
    finished: str = ""  # the elastic run under way ended before this worker was admitted: saying so

    @property
    def comm(self) -> Communicator:
        """The communicator over the outer group."""
        if self.finished:
            raise PeerError(self.finished, [])
        if self.opened is None:
            raise ConfigError("this connection joins an elastic run under way and is not admitted yet: pass it to "
                              "outer_loop (or a callback), which checks the run's settings and waits for a round "
                              "boundary")
        return self.opened

    @classmethod
    def given(cls, comm: Communicator, seed: int = 0) -> Connection:
        """The caller joined the workers itself: nothing to agree on, nothing to release."""
        return cls(comm, seed=seed, owns_comm=False)

    @classmethod
    def outer(cls, rdzv: OuterRendezvous, link: LinkConfig | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              seed: int = 0, elastic: bool = False, init_sync: bool = True,
              device: torch.device | None = None, settings: Mapping[str, Any] | None = None) -> Connection:
        """Join the other workers as one job of several and open the communicator over the outer group; ``elastic``
        adds a membership that re-forms it and admits this worker into a run under way (then :meth:`take_state`).
        ``settings``: what a worker joining later must match; a joiner without them waits for :meth:`settle`.
        """
        ctx = join_outer_group(rdzv, timeout_s)
        self = cls(None, ctx, timeout_s=timeout_s, seed=seed, init_sync=init_sync, joined=True)
        try:
            if not ctx.joining:
                self.meeting = outer_meeting(ctx, rdzv.where)
                self.open(rdzv, link, elastic, device)
            elif elastic:
                self.late = partial(self.open, rdzv, link, elastic, device)
            else:
                raise ConfigError(f"worker {rdzv.worker}: the run at {rdzv.where} is under way, and only an elastic "
                                  "run (--elastic, elastic=True) admits a worker that arrives late; restart every "
                                  "worker from the last checkpoint, or start a fresh coordinator for a new run")
            if settings is not None:  # the trainer compares them among the workers that start the run
                self.settle(settings)
        except BaseException:
            self.release(cancel=True)
            raise
        return self

    def open(self, rdzv: OuterRendezvous, link: LinkConfig | None, elastic: bool, device: torch.device | None) -> None:
        """Open the communicator over the outer group (the membership's, under elastic; a worker that arrived late
        waits here to be admitted)."""
        from eagerloco.comm.worker import communicator_for

        ctx = self.ctx
        assert ctx is not None
        if ctx.joining:
            self.membership = Membership.join(ctx.outer_store, rdzv.worker, rdzv.workers, self.timeout_s)
            if self.membership is None:
                self.finished = f"worker {rdzv.worker}: the run at {rdzv.where} finished before this worker could join"
                return
            ctx.outer_group = self.membership.group
        elif elastic:
            self.membership = Membership(ctx.outer_store, rdzv.worker, rdzv.workers, self.timeout_s,
                                         group=ctx.outer_group)
        members = {} if self.membership is None else {"members": self.membership.members}
        self.opened = communicator_for(ctx, link, seed=self.seed, timeout_s=self.timeout_s, device=device,
                                       elastic=elastic, **members)
        if self.membership is not None:
            ctx.outer_group = None  # the membership owns it (and its successors) from here

    def enter(self, mine: Mapping[str, Any], topic: str = "settings", fix: str = "",
              fixes: Sequence[tuple[str, str]] = ()) -> None:
        """Meet the others with ``mine`` on ``topic``: the workers that start the run compare theirs (:meth:`agree`);
        then :meth:`settle`."""
        if self.late is None:
            self.agree(mine, topic, fix, fixes)
        self.settle(mine, topic, fixes)

    def settle(self, mine: Mapping[str, Any], topic: str = "settings", fixes: Sequence[tuple[str, str]] = ()) -> None:
        """Across jobs, ``mine`` on ``topic`` as the run's at the coordinator: the workers that start it keep theirs
        there; a worker that arrives later checks its own against them (ConfigError) and, once its settings pass,
        waits to be admitted at a round boundary (its communicator opens then)."""
        ctx = self.ctx
        if ctx is None or ctx.outer_store is None:  # a torchrun WORLD, a given communicator, or alone
            return
        store = ctx.outer_store
        key = SETTINGS_KEY if topic == "settings" else f"{SETTINGS_KEY}/{topic}"
        if self.late is None:
            store.keep(key, json.dumps(mine, sort_keys=True, default=str))
            return
        me = f"worker {ctx.worker}"
        if store.check([key]):
            theirs = json.loads(store.get(key).decode())
            check_agreement({0: json.loads(json.dumps(mine, default=str)), -1: theirs},
                            lambda i: "the run" if i < 0 else me, f"Start {me} with the run's settings to join it",
                            fixes)
        if self.opened is None and not self.finished:
            self.late()

    @property
    def joining(self) -> bool:
        """Whether this worker arrived at an elastic run under way (it takes a live member's state)."""
        return self.late is not None

    def take_state(self) -> None:
        """A worker that joined a run under way: receive the outer state from a live member and check its digest."""
        if self.membership is not None and self.joining:
            self.membership.joined()

    @property
    def is_reporting_rank(self) -> bool:
        """Whether this process writes the worker's files and logs (rank 0 of its worker)."""
        return self.ctx is None or self.ctx.rank_in_worker == 0

    def attach(self, config: OuterConfig, trainer: Any = None, steps: int = 0) -> None:
        """Give the elastic membership (if any) the schedule its changes follow, and the trainer it hands
        state to: round boundaries (``config``), the run's last step (0: unknown)."""
        if self.membership is not None:
            self.membership.attach(self.comm, trainer, config, steps)  # type: ignore[arg-type]

    def agree(self, mine: Mapping[str, Any], topic: str, fix: str, fixes: Sequence[tuple[str, str]] = ()) -> None:
        """Compare ``mine`` with every other worker's (:meth:`Meeting.agree`); nothing where there are none."""
        if self.meeting is not None:
            self.meeting.agree(mine, topic, self.timeout_s, fix, fixes)

    def release(self, cancel: bool) -> None:
        """Close the communicator (cancel: drop what is queued), the membership and the groups this took."""
        try:
            if self.owns_comm and self.opened is not None:
                self.opened.close(cancel=cancel)
        finally:
            if self.membership is not None:
                self.membership.teardown()
            if self.joined and self.ctx is not None:
                leave_outer_group(self.ctx)
            if self.owns_world and dist.is_initialized():
                dist.destroy_process_group()


#: What a worker joining a run under way must match, in the coordinator's store.
SETTINGS_KEY = "eagerloco/settings"


def outer_meeting(ctx: DistContext, where: str = "") -> Meeting | None:
    """The workers' meeting in the outer store (separate jobs) or the run's (one WORLD): their first ranks."""
    store = prefixed("eagerloco/", ctx.outer_store) if ctx.outer_store is not None else ctx.store
    if not ctx.is_outer_rank or store is None:
        return None
    return Meeting(store, ctx.worker, list(range(ctx.workers)), lambda w: f"worker {w}", where)


@api_errors
def connect(outer_addr: str | None = None, worker_id: int | None = None, workers: int | None = None, *,
            ranks_per_worker: int | None = None, link: LinkConfig | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, seed: int = 0, elastic: bool = False,
            init_sync: bool = True, device: torch.device | None = None) -> Connection:
    """Join the other workers: an outer rendezvous (the arguments, else EAGERLOCO_OUTER_ADDR / _WORKER_ID /
    _WORKERS: each worker its own job), else the torchrun WORLD of M workers x R ranks, else this worker alone.

    ``outer_addr`` is the coordinator's host:port (``eagerloco coordinator``); ``link`` an emulated slow link;
    ``timeout_s`` the seconds before a silent worker is declared dead; ``elastic`` lets the others go on when a
    worker dies (:mod:`eagerloco.comm.elastic`), and a worker that finds the run under way (one that died, started
    again; or a new ``worker_id`` beyond ``workers``) joins it in the loop it is given to, at a round boundary with
    a live worker's state (``outer.joined_at``); ``init_sync`` starts everyone from worker 0's parameters;
    ``device`` is where means are handed back. Raises ConfigError or PeerError.
    """
    from eagerloco.comm.inprocess import InProcessGroup
    from eagerloco.comm.worker import communicator_for

    env = Environment.read()
    if not outer_addr and env.outer_addr:  # the environment's rendezvous where the arguments give none
        outer_addr, worker_id, workers = env.outer_addr, env.worker_id, env.workers
    rdzv = OuterRendezvous.parse(outer_addr, worker_id, workers, grow=elastic) if outer_addr else None
    world = env.world_size or 1
    if elastic and rdzv is None:
        raise ConfigError("elastic=True needs each worker as its own job: pass outer_addr='host:port', worker_id "
                          "and workers (or EAGERLOCO_OUTER_ADDR, ...). In one torchrun WORLD use `eagerloco "
                          "launch --elastic -- <train args>`, whose trainer survives dead workers")
    if elastic and world > 1:
        raise ConfigError(f"elastic=True across jobs needs one process per job, but this job has WORLD_SIZE "
                          f"{world}: start each worker as one process, or drop elastic")
    if rdzv is not None:
        return Connection.outer(rdzv, link, timeout_s=timeout_s, seed=seed, elastic=elastic, init_sync=init_sync,
                                device=device)
    if world > 1 and env.rank is not None:  # one WORLD of M workers x R ranks
        r = ranks_per_worker or env.ranks_per_worker or 1
        owns_world = not dist.is_initialized()
        ctx = init_process_groups(workers or world // r, r, timeout_s=timeout_s)
        return Connection(communicator_for(ctx, link, seed=seed, timeout_s=timeout_s, device=device), ctx,
                          timeout_s=timeout_s, seed=seed, init_sync=init_sync, owns_world=owns_world,
                          meeting=outer_meeting(ctx))
    if workers not in (None, 1):
        raise ConfigError(f"workers={workers} needs the other workers: pass outer_addr='host:port' and "
                          "worker_id (each worker its own job), or start the workers with torchrun")
    return Connection(InProcessGroup(1, link, seed=seed).communicator(0), timeout_s=timeout_s, seed=seed,
                      init_sync=init_sync)
