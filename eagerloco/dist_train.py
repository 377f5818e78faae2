"""Training on torch.distributed: one process per rank, R ranks per worker, M workers.

Started by ``eagerloco launch`` or torchrun; ``eagerloco train`` comes here when RANK and
WORLD_SIZE are set. The loop, algorithm and accounting are those of :mod:`eagerloco.train`; only
the transport differs (:class:`~eagerloco.comm.distributed.TorchDistCommunicator` with a real
background exchange and an emulated link), plus the inner data-parallel group of each worker.

Without ``--elastic`` a dead worker stops the run: the others raise PeerError naming it and exit
non-zero, and the last checkpoint (published only once every rank's file is written) stays the
one to resume from. With ``--elastic`` (one rank per worker) the survivors go on and a returning
worker is admitted: see :mod:`eagerloco.comm.elastic`. Then the leader (lowest live worker id)
does what rank 0 does otherwise: evaluation, metrics, checkpoint manifest, summary.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from eagerloco import checkpoint as ckpt
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.elastic import Membership, outer_digest
from eagerloco.comm.errors import PeerError
from eagerloco.comm.groups import (
    env_int,
    heartbeat_store,
    init_process_groups,
    set_worker_threads,
    shutdown,
    store_client,
    workers_from_env,
)
from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError, LinkConfig
from eagerloco.faults import kill_hook, kill_self, rejoining
from eagerloco.fragments import find_blocks
from eagerloco.fsdp import shard_model
from eagerloco.netshape import kernel_link_from_env
from eagerloco.train import (
    TrainConfig,
    Worker,
    finite_json,
    prepare,
    resume_checkpoint,
    run_training,
    task_evals,
    tensorboard_writer,
    write_json_atomic,
)


def train_distributed(
    cfg: TrainConfig, ranks_per_worker: int = 1, backend: str | None = None, timeout_s: float = 300.0,
    fsdp: bool = False,
) -> dict[str, Any] | None:
    """Run this rank's share of a multi-process run; rank 0 returns the summary, others None.

    fsdp: shard each worker's model over its ranks (:mod:`eagerloco.fsdp`) instead of replicating
    it, and have every rank exchange its own shard with the other workers.
    """
    from eagerloco.data import worker_streams

    cfg.validate()
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ConfigError(f"--dist-timeout must be a positive, finite number of seconds, got {timeout_s!r}")
    env = workers_from_env()
    if env is not None and env != (cfg.workers, ranks_per_worker):
        raise ConfigError(
            f"the launcher started {env[0]} workers x {env[1]} ranks, but --workers {cfg.workers} and "
            f"--ranks-per-worker {ranks_per_worker} were passed to train; pass the same numbers to both"
        )
    if fsdp and ranks_per_worker < 2:
        raise ConfigError(
            f"--fsdp shards each worker's model over its ranks, but there is {ranks_per_worker} rank per worker: "
            "pass --ranks-per-worker 2 or more (to the launcher and to train), or drop --fsdp"
        )
    if cfg.elastic:
        if ranks_per_worker != 1:
            raise ConfigError(
                "--elastic supports one rank per worker (--ranks-per-worker 1): a worker of several ranks "
                "would need its inner group re-formed as well"
            )
        if backend == "nccl":
            raise ConfigError("--elastic re-forms gloo groups on the CPU; drop --backend nccl")
        set_worker_threads()
        return _train_elastic(cfg, timeout_s)
    set_worker_threads()
    ctx = init_process_groups(cfg.workers, ranks_per_worker, backend, timeout_s, sharded_outer=fsdp)
    comm = None
    try:
        out = Path(cfg.out)
        root = ckpt.checkpoint_root(out)
        found = resume_checkpoint(cfg)
        if found is not None:
            _check_resume_layout(found[1], ranks_per_worker, fsdp)
        # Same corpus, tokenizer (its cache is locked) and seeded initial model on every rank.
        corpus, tok, model, evb = prepare(cfg)
        model = model.to(ctx.device)
        if fsdp:
            shard_model(model, find_blocks(model), ctx.inner_group, ctx.device)
        # One shard per rank; with one rank per worker these are exactly the in-process workers' shards.
        stream = worker_streams(corpus, tok, cfg.workers * ranks_per_worker, cfg.batch_size, cfg.seq_len,
                                cfg.seed, iid=cfg.iid)[ctx.rank]
        # Rank 0 evaluates and reports; a sharded model's forward needs all of worker 0's ranks.
        evaluates = ctx.worker == 0 if fsdp else ctx.rank == 0
        evb = evb if evaluates else []
        comm = communicator_for(ctx, _emulated_link(cfg), seed=cfg.seed, timeout_s=timeout_s)
        # FSDP averages the gradients inside the worker itself (reduce-scatter).
        worker = Worker(model, comm, stream, cfg, inner_group=None if fsdp else ctx.inner_group)
        start_step, real_elapsed = 0, 0.0
        if found is not None:
            path, meta = found
            if "members" in meta and not any(e["file"] == f"worker_{ctx.rank}.pt" for e in meta["files"]):
                raise ConfigError(
                    f"--resume: {path} was made by an elastic run while worker {ctx.rank} was out of the group "
                    f"(members {meta['members']}); resume with --elastic, which gives it a live worker's state"
                )
            worker.load_state_dict(ckpt.load_worker_state(path, ctx.rank))
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            if ctx.rank == 0:
                print(f"resuming from {path} (step {start_step} of {cfg.steps})", flush=True)
        if ctx.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        t_run = time.perf_counter()

        def save(step: int) -> None:
            entry = ckpt.write_worker_state(ckpt.staging_dir(root, step), ctx.rank, worker.state_dict())
            entries: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(entries, entry)
            if ctx.rank == 0:
                meta = {"config": finite_json(asdict(cfg)), "runtime": "distributed",
                        "ranks_per_worker": ranks_per_worker, "fsdp": fsdp,
                        "real_elapsed": real_elapsed + time.perf_counter() - t_run}
                ckpt.publish(root, step, entries, meta, keep=cfg.keep_checkpoints)
            dist.barrier()

        metrics_path = out / "metrics.jsonl"
        tb = tensorboard_writer(cfg, out) if ctx.rank == 0 else None
        kept: list[str] = []
        if ctx.rank == 0 and start_step and metrics_path.exists():
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start_step]
        mf = open(metrics_path, "w") if ctx.rank == 0 else None  # noqa: SIM115 - closed below
        try:
            if mf is not None:
                for ln in kept:
                    mf.write(ln + "\n")

            def log(rec: dict[str, Any]) -> None:
                if mf is not None:
                    mf.write(json.dumps(finite_json(rec)) + "\n")
                    mf.flush()
                _to_tensorboard(tb, rec)

            summary = run_training(cfg, [worker], evb, cfg.workers, log, cfg.progress and ctx.rank == 0,
                                   start_step, save, real_elapsed, evaluate_on=evaluates,
                                   on_step=_fault_injection(ctx.worker),
                                   final_evals=task_evals(cfg, tok) if evaluates else None)
        finally:
            if mf is not None:
                mf.close()
        comm.barrier()
        # Link accounting comes from the ranks that use the link: each worker's first, or (sharded) all.
        mine = {"outer": ctx.is_outer_rank, "worker": ctx.worker, "stats": comm.stats.as_dict(),
                "wall": summary["real_wall_s"]}
        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        if ctx.rank != 0:
            return None
        _aggregate(summary, _per_worker([e for e in every if e["outer"]]))
        summary.update(runtime="distributed", ranks_per_worker=ranks_per_worker, fsdp=fsdp, backend=ctx.backend,
                       link_shaping=_link_shaping(),
                       num_params=sum(p.numel() for p in model.parameters()), config=asdict(cfg))
        write_json_atomic(out / "summary.json", summary)
        return summary
    except PeerError:
        if comm is not None:
            comm.close(cancel=True)
        comm = None
        raise
    finally:
        if comm is not None:
            comm.close()
        shutdown()


def _emulated_link(cfg: TrainConfig) -> LinkConfig:
    """What the communicator emulates: the whole link, or under ``eagerloco launch --kernel-link-gbps``
    (the kernel shapes the bandwidth) only its latency and jitter. cfg.link then records the rate."""
    kernel = kernel_link_from_env()
    if kernel is None:
        return cfg.link
    given = cfg.link.bandwidth_gbps
    if math.isfinite(given) and given != kernel:
        raise ConfigError(
            f"the launcher shapes the link to {kernel:g} Gbit/s in the kernel (--kernel-link-gbps), but train got "
            f"--bandwidth-gbps {given:g}: pass the bandwidth once, to the launcher"
        )
    cfg.link.bandwidth_gbps = kernel
    return LinkConfig(latency_ms=cfg.link.latency_ms, jitter_ms=cfg.link.jitter_ms)


def _link_shaping() -> str:
    """What the summary calls the bandwidth limit: the kernel's (``--kernel-link-gbps``) or emulated."""
    return "kernel" if kernel_link_from_env() is not None else "emulated"


