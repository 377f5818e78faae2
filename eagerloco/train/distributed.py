"""The multi-process runtime: one process per rank, R ranks per worker, M workers (``eagerloco launch`` or
torchrun). Only the transport differs from the trainer's; a dead worker stops the run, the others naming it
(with ``--elastic``: :mod:`eagerloco.train.elastic`).
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagerloco.comm.errors import describe_exception, is_transport_failure
from eagerloco.comm.groups import set_worker_threads, shutdown
from eagerloco.comm.heartbeat import Heartbeat, blame_ranks, wait_for_evaluation
from eagerloco.comm.rendezvous import Meeting, init_process_groups
from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError
from eagerloco.device import DeviceError, resolve_device
from eagerloco.fragments import find_blocks
from eagerloco.fsdp import shard_model
from eagerloco.signals import launcher_stopping, stopped_by
from eagerloco.train.outputs import add_throughput, aggregate, per_worker
from eagerloco.train.resume import check_resume_layout, has_worker
from eagerloco.train.rundir import guard_run_dir
from eagerloco.train.runtime import Found, Runtime, device_count, num_params
from eagerloco.train.worker import Worker


class DistributedRuntime(Runtime):
    """This rank's share of a run of M workers x R ranks on torch.distributed.

    Rank 0 reports and evaluates (under FSDP every rank of worker 0). A checkpoint's manifest entries reach rank 0
    by all-gather and its verdict is broadcast, so a rank that cannot write stops every rank with the same message.
    """

    checkpoint_kind = "distributed"

    def __enter__(self) -> DistributedRuntime:
        rc = self.cfg.runtime
        if rc.outer_backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("--outer-backend nccl needs CUDA, which is not available here; use --outer-backend gloo")
        set_worker_threads()
        self.comm: Any = None
        self.gate: Any = None
        self.beat: Heartbeat | None = None
        self.lock = guard_run_dir(self.cfg, reporting=self.env.rank == 0)
        try:
            self.ctx = init_process_groups(self.cfg.workers, rc.ranks_per_worker, rc.backend, rc.dist_timeout,
                                           outer_backend=rc.outer_backend, sharded_outer=rc.fsdp)
            # Every rank's heartbeat (rank/hb/<rank>): a collective of the main thread that fails (a
            # checkpoint, the inner group) names the rank that died or froze, not only the worker.
            self.gate = self.ctx.store
            if self.gate is not None:
                self.beat = Heartbeat(dist.PrefixStore("rank", self.gate), self.ctx.rank)
        except BaseException:
            shutdown()
            if self.lock is not None:
                self.lock.release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        blame: BaseException | None = None
        if exc is not None and self.gate is not None and is_transport_failure(exc):
            self.close(exc)  # drop what is queued first, then name the rank responsible
            ctx = self.ctx
            signum = launcher_stopping(self.gate)  # a rank that stopped on the launcher's signal first
            blame = (stopped_by(signum) if signum is not None else
                     blame_ranks(self.gate, ctx.rank, ctx.world_size, self.cfg.runtime.ranks_per_worker,
                                 f"{self.doing} ({describe_exception(exc)})"))
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            if self.beat is not None:
                self.beat.stop("closed")
            shutdown()
        if blame is not None:
            raise blame from exc

    def close(self, error: BaseException | None) -> None:
        if self.comm is not None:  # a dead peer, a signal: drop what is queued, do not wait
            self.comm.close(cancel=error is not None)

    def resume_point(self) -> Found | None:
        found = super().resume_point()
        if found is not None:
            check_resume_layout(found[1], self.cfg.runtime.ranks_per_worker, self.cfg.runtime.fsdp)
        return found

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        from eagerloco.data import worker_streams

        cfg, ctx, rc = self.cfg, self.ctx, self.cfg.runtime
        device = run_device(cfg.device, ctx)
        model = base.to(device)
        if rc.fsdp:
            shard_model(model, find_blocks(model), ctx.inner_group, ctx.device)
        # One shard per rank; with one rank per worker these are exactly the in-process workers' shards.
        stream = worker_streams(corpus, tok, cfg.workers * rc.ranks_per_worker, cfg.batch_size, cfg.seq_len,
                                cfg.seed, iid=cfg.iid)[ctx.rank]
        link = self.checked_link(num_params(model))
        self.comm = communicator_for(ctx, link, seed=cfg.seed, timeout_s=rc.dist_timeout, device=device)
        self.devices = device_count(device, ctx.world_size)
        self.device = device
        # FSDP averages the gradients inside the worker itself (reduce-scatter).
        worker = Worker(model, self.comm, stream, cfg, inner_group=None if rc.fsdp else ctx.inner_group)
        return {ctx.rank: worker}

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        if found is None:
            return 0, 0.0
        path, meta = found
        if "members" in meta and not has_worker(meta, self.ctx.rank):
            raise ConfigError(
                f"--resume: {path} was made by an elastic run while worker {self.ctx.rank} was out of the group "
                f"(members {meta['members']}); resume with --elastic, which gives it a live worker's state"
            )
        return super().load(files, found)

    def agreement(self) -> Meeting | None:
        if self.gate is None:  # no store to meet in (torchrun without MASTER_ADDR): nothing to compare through
            return None
        ctx, r = self.ctx, self.ctx.ranks_per_worker
        return Meeting(self.gate, ctx.rank, list(range(ctx.world_size)),
                       lambda g: f"worker {g}" if r == 1 else f"global rank {g} (worker {g // r})",
                       f"{self.env.master_addr}:{self.env.master_port}")

    def ready(self, start_step: int, found: Found | None) -> None:
        super().ready(start_step, found)
        self.comm.barrier()

    def reports(self) -> bool:
        return self.ctx.rank == 0

    def evaluates(self) -> bool:
        return self.ctx.worker == 0 if self.cfg.runtime.fsdp else self.ctx.rank == 0

    def after_eval(self, step: int) -> None:
        # Rank 0 evaluates alone, for as long as it takes: the others wait here, outside any
        # collective timeout, for as long as its heartbeat says it is alive.
        if self.gate is not None:
            wait_for_evaluation(self.gate, step, self.ctx.rank, [0], self.cfg.runtime.dist_timeout,
                                "global rank 0, which evaluates")

    def gather_checkpoint(self, step: int, entries: dict[int, Any], problem: str | None
                          ) -> tuple[dict[int, Any] | None, str | None]:
        mine: Any = {"error": problem} if problem is not None else entries[self.ctx.rank]
        every: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine)
        problem = next((e["error"] for e in every if "error" in e), None)
        if self.ctx.rank != 0:
            return None, problem
        return dict(enumerate(every)), problem

    def checkpoint_meta(self) -> dict[str, Any]:
        rc = self.cfg.runtime
        return {"runtime": "distributed", "ranks_per_worker": rc.ranks_per_worker, "fsdp": rc.fsdp}

    def share_verdict(self, problem: str | None) -> None:
        verdict: list[Any] = [problem]
        dist.broadcast_object_list(verdict, src=0)
        super().share_verdict(verdict[0])

    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        ctx, rc = self.ctx, self.cfg.runtime
        self.comm.barrier()
        # Link accounting comes from the ranks that use the link: each worker's first, or (sharded) all.
        mine = {"outer": ctx.is_outer_rank, "worker": ctx.worker, "stats": self.comm.stats.as_dict(),
                "wall": summary["real_wall_s"], "device": f"{socket.gethostname()}/{self.device}"}
        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        if ctx.rank != 0:
            return None
        aggregate(summary, per_worker([e for e in every if e["outer"]]))
        add_throughput(summary, len({e["device"] for e in every}))
        summary.update(runtime="distributed", ranks_per_worker=rc.ranks_per_worker, fsdp=rc.fsdp,
                       backend=ctx.backend, outer_backend=rc.outer_backend)
        return summary


def run_device(device: str, ctx: Any) -> torch.device:
    """This rank's device: the inner group's GPU under NCCL, else what --device says (auto: the local
    rank's GPU when there is one)."""
    if ctx.device.type == "cuda":
        if device == "cpu":
            raise ConfigError("--device cpu with the nccl inner backend: pass --backend gloo to train on the CPU")
        return ctx.device
    try:
        return resolve_device(device, ctx.local_rank)
    except DeviceError as e:
        raise ConfigError(str(e)) from None
