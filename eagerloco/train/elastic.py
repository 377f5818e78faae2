"""The elastic multi-process runtime (``eagerloco launch --elastic``, one rank per worker): survive deaths, admit
returns (:mod:`eagerloco.comm.elastic`). A job runtime at the launcher's store, with one run directory: the leader
(lowest live worker id) does what rank 0 does otherwise."""

from __future__ import annotations

import json
from typing import Any

import torch

from eagerloco import checkpoint as ckpt
from eagerloco.comm.elastic import outer_digest
from eagerloco.comm.groups import set_worker_threads
from eagerloco.comm.rendezvous import OuterRendezvous
from eagerloco.config import ConfigError
from eagerloco.train.job import JobRuntime, lost_steps, worker_steps
from eagerloco.train.outputs import add_throughput, aggregate
from eagerloco.train.resume import has_worker, own_last_state
from eagerloco.train.rundir import guard_run_dir
from eagerloco.train.runtime import Found
from eagerloco.train.worker import Worker


class ElasticRuntime(JobRuntime):
    """One worker of an elastic run; the leader evaluates and reports, and checkpoint files reach it through the
    store (a worker that died while saving is left out of the manifest)."""

    evaluating = "the leader, evaluating"

    def rendezvous(self) -> OuterRendezvous:
        """The launcher's store (MASTER_ADDR:MASTER_PORT), where this process is worker RANK."""
        env, workers = self.env, self.cfg.workers
        if env.rank is None or not 0 <= env.rank < workers:
            raise ConfigError(f"RANK must be a worker id in 0..{workers - 1} for --elastic, got {env.rank}")
        if not env.master_addr or env.master_port is None:
            raise ConfigError("MASTER_ADDR and MASTER_PORT (the launcher's store) are not set; start the run with "
                              "`eagerloco launch` or torchrun")
        return OuterRendezvous(env.master_addr, env.master_port, env.rank, workers, single=True)

    def __enter__(self) -> ElasticRuntime:
        set_worker_threads()
        self.lock = None if self.cfg.runtime.rejoin else guard_run_dir(self.cfg, reporting=self.rdzv.worker == 0)
        return self

    def device(self) -> torch.device:
        return torch.device("cpu")  # its groups are gloo's, re-formed on the CPU

    def resume_point(self) -> Found | None:
        return None if self.cfg.runtime.rejoin else super().resume_point()

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        me, membership = self.rdzv.worker, self.membership
        if self.joining or found is None:
            start_step, real_elapsed = super().load(files, found)
        else:
            path, meta = found
            if has_worker(meta, me):
                files[me].load_state_dict(ckpt.load_worker_state(path, me))
            elif (own := own_last_state(self.root, me)) is not None:
                files[me].stream.load_state_dict(own["stream"])  # its data position when it was last saved
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            # Every member read the same checkpoint (the run's one directory, the step they agreed on).
            lacking = [w for w in membership.members if not has_worker(meta, w)]
            if lacking:  # out of the group when the checkpoint was made: take a member's state
                membership.handover(min(w for w in membership.members if has_worker(meta, w)), lacking)
        membership.step = self.start_step = start_step
        self.comm.step_hint = start_step + 1
        return start_step, real_elapsed

    def reports(self) -> bool:
        return self.membership.is_leader()

    evaluates = reports

    def evaluators(self) -> list[int]:
        """The leader evaluates alone; a leader that dies meanwhile is left to the membership change that follows
        (the next exchange fails without it)."""
        return [self.membership.leader]

    def log_fields(self) -> dict[str, Any]:
        return {"members": len(self.membership.members)}

    def gather_checkpoint(self, step: int, entries: dict[int, Any], problem: str | None
                          ) -> tuple[dict[int, Any] | None, str | None]:
        if problem is not None:
            raise ckpt.CheckpointError(problem)
        membership = self.membership
        membership.kv.set(f"ckpt/{step}/{self.rdzv.worker}", json.dumps(entries[self.rdzv.worker]))
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
        cfg, membership, me = self.cfg, self.membership, self.rdzv.worker
        membership.finish()
        params = files[me].sync.outer_parameters()
        mine = {"outer": True, "worker": me, "stats": self.comm.stats.as_dict(), "wall": summary["real_wall_s"],
                "sha256": outer_digest(params), "finite": all(bool(torch.isfinite(p).all()) for p in params),
                "recovery_s": membership.recovery_s}
        membership.kv.set(f"final/{me}", json.dumps(mine))
        if not membership.is_leader():
            return None
        every = list(membership.collect("final").values())
        aggregate(summary, every)
        add_throughput(summary)
        events = membership.events()
        adaptive = files[me].sync.adaptive  # its workers' steps differ: counted while each was present
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
