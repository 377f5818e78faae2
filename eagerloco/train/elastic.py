"""The elastic multi-process runtime (``--elastic``, one rank per worker): survive deaths, admit returns.

The survivors of a dead worker go on with the mean over the workers present, and a returning
worker is admitted at a round boundary with a live worker's state: see :mod:`eagerloco.comm.elastic`.
The leader (lowest live worker id) does what rank 0 does otherwise: evaluation, metrics,
checkpoint manifest, summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagerloco import checkpoint as ckpt
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.elastic import Membership, outer_digest
from eagerloco.comm.errors import PeerError
from eagerloco.comm.groups import env_int, heartbeat_store, init_process_groups, shutdown, store_client
from eagerloco.comm.heartbeat import wait_for_key
from eagerloco.comm.link import check_exchange_fits, emulated_link
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.faults import eval_delay, fault_injection, rejoining
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.kernel_link_env import kernel_link_from_env, link_shaping
from eagerloco.train.loop import Worker, prepare, run_training, task_evals
from eagerloco.train.outputs import RunOutput, add_throughput, aggregate
from eagerloco.train.resume import (
    announce_resume,
    checkpoint_meta,
    has_worker,
    own_last_state,
    resume_checkpoint,
)
from eagerloco.train.rundir import guard_run_dir


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


def train_elastic(cfg: TrainConfig, timeout_s: float) -> dict[str, Any] | None:
    """One worker of an elastic run (its process's share of :func:`~eagerloco.train.distributed.train_distributed`).

    Returns:
        The summary on the leader at the end (also written to ``<out>/summary.json``); None elsewhere,
        and on a worker that came back after the run had finished.

    Raises:
        ConfigError: an invalid setting or environment.
        PeerError: the run's store cannot be reached, or the group cannot go on.
    """
    me = env_int("RANK")
    if me is None or not 0 <= me < cfg.workers:
        raise ConfigError(f"RANK must be a worker id in 0..{cfg.workers - 1} for --elastic, got {me}")
    joining = rejoining(cfg)
    lock = None if joining else guard_run_dir(cfg, reporting=me == 0)
    try:
        return _run(cfg, timeout_s, me, joining)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: TrainConfig, timeout_s: float, me: int, joining: bool) -> dict[str, Any] | None:
    from eagerloco.data import worker_streams
    from eagerloco.schedule import apply_delay

    client = store_client(min(timeout_s, 60.0))
    oc = cfg.outer
    kw = {"inner_steps": oc.inner_steps, "steps": cfg.steps, "is_dp": oc.method == "dp",
          "delay": apply_delay(oc.method, oc.inner_steps, oc.overlap_steps, oc.eager_rounds)}
    out = Path(cfg.out)
    root = ckpt.checkpoint_root(out)
    found = resume_checkpoint(cfg, "distributed") if not joining else None
    corpus, tok, model, evb = prepare(cfg)  # every worker keeps eval batches: any of them may lead
    stream = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)[me]
    src = -1
    # A returning worker keeps its own data position (its newest checkpoint's); read it before asking
    # to join, so that the members do not wait on it during the handover.
    own = own_last_state(root, me) if joining else None
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
    kernel_gbps = kernel_link_from_env()
    link = emulated_link(cfg.link, kernel_gbps)
    if kernel_gbps is not None:  # the kernel shapes the bandwidth: the run records its rate
        cfg.link.bandwidth_gbps = kernel_gbps
    check_exchange_fits(link, cfg.outer, cfg.workers, sum(p.numel() for p in model.parameters()), timeout_s)
    comm = TorchDistCommunicator(outer, link, timeout_s, membership.names,
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
            have = has_worker(meta, me)
            if have:
                worker.load_state_dict(ckpt.load_worker_state(path, me))
            elif (own := own_last_state(root, me)) is not None:
                worker.stream.load_state_dict(own["stream"])  # its data position when it was last saved
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            flags: list[Any] = [None] * cfg.workers
            dist.all_gather_object(flags, have)
            lacking = [w for w, h in enumerate(flags) if not h]
            if lacking:  # out of the group when the checkpoint was made: take a member's state
                membership.handover(min(w for w, h in enumerate(flags) if h), lacking)
            if membership.is_leader():
                announce_resume(path, start_step, cfg)
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
            meta = checkpoint_meta(cfg, real_elapsed + time.perf_counter() - t_run, runtime="distributed",
                                   ranks_per_worker=1, members=sorted(entries), epoch=membership.epoch)
            ckpt.publish(root, step, [entries[w] for w in sorted(entries)], meta, keep=cfg.keep_checkpoints)

        injected = fault_injection(me)

        def on_step(step: int) -> None:
            membership.on_step(step)  # first: it publishes the step a killed worker got to
            if injected is not None:
                injected(step)

        gate = heartbeat_store(timeout_s)

        def after_eval(step: int) -> None:
            # The leader evaluates alone, for as long as it takes: the others wait here, outside any
            # collective timeout, while its heartbeat is fresh. A leader that dies meanwhile is left
            # to the membership change that follows (the next exchange fails without it).
            if membership.is_leader():
                eval_delay()
                if gate is not None:
                    gate.set(f"evaluated/{step}", "1")
            elif gate is not None:
                leader = membership.leader
                try:
                    wait_for_key(gate, f"evaluated/{step}", leader, f"worker {leader} (the leader, evaluating)",
                                 timeout_s)
                except PeerError:
                    pass

        output = RunOutput(cfg, start_step, membership.is_leader)

        def log(rec: dict[str, Any]) -> None:
            output.log({**rec, "members": len(membership.members)})

        try:
            summary = run_training(cfg, [worker], evb, cfg.workers, log, cfg.progress and membership.is_leader(),
                                   start_step, save, real_elapsed, evaluate_on=membership.is_leader,
                                   on_step=on_step, final_evals=task_evals(cfg, tok), after_eval=after_eval)
        finally:
            output.close()
        membership.finish()
        params = worker.sync.outer_parameters()
        mine = {"outer": True, "worker": me, "stats": comm.stats.as_dict(), "wall": summary["real_wall_s"],
                "sha256": outer_digest(params), "finite": all(bool(torch.isfinite(p).all()) for p in params),
                "recovery_s": membership.recovery_s}
        membership.kv.set(f"final/{me}", json.dumps(mine))
        if not membership.is_leader():
            return None
        every = list(membership.collect("final").values())
        aggregate(summary, every)
        add_throughput(summary)
        events = membership.events()
        done_steps = worker_steps(events, cfg.workers, start_step, cfg.steps)
        summary.update(
            runtime="distributed", ranks_per_worker=1, backend="gloo", elastic=True,
            link_shaping=link_shaping(),
            num_params=sum(p.numel() for p in model.parameters()), config=asdict(cfg),
            members=membership.members, epoch=membership.epoch, faults=events,
            lost_inner_steps=lost_steps(events), worker_steps=done_steps,
            tokens=done_steps * cfg.batch_size * cfg.seq_len,
            recovery_s=max(e["recovery_s"] for e in every),
            final_outer={str(e["worker"]): {"sha256": e["sha256"], "finite": e["finite"]} for e in every},
        )
        write_json_atomic(out / "summary.json", summary)
        return summary
    except BaseException:  # a dead peer, a signal (RunStopped, Ctrl-C): drop what is queued, do not wait
        comm.close(cancel=True)
        raise
    finally:
        comm.close()
        shutdown()


__all__ = ["lost_steps", "train_elastic", "worker_steps"]
