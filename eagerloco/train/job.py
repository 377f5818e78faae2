"""One worker per process, meeting the others at a store no worker hosts (:meth:`Connection.outer
<eagerloco.comm.connect.Connection.outer>`).

:class:`JobRuntime` is ``eagerloco train --outer-addr HOST:PORT --worker-id I --workers M``: each worker a job of
its own at the coordinator, training on shard I exactly as worker I elsewhere. Each job owns its run directory
(metrics, this worker's summary and checkpoints); ``--resume`` continues each job from its own newest checkpoint,
and with ``--elastic`` a worker started against the run under way joins it (:mod:`eagerloco.comm.elastic`). The
runtime of ``eagerloco launch --elastic`` is the same at the launcher's store, with one run directory its leader
reports in (:mod:`eagerloco.train.elastic`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagerloco import checkpoint as ckpt
from eagerloco.comm.connect import Connection
from eagerloco.comm.heartbeat import wait_for_evaluation
from eagerloco.comm.quorum_jobs import QuorumJobs
from eagerloco.comm.rendezvous import Meeting, OuterRendezvous, shapes_digest
from eagerloco.device import resolve_device
from eagerloco.train.agree import agreed_settings
from eagerloco.train.outputs import add_throughput
from eagerloco.train.resume import own_last_state
from eagerloco.train.runtime import Found, Runtime, num_params
from eagerloco.train.worker import Worker


def lost_steps(events: list[dict[str, Any]]) -> int:
    """Inner steps that lost workers computed after their last exchange that reached the model."""
    return sum(max(0, int(seen) - int(ev.get("last_included_step") or 0)) for ev in events
               if ev.get("event") == "left" for seen in ev.get("last_seen_step", {}).values() if seen is not None)


def worker_steps(events: list[dict[str, Any]], workers: int, start: int, steps: int) -> int:
    """Inner steps done by members, summed over workers (M x steps without failures)."""
    total, count, at = 0, workers, start
    for ev in sorted(events, key=lambda e: (e["step"], e["time"])):
        total += count * max(0, ev["step"] - at)
        at = max(at, ev["step"])
        count = len(ev["members"])
    return total + count * max(0, steps - at)


class JobRuntime(Runtime):
    """Worker ``worker_id`` of ``workers`` as a job of its own: it evaluates, reports and checkpoints itself."""

    checkpoint_kind = "distributed"
    #: What an evaluating worker is doing, in the error naming one that died meanwhile.
    evaluating = "evaluating"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rdzv = self.rendezvous()
        self.root = ckpt.checkpoint_root(Path(self.cfg.out))
        self.peers: Connection | None = None
        self.comm: Any = None
        self.membership: Any = None
        self.joining = False
        self.own: dict[str, Any] | None = None  # a returning worker's own state, for its data position

    def rendezvous(self) -> OuterRendezvous:
        """Where this worker meets the others: the coordinator at ``--outer-addr``."""
        rc = self.cfg.runtime
        return OuterRendezvous.parse(str(rc.outer_addr), rc.worker_id, self.cfg.workers, grow=rc.elastic)

    def device(self) -> torch.device:
        return resolve_device(self.cfg.device)

    def resume_point(self) -> Found | None:
        """As every runtime's, but under --elastic a job whose worker died before its first checkpoint comes back with
        the same command and --resume: it takes the run's state from a live member and reads its shard afresh."""
        rc = self.cfg.runtime
        if self.cfg.resume and rc.elastic and rc.outer_addr and not ckpt.list_checkpoints(self.root):
            print(f"eagerloco: --resume: no checkpoint under {self.root} yet: worker {self.rdzv.worker} starts "
                  "afresh (joining a run under way, it takes the run's state from a live member)", flush=True)
            return None
        return super().resume_point()

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        from eagerloco.data import worker_streams

        cfg, me, timeout_s = self.cfg, self.rdzv.worker, self.cfg.runtime.dist_timeout
        device = self.device()
        model = base.to(device)
        # A worker beyond the run's first M (joining an elastic run) takes the last shard of M' = its id + 1.
        shards = max(cfg.workers, me + 1)
        stream = worker_streams(corpus, tok, shards, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
        # A worker the launcher restarts keeps its own data position (its newest checkpoint's); read before it asks
        # to join, so that the members do not wait on it during the handover.
        self.own = own_last_state(self.root, me) if cfg.runtime.rejoin else None
        link = self.checked_link(num_params(model))
        settings = {k: v for k, v in agreed_settings(cfg).items() if k != "--resume"}  # a joiner may resume
        settings["model parameters"] = shapes_digest(model.named_parameters())
        self.peers = Connection.outer(self.rdzv, link, timeout_s=timeout_s, seed=cfg.seed,
                                      elastic=cfg.runtime.elastic, device=device, settings=settings)
        if self.peers.finished:
            print(f"eagerloco: {self.peers.finished}", flush=True)
            return {}
        self.comm, self.membership = self.peers.comm, self.peers.membership
        if cfg.outer.quorum is not None and cfg.outer.quorum < cfg.workers and self.peers.ctx is not None:
            # Its outer exchanges close on a quorum at the coordinator; under --elastic over the membership's members.
            self.comm.quorum_jobs = QuorumJobs(self.comm, self.peers.ctx.outer_store, cfg.workers, timeout_s,
                                               self.membership)
            self.comm.closes_on_quorum = True
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
        own = self.own if self.cfg.runtime.rejoin else own_last_state(self.root, self.rdzv.worker)
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
            self.comm.barrier()  # every worker has joined and resumed from the same step

    def on_step(self, step: int) -> None:
        if self.membership is not None:
            self.membership.on_step(step)

    def evaluators(self) -> list[int]:
        """The workers that evaluate (every one, each its own outer model)."""
        return list(self.membership.members) if self.membership is not None else list(range(self.cfg.workers))

    def after_eval(self, step: int) -> None:
        # The evaluators take as long as that takes: the others wait for them here, outside any collective
        # timeout, for as long as their heartbeat is fresh. Under a quorum nobody waits before the run's end: an
        # evaluating worker is a late one, bypassed like any (docs/algorithms.md, 12.10). Under --elastic a worker
        # that died meanwhile is left to the change that follows.
        assert self.peers is not None and self.peers.ctx is not None
        if self.peers.ctx.store is not None:
            wait_for_evaluation(self.peers.ctx.store, step, self.rdzv.worker, self.evaluators(),
                                self.cfg.runtime.dist_timeout, self.evaluating, survive=self.membership is not None,
                                wait=not (self.comm.closes_on_quorum and step < self.cfg.steps))

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"runtime": "distributed", "ranks_per_worker": 1, "separate_jobs": True, "worker": self.rdzv.worker}

    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        self.comm.barrier()  # the loop drained: every job is done with the link
        if self.membership is not None:
            self.membership.finish()
        summary.update(runtime="job", worker=self.rdzv.worker, members=self.evaluators())
        if self.membership is not None and files[self.rdzv.worker].sync.adaptive is None:
            # The members' inner steps, not steps x --workers: the run's membership changes say who trained when.
            cfg = self.cfg
            done = worker_steps(self.membership.events(), cfg.workers, 0, cfg.steps)
            summary.update(worker_steps=done, tokens=done * cfg.batch_size * cfg.seq_len)
            add_throughput(summary, self.devices)
        return summary
