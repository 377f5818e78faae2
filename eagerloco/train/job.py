"""One worker per job: ``eagerloco train --outer-addr HOST:PORT --worker-id I --workers M``.

Each worker is its own process meeting the others at the coordinator (:meth:`~eagerloco.comm.connect.Connection.outer`);
it trains on shard I, exactly as worker I elsewhere. Each job owns its run directory (metrics, this worker's
summary and checkpoints); ``--resume`` continues each job from its own newest checkpoint, and with
``--elastic`` a worker started against the run under way joins it (:mod:`eagerloco.comm.elastic`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from eagerloco import checkpoint as ckpt
from eagerloco.comm.connect import Connection
from eagerloco.comm.heartbeat import wait_for_evaluation
from eagerloco.comm.quorum_jobs import join_quorum
from eagerloco.comm.rendezvous import Meeting, OuterRendezvous, shapes_digest
from eagerloco.device import resolve_device
from eagerloco.train.agree import agreed_settings
from eagerloco.train.elastic import worker_steps
from eagerloco.train.outputs import add_throughput
from eagerloco.train.resume import own_last_state
from eagerloco.train.runtime import Found, Runtime, num_params
from eagerloco.train.worker import Worker


class JobRuntime(Runtime):
    """Worker ``worker_id`` of ``workers`` as a job of its own: it evaluates, reports and checkpoints itself."""

    checkpoint_kind = "distributed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rc = self.cfg.runtime
        self.rdzv = OuterRendezvous.parse(str(rc.outer_addr), rc.worker_id, self.cfg.workers, grow=rc.elastic)
        self.peers: Connection | None = None
        self.comm: Any = None
        self.membership: Any = None

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        from eagerloco.data import worker_streams

        cfg, me, timeout_s = self.cfg, self.rdzv.worker, self.cfg.runtime.dist_timeout
        device = resolve_device(cfg.device)
        model = base.to(device)
        # A worker beyond the run's first M (joining an elastic run) takes the last shard of M' = its id + 1.
        shards = max(cfg.workers, me + 1)
        stream = worker_streams(corpus, tok, shards, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
        link = self.checked_link(num_params(model))
        settings = {k: v for k, v in agreed_settings(cfg).items() if k != "--resume"}  # a joiner may resume
        settings["model parameters"] = shapes_digest(model.named_parameters())
        self.peers = Connection.outer(self.rdzv, link, timeout_s=timeout_s, seed=cfg.seed,
                                      elastic=cfg.runtime.elastic, device=device, settings=settings)
        self.comm, self.membership = self.peers.comm, self.peers.membership
        if cfg.outer.quorum is not None and cfg.outer.quorum < cfg.workers and self.peers.ctx is not None:
            join_quorum(self.comm, self.peers.ctx.outer_store, cfg.workers, timeout_s, self.membership)
        self.joining = self.peers.joining
        worker = Worker(model, self.comm, stream, cfg)
        self.peers.attach(cfg.outer, worker, steps=cfg.steps)
        return {me: worker}

    def close(self, error: BaseException | None) -> None:
        if self.peers is not None:  # a dead peer, a signal: drop what is queued, do not wait
            self.peers.release(cancel=error is not None)

    def agreement(self) -> Meeting | None:
        return self.peers.meeting if self.peers is not None else None  # a joiner's settings were checked

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        if not self.joining:
            return super().load(files, found)
        assert self.peers is not None and self.membership is not None
        own = own_last_state(ckpt.checkpoint_root(Path(self.cfg.out)), self.rdzv.worker)
        if own is not None:  # its own data position; everything else comes from a live member
            files[self.rdzv.worker].stream.load_state_dict(own["stream"])
        self.peers.take_state()
        step = self.membership.step
        assert self.peers.ctx is not None and self.peers.ctx.store is not None
        self.peers.ctx.store.set(f"evaluated/{step}/{self.rdzv.worker}", "1")  # the members evaluate at step
        self.comm.step_hint = step + 1
        return step, float(found[1].get("real_elapsed", 0.0)) if found is not None else 0.0

    def ready(self, start_step: int, found: Found | None) -> None:
        super().ready(start_step, None if self.joining else found)  # a joiner's state is a member's, not found's
        if not self.joining:  # a joiner arrives mid-run: the members are past the start barrier
            self.comm.barrier()  # every job has joined and resumed from the same step

    def on_step(self, step: int) -> None:
        if self.membership is not None:
            self.membership.on_step(step)

    def after_eval(self, step: int) -> None:
        # Every job evaluates its own outer model, for as long as that takes: the others wait for it
        # here, outside any collective timeout, for as long as its heartbeat is fresh. Under a quorum
        # nobody waits before the run's end: an evaluating worker is a late one, bypassed like any
        # (docs/algorithms.md, 12.10). Under --elastic a worker that died meanwhile is left to the change that follows.
        assert self.peers is not None and self.peers.ctx is not None
        if self.peers.ctx.store is not None:
            wait_for_evaluation(self.peers.ctx.store, step, self.rdzv.worker,
                                self.membership.members if self.membership is not None else range(self.cfg.workers),
                                self.cfg.runtime.dist_timeout, "evaluating", survive=self.membership is not None,
                                wait=not (self.comm.closes_on_quorum and step < self.cfg.steps))

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"runtime": "distributed", "ranks_per_worker": 1, "separate_jobs": True, "worker": self.rdzv.worker}

    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        self.comm.barrier()  # the loop drained: every job is done with the link
        if self.membership is not None:
            self.membership.finish()
        members = self.membership.members if self.membership is not None else list(range(self.cfg.workers))
        summary.update(runtime="job", worker=self.rdzv.worker, members=members)
        if self.membership is not None and files[self.rdzv.worker].sync.adaptive is None:
            # The members' inner steps, not steps x --workers: the run's membership changes say who trained when.
            cfg = self.cfg
            done = worker_steps(self.membership.events(), cfg.workers, 0, cfg.steps)
            summary.update(worker_steps=done, tokens=done * cfg.batch_size * cfg.seq_len)
            add_throughput(summary, self.devices)
        return summary


__all__ = ["JobRuntime"]