def _check_resume_layout(meta: dict[str, Any], ranks_per_worker: int, fsdp: bool) -> None:
    """A checkpoint holds one file per rank, replicas or (FSDP) shards: resume with the same layout."""
    saved_r, saved_fsdp = int(meta.get("ranks_per_worker", 1)), bool(meta.get("fsdp", False))
    if (saved_r, saved_fsdp) != (ranks_per_worker, fsdp):
        def layout(r: int, f: bool) -> str:
            return f"--ranks-per-worker {r}" + (" --fsdp" if f else "")

        raise ConfigError(
            f"--resume: the checkpoint was written by a run with {layout(saved_r, saved_fsdp)}, this one has "
            f"{layout(ranks_per_worker, fsdp)}; resume with the original layout"
        )


def _per_worker(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One accounting entry per worker from those of its link-using ranks.

    With one such rank per worker that is its entry. With sharded exchanges (FSDP) the worker's
    ranks each move a shard at the same time: bytes and the peak payload add up; times (the same
    steps on every rank) are averaged; a step slow on any rank was slow for the worker.
    """
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        by_worker.setdefault(e["worker"], []).append(e)
    merged = []
    for w in sorted(by_worker):
        group = by_worker[w]
        if len(group) == 1:
            merged.append(group[0])
            continue
        stats = [e["stats"] for e in group]
        one = dict(stats[0])
        for k in ("bytes_sent", "bytes_received", "peak_sync_bytes"):
            one[k] = sum(s[k] for s in stats)
        for k in ("compute_s", "overhead_s", "blocked_s", "drain_s"):
            one[k] = sum(s[k] for s in stats) / len(stats)
        one["num_syncs"] = max(s["num_syncs"] for s in stats)
        one["slow_steps"] = max(int(s.get("slow_steps", 0)) for s in stats)
        merged.append({"outer": True, "worker": w, "stats": one, "wall": max(e["wall"] for e in group)})
    return merged


def _aggregate(summary: dict[str, Any], per_worker: list[dict[str, Any]]) -> None:
    """Replace rank 0's own accounting by the mean over workers (max for peak and wall time)."""
    n = len(per_worker)
    stats = [e["stats"] for e in per_worker]
    walls = [e["wall"] for e in per_worker]
    compute = sum(s["compute_s"] for s in stats)
    summary.update(
        bytes_sent_per_worker=sum(s["bytes_sent"] for s in stats) / n,
        bytes_received_per_worker=sum(s["bytes_received"] for s in stats) / n,
        peak_sync_bytes=max(s["peak_sync_bytes"] for s in stats),
        syncs_per_worker=sum(s["num_syncs"] for s in stats) / n,
        compute_s=compute / n,
        overhead_s=sum(s["overhead_s"] for s in stats) / n,
        blocked_s=sum(s["blocked_s"] for s in stats) / n,
        drain_s=sum(s["drain_s"] for s in stats) / n,
        wall_s=max(walls),
        compute_utilization=compute / sum(walls) if sum(walls) > 0 else 1.0,
        per_worker=stats,
    )
    slow = summary["slow_steps"] = sum(int(s.get("slow_steps", 0)) for s in stats)
    if slow:
        print(f"eagerloco: warning: {slow} inner step(s) over all workers took longer than --sim-step-time "
              "to compute; those ran at the machine's speed, not the emulated one. Raise --sim-step-time for "
              "a fixed pace.", file=sys.stderr, flush=True)


def _to_tensorboard(tb: Any, rec: dict[str, Any]) -> None:
    if tb is not None:
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                tb.add_scalar(k, v, rec["step"])


def _fault_injection(worker: int) -> Callable[[int], None] | None:
    """The EAGERLOCO_FAULT_KILL hook for this worker, if the environment asks for one."""
    kill = kill_hook(worker)
    if kill is None:
        return None

    def on_step(step: int) -> None:
        if step == kill[0]:
            kill_self(kill[1])

    return on_step


# --------------------------------------------------------------------------------------------------
# Elastic runs


class _Metrics:
    """metrics.jsonl, written by whichever worker leads: the first leader rewrites it (keeping
    the lines up to a resumed step), a later one takes over in append mode."""

    def __init__(self, path: Path, start_step: int, is_leader: Callable[[], bool]) -> None:
        self.path, self.start_step, self.is_leader = path, start_step, is_leader
        self.f: IO[str] | None = None
        self.first = is_leader()  # leads from the start: it (re)writes the file

    def log(self, rec: dict[str, Any]) -> None:
        if not self.is_leader():
            self.close()
            return
        if self.f is None:
            self.f = self._open(int(rec["step"]))
        self.f.write(json.dumps(finite_json(rec)) + "\n")
        self.f.flush()

    def _open(self, step: int) -> IO[str]:
        keep_upto = self.start_step if self.first else step - 1
        fresh = self.first and not self.start_step
        self.first = False
        lines: list[str] = []
        if not fresh and self.path.exists():
            for ln in self.path.read_text().split("\n"):
                try:  # a leader that died mid-line leaves a partial last line: drop it
                    if ln and json.loads(ln)["step"] <= keep_upto:
                        lines.append(ln)
                except ValueError:
                    continue
        f = open(self.path, "w")  # noqa: SIM115 - closed in close()
        for ln in lines:
            f.write(ln + "\n")
        f.flush()
        return f

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _own_last_state(root: Path, worker: int) -> dict[str, Any] | None:
    """This worker's state in the newest valid checkpoint that has one (a returning worker's data position)."""
    for path in reversed(ckpt.list_checkpoints(root)):
        try:
            meta = ckpt.verify(path)
        except ckpt.CheckpointError:
            continue
        if any(e["file"] == f"worker_{worker}.pt" for e in meta["files"]):
            return ckpt.load_worker_state(path, worker)
    return None


def _lost_steps(events: list[dict[str, Any]]) -> int:
    """Inner steps that lost workers computed after their last exchange that reached the model."""
    lost = 0
    for ev in events:
        if ev.get("event") != "left":
            continue
        for seen in ev.get("last_seen_step", {}).values():
            if seen is not None:
                lost += max(0, int(seen) - int(ev.get("last_included_step") or 0))
    return lost


def _worker_steps(events: list[dict[str, Any]], workers: int, start: int, steps: int) -> int:
    """Inner steps done by members, summed over workers (M x steps without failures)."""
    total, count, at = 0, workers, start
    for ev in sorted(events, key=lambda e: (e["step"], e["time"])):
        total += count * max(0, ev["step"] - at)
        at = max(at, ev["step"])
        count = len(ev["members"])
    return total + count * max(0, steps - at)


def _train_elastic(cfg: TrainConfig, timeout_s: float) -> dict[str, Any] | None:
    """One worker of an elastic run (one rank per worker): survive deaths, admit returning workers."""
    from eagerloco.data import worker_streams
    from eagerloco.schedule import apply_delay

    me = env_int("RANK")
    if me is None or not 0 <= me < cfg.workers:
        raise ConfigError(f"RANK must be a worker id in 0..{cfg.workers - 1} for --elastic, got {me}")
    joining = rejoining(cfg)
    client = store_client(min(timeout_s, 60.0))
    oc = cfg.outer
    kw = {"inner_steps": oc.inner_steps, "steps": cfg.steps, "is_dp": oc.method == "dp",
          "delay": apply_delay(oc.method, oc.inner_steps, oc.overlap_steps, oc.eager_rounds)}
    out = Path(cfg.out)
    root = ckpt.checkpoint_root(out)
    found = resume_checkpoint(cfg) if not joining else None
    corpus, tok, model, evb = prepare(cfg)  # every worker keeps eval batches: any of them may lead
    stream = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
    src = -1
    # A returning worker keeps its own data position (its newest checkpoint's); read it before asking
    # to join, so that the members do not wait on it during the handover.
    own = _own_last_state(root, me) if joining else None
    if joining:
        joined = Membership.join(client, me, cfg.workers, timeout_s, wait_s=max(4 * timeout_s, 600.0), **kw)
        if joined is None:
            print(f"eagerloco: worker {me}: the run finished before this worker could rejoin", flush=True)
            return None
        membership, outer, start_step, src = joined
        joined = None
    else:
        ctx = init_process_groups(cfg.workers, 1, "gloo", timeout_s)
        membership, outer, start_step = Membership(client, me, cfg.workers, timeout_s, **kw), ctx.outer_group, 0
    comm = TorchDistCommunicator(outer, _emulated_link(cfg), timeout_s, membership.names,
                                 store=heartbeat_store(timeout_s), seed=cfg.seed, elastic=True,
                                 members=membership.members)
    outer = ctx = None  # the communicator holds the group alone: a membership change must free it
    try:
        worker = Worker(model, comm, stream, cfg)
        membership.attach(comm, worker)
        real_elapsed = 0.0
        if joining:
            comm.reset_link(membership.epoch)  # the members restarted theirs at this epoch
            if own is not None:  # its own data position; everything else comes from a live peer
                worker.stream.load_state_dict(own["stream"])
            membership.joined(src)
        elif found is not None:
            path, meta = found
            have = any(e["file"] == f"worker_{me}.pt" for e in meta["files"])
            if have:
                worker.load_state_dict(ckpt.load_worker_state(path, me))
            elif (own := _own_last_state(root, me)) is not None:
                worker.stream.load_state_dict(own["stream"])  # its data position when it was last saved
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            flags: list[Any] = [None] * cfg.workers
            dist.all_gather_object(flags, have)
            lacking = [w for w, h in enumerate(flags) if not h]
            if lacking:  # out of the group when the checkpoint was made: take a member's state
                membership.handover(min(w for w, h in enumerate(flags) if h), lacking)
            if membership.is_leader():
                print(f"resuming from {path} (step {start_step} of {cfg.steps})", flush=True)
        membership.step = start_step
        comm.step_hint = start_step + 1
        if membership.is_leader():
            out.mkdir(parents=True, exist_ok=True)
        if not joining:  # a joiner arrives mid-run: the members are past the start barrier
            comm.barrier()
        t_run = time.perf_counter()

        def save(step: int) -> None:
            stage = ckpt.staging_dir(root, step)
            entry = ckpt.write_worker_state(stage, me, worker.state_dict())
            membership.kv.set(f"ckpt/{step}/{me}", json.dumps(entry))
            if not membership.is_leader():
                return  # the leader publishes once every member's file is written
            entries = membership.collect(f"ckpt/{step}")
            listed = {e["file"] for e in entries.values()}
            for f in stage.glob("worker_*.pt"):  # a worker that died while saving
                if f.name not in listed:
                    f.unlink()
            meta = {"config": finite_json(asdict(cfg)), "runtime": "distributed", "ranks_per_worker": 1,
                    "real_elapsed": real_elapsed + time.perf_counter() - t_run,
                    "members": sorted(entries), "epoch": membership.epoch}
            ckpt.publish(root, step, [entries[w] for w in sorted(entries)], meta, keep=cfg.keep_checkpoints)

        injected = _fault_injection(me)

        def on_step(step: int) -> None:
            membership.on_step(step)  # first: it publishes the step a killed worker got to
            if injected is not None:
                injected(step)

        metrics = _Metrics(out / "metrics.jsonl", start_step, membership.is_leader)
        tb: list[Any] = []  # opened by whichever worker leads when it first logs

        def log(rec: dict[str, Any]) -> None:
            rec = {**rec, "members": len(membership.members)}
            metrics.log(rec)
            if membership.is_leader():
                if not tb:
                    tb.append(tensorboard_writer(cfg, out))
                _to_tensorboard(tb[0], rec)

        try:
            summary = run_training(cfg, [worker], evb, cfg.workers, log, cfg.progress and membership.is_leader(),
                                   start_step, save, real_elapsed, evaluate_on=membership.is_leader,
                                   on_step=on_step, final_evals=task_evals(cfg, tok))
        finally:
            metrics.close()
        membership.finish()
        params = worker.sync.outer_parameters()
        mine = {"outer": True, "worker": me, "stats": comm.stats.as_dict(), "wall": summary["real_wall_s"],
                "sha256": outer_digest(params), "finite": all(bool(torch.isfinite(p).all()) for p in params),
                "recovery_s": membership.recovery_s}
        membership.kv.set(f"final/{me}", json.dumps(mine))
        if not membership.is_leader():
            return None
        every = list(membership.collect("final").values())
        _aggregate(summary, every)
        events = membership.events()
        worker_steps = _worker_steps(events, cfg.workers, start_step, cfg.steps)
        summary.update(
            runtime="distributed", ranks_per_worker=1, backend="gloo", elastic=True,
            link_shaping=_link_shaping(),
            num_params=sum(p.numel() for p in model.parameters()), config=asdict(cfg),
            members=membership.members, epoch=membership.epoch, faults=events,
            lost_inner_steps=_lost_steps(events), worker_steps=worker_steps,
            tokens=worker_steps * cfg.batch_size * cfg.seq_len,
            recovery_s=max(e["recovery_s"] for e in every),
            final_outer={str(e["worker"]): {"sha256": e["sha256"], "finite": e["finite"]} for e in every},
        )
        write_json_atomic(out / "summary.json", summary)
        return summary
    except PeerError:
        comm.close(cancel=True)
        raise
    finally:
        comm.close()
        shutdown()


def in_distributed_env() -> bool:
    """Whether this process was started by torchrun or `eagerloco launch`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


__all__ = ["in_distributed_env", "train_distributed"]
