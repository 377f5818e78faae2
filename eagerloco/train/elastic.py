"""The elastic multi-process runtime (``--elastic``, one rank per worker): survive deaths, admit returns
(:mod:`eagerloco.comm.elastic`). The leader (lowest live worker id) does what rank 0 does otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagerloco import checkpoint as ckpt
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.elastic import Membership, outer_digest
from eagerloco.comm.groups import heartbeat_store, set_worker_threads, store_client
from eagerloco.comm.heartbeat import wait_for_evaluation
from eagerloco.comm.rendezvous import Meeting
from eagerloco.config import ConfigError
from eagerloco.train.outputs import add_throughput, aggregate
from eagerloco.train.resume import has_worker, own_last_state
from eagerloco.train.rundir import guard_run_dir
from eagerloco.train.runtime import Found, Runtime, num_params
from eagerloco.train.worker import Worker


def lost_steps(events: list[dict[str, Any]]) -> int:
    """Inner steps that lost workers computed after their last exchange that reached the model."""
    lost = 0
    for ev in events:
        if ev.get("event") != "left":
            continue
        for seen in ev.get("last_seen_step", {}).values():
            if seen is not None:
                lost += max(0, int(seen) - int(ev.get("last_included_step") or 0))
    return lost


def worker_steps(events: list[dict[str, Any]], workers: int, start: int, steps: int) -> int:
    """Inner steps done by members, summed over workers (M x steps without failures)."""
    total, count, at = 0, workers, start
    for ev in sorted(events, key=lambda e: (e["step"], e["time"])):
        total += count * max(0, ev["step"] - at)
        at = max(at, ev["step"])
        count = len(ev["members"])
    return total + count * max(0, steps - at)


class ElasticRuntime(Runtime):
    """One worker of an elastic run; the leader evaluates and reports, and checkpoint files reach it through the
    store (a worker that died while saving is left out of the manifest)."""

    checkpoint_kind = "distributed"

    def __enter__(self) -> ElasticRuntime:
        me, rc = self.env.rank, self.cfg.runtime
        if me is None or not 0 <= me < self.cfg.workers:
            raise ConfigError(f"RANK must be a worker id in 0..{self.cfg.workers - 1} for --elastic, got {me}")
        set_worker_threads()
        self.me, self.joining = me, rc.rejoin
        self.comm: Any = None
        self.membership: Any = None
        self.lock = None if self.joining else guard_run_dir(self.cfg, reporting=me == 0)
        try:
            self.client = store_client(min(rc.dist_timeout, 60.0))
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise
        self.root = ckpt.checkpoint_root(Path(self.cfg.out))
        return self

    def close(self, error: BaseException | None) -> None:
        try:
            if self.comm is not None:  # a dead peer, a signal (RunStopped, Ctrl-C): drop what is queued
                self.comm.close(cancel=error is not None)
        finally:
            if self.membership is not None:
                self.membership.teardown()

    def resume_point(self) -> Found | None:
        return None if self.joining else super().resume_point()

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        from eagerloco.data import worker_streams

        cfg, me, timeout_s = self.cfg, self.me, self.cfg.runtime.dist_timeout
        stream = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
        # A returning worker keeps its own data position (its newest checkpoint's); read it before asking
        # to join, so that the members do not wait on it during the handover.
        self.own = own_last_state(self.root, me) if self.joining else None
        if self.joining:
            self.membership = Membership.join(self.client, me, cfg.workers, timeout_s)
            if self.membership is None:
                print(f"eagerloco: worker {me}: the run finished before this worker could rejoin", flush=True)
                return {}
            outer = self.membership.group
        else:  # epoch 0: a gloo group over the launcher's store, as every later epoch's (no WORLD)
            self.membership = Membership(self.client, me, cfg.workers, timeout_s)
            outer = self.membership.form(0, list(range(cfg.workers)))
        link = self.checked_link(num_params(base))
        self.comm = TorchDistCommunicator(outer, link, timeout_s, store=heartbeat_store(timeout_s), seed=cfg.seed,
                                          elastic=True, members=self.membership.members)
        # From here the communicator holds the group alone: a membership change must free it.
        worker = Worker(base, self.comm, stream, cfg)
        self.membership.attach(self.comm, worker, cfg.outer, cfg.steps)
        self.gate = heartbeat_store(timeout_s)
        return {me: worker}

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        me, worker, membership = self.me, files[self.me], self.membership
        start_step, real_elapsed = membership.step, 0.0
        if self.joining:
            if self.own is not None:  # its own data position; everything else comes from a live peer
                worker.stream.load_state_dict(self.own["stream"])
            membership.joined()
        elif found is not None:
            path, meta = found
            have = has_worker(meta, me)
            if have:
                worker.load_state_dict(ckpt.load_worker_state(path, me))
            elif (own := own_last_state(self.root, me)) is not None:
                worker.stream.load_state_dict(own["stream"])  # its data position when it was last saved
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            membership.kv.set(f"resumed/{me}", json.dumps(have))
            flags = membership.collect("resumed")
            lacking = [w for w, h in flags.items() if not h]
            if lacking:  # out of the group when the checkpoint was made: take a member's state
                membership.handover(min(w for w, h in flags.items() if h), lacking)
        membership.step = self.start_step = start_step
        self.comm.step_hint = start_step + 1
        return start_step, real_elapsed

    def agreement(self) -> Meeting | None:
        if self.joining:  # a returning worker takes a live worker's state; the members agreed at the start
            return None
        return Meeting(dist.PrefixStore("eagerloco/", self.client), self.me, list(range(self.cfg.workers)),
                       lambda w: f"worker {w}", f"{self.env.master_addr}:{self.env.master_port}")

    def ready(self, start_step: int, found: Found | None) -> None:
        super().ready(start_step, found)
        if not self.joining:  # a joiner arrives mid-run: the members are past the start barrier
            self.comm.barrier()

    def reports(self) -> bool:
        return self.membership.is_leader()

    def evaluates(self) -> bool:
        return self.membership.is_leader()

    def on_step(self, step: int) -> None:
        self.membership.on_step(step)

    def after_eval(self, step: int) -> None:
        # The leader evaluates alone, for as long as it takes: the others wait here, outside any
        # collective timeout, while its heartbeat is fresh. A leader that dies meanwhile is left
        # to the membership change that follows (the next exchange fails without it).
        if self.gate is not None:
            wait_for_evaluation(self.gate, step, self.me, [self.membership.leader], self.cfg.runtime.dist_timeout,
                                "the leader, evaluating", survive=True)

    def log_fields(self) -> dict[str, Any]:
        return {"members": len(self.membership.members)}

    def gather_checkpoint(self, step: int, entries: dict[int, Any], problem: str | None
                          ) -> tuple[dict[int, Any] | None, str | None]:
        if problem is not None:
            raise ckpt.CheckpointError(problem)
        membership = self.membership
        membership.kv.set(f"ckpt/{step}/{self.me}", json.dumps(entries[self.me]))
        if not membership.is_leader():
            return None, None  # the leader publishes once every member's file is written
        every = membership.collect(f"ckpt/{step}")
        listed = {e["file"] for e in every.values()}
        for f in ckpt.staging_dir(self.root, step).glob("worker_*.pt"):  # a worker that died while saving
            if f.name not in listed:
                f.unlink()
        self.saved_members = sorted(every)
        return every, None

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"runtime": "distributed", "ranks_per_worker": 1, "members": self.saved_members,
                "epoch": self.membership.epoch}

    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        cfg, membership, worker = self.cfg, self.membership, files[self.me]
        membership.finish()
        params = worker.sync.outer_parameters()
        mine = {"outer": True, "worker": self.me, "stats": self.comm.stats.as_dict(), "wall": summary["real_wall_s"],
                "sha256": outer_digest(params), "finite": all(bool(torch.isfinite(p).all()) for p in params),
                "recovery_s": membership.recovery_s}
        membership.kv.set(f"final/{self.me}", json.dumps(mine))
        if not membership.is_leader():
            return None
        every = list(membership.collect("final").values())
        aggregate(summary, every)
        add_throughput(summary)
        events = membership.events()
        adaptive = worker.sync.adaptive  # its workers' steps differ: counted while each was present
        done_steps = (worker_steps(events, cfg.workers, self.start_step, cfg.steps) if adaptive is None
                      else sum(adaptive.trained))
        summary.update(
            runtime="distributed", ranks_per_worker=1, backend="gloo", elastic=True,
            members=membership.members, epoch=membership.epoch, faults=events,
            lost_inner_steps=lost_steps(events), worker_steps=done_steps,
            tokens=done_steps * cfg.batch_size * cfg.seq_len,
            recovery_s=max(e["recovery_s"] for e in every),
            final_outer={str(e["worker"]): {"sha256": e["sha256"], "finite": e["finite"]} for e in every},
        )
        return summary


__all__ = ["ElasticRuntime", "lost_steps", "worker_steps"]
