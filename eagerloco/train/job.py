"""One worker per job: ``eagerloco train --outer-addr HOST:PORT --worker-id I --workers M``.

Each worker is its own process, started on its own (by hand, a scheduler, another machine), as the
hook API's workers are: the jobs meet through the outer rendezvous worker 0 hosts
(:meth:`~eagerloco.comm.connect.Connection.outer`) and exchange on a gloo group of their own. The
loop, algorithm and accounting are the trainer's; the worker trains on shard I of the data, exactly
the shard worker I has in-process or under ``eagerloco launch``, so the numbers are those of the
other runtimes' worker I.

Each job owns its run directory (``--out``; give each job its own when they share a disk): its
metrics, its summary (this worker's link accounting), its evaluations and its checkpoints, which
hold this worker's state only; ``--resume`` continues each job from its own newest checkpoint
(resume every job, from checkpoints of the same step). With ``--elastic`` the survivors of a dead
worker go on (:mod:`eagerloco.comm.elastic_jobs`; worker 0 must stay).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from eagerloco.comm.connect import Connection
from eagerloco.comm.errors import PeerError
from eagerloco.comm.heartbeat import wait_for_key
from eagerloco.comm.rendezvous import Meeting, OuterRendezvous
from eagerloco.device import resolve_device
from eagerloco.train.runtime import Found, Runtime, num_params
from eagerloco.train.worker import Worker


class JobRuntime(Runtime):
    """Worker ``worker_id`` of ``workers`` as a job of its own: it evaluates, reports and checkpoints itself."""

    checkpoint_kind = "distributed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rc = self.cfg.runtime
        self.rdzv = OuterRendezvous.parse(str(rc.outer_addr), rc.worker_id, self.cfg.workers)
        self.peers: Connection | None = None
        self.comm: Any = None
        self.membership: Any = None

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        from eagerloco.data import worker_streams

        cfg, me, timeout_s = self.cfg, self.rdzv.worker, self.cfg.runtime.dist_timeout
        device = resolve_device(cfg.device)
        model = base.to(device)
        stream = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
        link = self.checked_link(num_params(model))
        self.peers = Connection.outer(self.rdzv, link, timeout_s=timeout_s, seed=cfg.seed,
                                      elastic=cfg.runtime.elastic, device=device)
        self.comm, self.membership = self.peers.comm, self.peers.membership
        worker = Worker(model, self.comm, stream, cfg)
        self.peers.attach(cfg.outer, worker, steps=cfg.steps)
        return {me: worker}

    def close(self, error: BaseException | None) -> None:
        if self.peers is not None:  # a dead peer, a signal: drop what is queued, do not wait
            self.peers.release(cancel=error is not None)

    def agreement(self) -> Meeting | None:
        return self.peers.meeting if self.peers is not None else None

    def ready(self, start_step: int, found: Found | None) -> None:
        super().ready(start_step, found)
        self.comm.barrier()  # every job has joined and resumed from the same step

    def on_step(self, step: int) -> None:
        if self.membership is not None:
            self.membership.on_step(step)

    def after_eval(self, step: int) -> None:
        # Every job evaluates its own outer model, for as long as that takes: the others wait for it
        # here, outside any collective timeout, for as long as its heartbeat is fresh.
        assert self.peers is not None and self.peers.ctx is not None
        store, me = self.peers.ctx.store, self.rdzv.worker
        if store is None:
            return
        store.set(f"evaluated/{step}/{me}", "1")
        members = self.membership.members if self.membership is not None else range(self.cfg.workers)
        for w in members:
            if w == me:
                continue
            try:
                wait_for_key(store, f"evaluated/{step}/{w}", w, f"worker {w} (evaluating)",
                             self.cfg.runtime.dist_timeout)
            except PeerError:
                if self.membership is None:
                    raise
                # elastic: a worker that died meanwhile is left to the membership change that follows

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"runtime": "distributed", "ranks_per_worker": 1, "separate_jobs": True, "worker": self.rdzv.worker}

    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        self.comm.barrier()  # the loop drained: every job is done with the link before worker 0's store goes
        members = self.membership.members if self.membership is not None else list(range(self.cfg.workers))
        summary.update(runtime="job", worker=self.rdzv.worker, members=members)
        return summary


__all__ = ["JobRuntime"]
