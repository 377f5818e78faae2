"""The multi-process runtime: one process per rank, R ranks per worker, M workers.

Started by ``eagerloco launch`` or torchrun; ``eagerloco train`` comes here when RANK and
WORLD_SIZE are set. The loop, algorithm and accounting are those of :mod:`eagerloco.train.loop`;
only the transport differs (:class:`~eagerloco.comm.distributed.TorchDistCommunicator` with a real
background exchange and an emulated link), plus the inner data-parallel group of each worker.

Without ``--elastic`` a dead worker stops the run: the others raise PeerError naming it and exit
non-zero, and the last checkpoint (published only once every rank's file is written) stays the
one to resume from. With ``--elastic`` see :mod:`eagerloco.train.elastic`.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagerloco import checkpoint as ckpt
from eagerloco.comm.errors import describe_exception, is_transport_failure
from eagerloco.comm.groups import (
    heartbeat_store,
    init_process_groups,
    set_worker_threads,
    shutdown,
    workers_from_env,
)
from eagerloco.comm.heartbeat import Heartbeat, blame_ranks, wait_for_key
from eagerloco.comm.link import check_exchange_fits, emulated_link
from eagerloco.comm.worker import communicator_for
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.device import DeviceError, resolve_device
from eagerloco.faults import eval_delay, fault_injection
from eagerloco.fragments import find_blocks
from eagerloco.fsdp import shard_model
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.kernel_link_env import kernel_link_from_env, link_shaping
from eagerloco.train.elastic import train_elastic
from eagerloco.train.loop import Worker, prepare, run_training, task_evals
from eagerloco.train.outputs import RunOutput, add_throughput, aggregate, per_worker
from eagerloco.train.resume import (
    announce_resume,
    check_resume_layout,
    checkpoint_meta,
    has_worker,
    resume_checkpoint,
)
from eagerloco.train.rundir import guard_run_dir


def train_distributed(
    cfg: TrainConfig, ranks_per_worker: int = 1, backend: str | None = None, timeout_s: float = 300.0,
    fsdp: bool = False, outer_backend: str | None = None,
) -> dict[str, Any] | None:
    """Run this rank's share of a multi-process run.

    Args:
        cfg: the run's settings (validated here); ``cfg.elastic`` selects the elastic runtime.
        ranks_per_worker: R, data-parallel ranks inside each worker.
        backend: the inner group's backend (gloo or nccl; default nccl with CUDA, else gloo).
        timeout_s: seconds before a silent peer is declared dead.
        fsdp: shard each worker's model over its ranks (:mod:`eagerloco.fsdp`) instead of replicating
            it, and have every rank exchange its own shard with the other workers.
        outer_backend: the outer group's backend: gloo (default; payloads from a GPU go through pinned
            host memory on a copy stream) or nccl (payloads stay on the GPU; needs CUDA).

    Returns:
        The summary on the reporting rank (also written to ``<out>/summary.json``); None elsewhere.

    Raises:
        ConfigError: an invalid setting, or a launch that does not match it.
        PeerError: another worker died or stopped answering; the message names it.
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
        if backend == "nccl" or outer_backend == "nccl" or cfg.device.startswith("cuda"):
            raise ConfigError("--elastic re-forms gloo groups on the CPU; drop --backend nccl, --outer-backend nccl "
                              "and --device cuda")
        set_worker_threads()
        return train_elastic(cfg, timeout_s)
    if outer_backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--outer-backend nccl needs CUDA, which is not available here; use --outer-backend gloo")
    set_worker_threads()
    lock = guard_run_dir(cfg, reporting=os.environ.get("RANK") == "0")
    ctx = init_process_groups(cfg.workers, ranks_per_worker, backend, timeout_s, outer_backend=outer_backend or "gloo",
                              sharded_outer=fsdp)
    comm = None
    # Every rank's heartbeat (rank/hb/<rank>): a collective of the main thread that fails (a
    # checkpoint, the inner group) names the rank that died or froze, not only the worker.
    gate = heartbeat_store(timeout_s)
    beat = Heartbeat(dist.PrefixStore("rank", gate), ctx.rank) if gate is not None else None  # rank/hb/<rank>
    doing = ["training"]
    try:
        out = Path(cfg.out)
        root = ckpt.checkpoint_root(out)
        found = resume_checkpoint(cfg, "distributed")
        if found is not None:
            check_resume_layout(found[1], ranks_per_worker, fsdp)
        # Same corpus, tokenizer (its cache is locked) and seeded initial model on every rank.
        corpus, tok, model, evb = prepare(cfg)
        device = run_device(cfg, ctx)
        model = model.to(device)
        if fsdp:
            shard_model(model, find_blocks(model), ctx.inner_group, ctx.device)
        # One shard per rank; with one rank per worker these are exactly the in-process workers' shards.
        stream = worker_streams(corpus, tok, cfg.workers * ranks_per_worker, cfg.batch_size, cfg.seq_len,
                                cfg.seed, iid=cfg.iid)[ctx.rank]
        # Rank 0 evaluates and reports; a sharded model's forward needs all of worker 0's ranks.
        evaluates = ctx.worker == 0 if fsdp else ctx.rank == 0
        evb = evb if evaluates else []
        kernel_gbps = kernel_link_from_env()
        link = emulated_link(cfg.link, kernel_gbps)
        if kernel_gbps is not None:  # the kernel shapes the bandwidth: the run records its rate
            cfg.link.bandwidth_gbps = kernel_gbps
        check_exchange_fits(link, cfg.outer, cfg.workers, sum(p.numel() for p in model.parameters()), timeout_s)
        comm = communicator_for(ctx, link, seed=cfg.seed, timeout_s=timeout_s, device=device)
        # FSDP averages the gradients inside the worker itself (reduce-scatter).
        worker = Worker(model, comm, stream, cfg, inner_group=None if fsdp else ctx.inner_group)
        start_step, real_elapsed = 0, 0.0
        if found is not None:
            path, meta = found
            if "members" in meta and not has_worker(meta, ctx.rank):
                raise ConfigError(
                    f"--resume: {path} was made by an elastic run while worker {ctx.rank} was out of the group "
                    f"(members {meta['members']}); resume with --elastic, which gives it a live worker's state"
                )
            worker.load_state_dict(ckpt.load_worker_state(path, ctx.rank))
            start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
            if ctx.rank == 0:
                announce_resume(path, start_step, cfg)
        if ctx.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        t_run = time.perf_counter()

        def save(step: int) -> None:
            doing[0] = f"the checkpoint of step {step}"
            _save(step)
            doing[0] = "training"

        def _save(step: int) -> None:
            # A rank that cannot write (a full disk) tells the others, so that every rank stops with
            # the same message instead of the others failing in the next collective.
            try:
                entry: Any = ckpt.write_worker_state(ckpt.staging_dir(root, step), ctx.rank, worker.state_dict())
            except ckpt.CheckpointError as e:
                entry = {"error": str(e)}
            entries: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(entries, entry)
            problem = next((e["error"] for e in entries if "error" in e), None)
            if ctx.rank == 0 and problem is None:
                meta = checkpoint_meta(cfg, real_elapsed + time.perf_counter() - t_run, runtime="distributed",
                                       ranks_per_worker=ranks_per_worker, fsdp=fsdp)
                try:
                    ckpt.publish(root, step, entries, meta, keep=cfg.keep_checkpoints)
                except ckpt.CheckpointError as e:
                    problem = str(e)
            elif ctx.rank == 0:
                shutil.rmtree(ckpt.staging_dir(root, step), ignore_errors=True)
            verdict: list[Any] = [problem]
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None:
                raise ckpt.CheckpointError(verdict[0])

        def after_eval(step: int) -> None:
            # Rank 0 evaluates alone, for as long as it takes: the others wait here, outside any
            # collective timeout, for as long as its heartbeat says it is alive.
            if ctx.rank == 0:
                eval_delay()
            if gate is None:
                return
            key = f"evaluated/{step}"
            if ctx.rank == 0:
                gate.set(key, "1")
            else:
                wait_for_key(gate, key, 0, "worker 0 (global rank 0, which evaluates)", timeout_s)

        output = RunOutput(cfg, start_step, lambda: ctx.rank == 0)
        devices = min(ctx.world_size, torch.cuda.device_count()) if device.type == "cuda" else 1
        try:
            summary = run_training(cfg, [worker], evb, cfg.workers, output.log, cfg.progress and ctx.rank == 0,
                                   start_step, save, real_elapsed, evaluate_on=evaluates,
                                   on_step=fault_injection(ctx.worker),
                                   final_evals=task_evals(cfg, tok) if evaluates else None,
                                   devices=devices, after_eval=after_eval)
        finally:
            output.close()
        doing[0] = "gathering the results"
        comm.barrier()
        # Link accounting comes from the ranks that use the link: each worker's first, or (sharded) all.
        mine = {"outer": ctx.is_outer_rank, "worker": ctx.worker, "stats": comm.stats.as_dict(),
                "wall": summary["real_wall_s"], "device": f"{socket.gethostname()}/{device}"}
        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        if ctx.rank != 0:
            return None
        aggregate(summary, per_worker([e for e in every if e["outer"]]))
        add_throughput(summary, len({e["device"] for e in every}))
        summary.update(runtime="distributed", ranks_per_worker=ranks_per_worker, fsdp=fsdp, backend=ctx.backend,
                       outer_backend=outer_backend or "gloo",
                       link_shaping=link_shaping(),
                       num_params=sum(p.numel() for p in model.parameters()), config=asdict(cfg))
        write_json_atomic(out / "summary.json", summary)
        return summary
    except BaseException as e:  # a dead peer, a signal (RunStopped, Ctrl-C): drop what is queued, do not wait
        if comm is not None:
            comm.close(cancel=True)
        comm = None
        if gate is not None and is_transport_failure(e):  # a raw backend error: name the rank responsible
            raise blame_ranks(gate, ctx.rank, ctx.world_size, ranks_per_worker,
                              f"{doing[0]} ({describe_exception(e)})") from e
        raise
    finally:
        if beat is not None:
            beat.stop("closed")
        if comm is not None:
            comm.close()
        shutdown()
        if lock is not None:
            lock.release()


def run_device(cfg: TrainConfig, ctx: Any) -> torch.device:
    """This rank's device: the inner group's GPU under NCCL, else what --device says (auto: the local
    rank's GPU when there is one)."""
    if ctx.device.type == "cuda":
        if cfg.device == "cpu":
            raise ConfigError("--device cpu with the nccl inner backend: pass --backend gloo to train on the CPU")
        return ctx.device
    try:
        return resolve_device(cfg.device, ctx.local_rank)
    except DeviceError as e:
        raise ConfigError(str(e)) from None


def in_distributed_env() -> bool:
    """Whether this process was started by torchrun or `eagerloco launch`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


__all__ = ["in_distributed_env", "train_distributed"]
