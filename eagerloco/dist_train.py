"""Training on torch.distributed: one process per rank, R ranks per worker, M workers.

Started by ``eagerloco launch`` or torchrun; ``eagerloco train`` comes here when RANK and
WORLD_SIZE are set. The loop, algorithm and accounting are those of :mod:`eagerloco.train`; only
the transport differs (:class:`~eagerloco.comm.distributed.TorchDistCommunicator` with a real
background exchange and an emulated link), plus the inner data-parallel group of each worker.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from eagerloco import checkpoint as ckpt
from eagerloco.comm.distributed import (
    PeerError,
    communicator_for,
    init_process_groups,
    set_worker_threads,
    shutdown,
    workers_from_env,
)
from eagerloco.config import ConfigError
from eagerloco.train import (
    TrainConfig,
    Worker,
    _check_resume_config,
    _finite_json,
    build_model,
    run_training,
    write_json_atomic,
)


def train_distributed(
    cfg: TrainConfig, ranks_per_worker: int = 1, backend: str | None = None, timeout_s: float = 300.0
) -> dict[str, Any] | None:
    """Run this rank's share of a multi-process run; rank 0 returns the summary, others None."""
    from eagerloco.data import ByteTokenizer, eval_batches, load_corpus, worker_streams

    cfg.validate()
    env = workers_from_env()
    if env is not None and env != (cfg.workers, ranks_per_worker):
        raise ConfigError(
            f"the launcher started {env[0]} workers x {env[1]} ranks, but --workers {cfg.workers} and "
            f"--ranks-per-worker {ranks_per_worker} were passed to train; pass the same numbers to both"
        )
    set_worker_threads()
    ctx = init_process_groups(cfg.workers, ranks_per_worker, backend, timeout_s)
    comm = None
    try:
        tok = ByteTokenizer()
        model = build_model(cfg, tok.vocab_size).to(ctx.device)  # same seed: same start on every rank
        cfg.outer.validate(num_blocks=len(getattr(model, "blocks", [])))
        out = Path(cfg.out)
        root = ckpt.checkpoint_root(out)
        found = ckpt.latest_valid(root) if cfg.resume else None
        if cfg.resume and found is None:
            raise ConfigError(f"--resume: no checkpoint under {root}; run without --resume to start fresh")
        if found is not None:
            _check_resume_config(found[1]["config"], cfg)
        corpus = load_corpus(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
        # One shard per rank; with one rank per worker these are exactly the in-process workers' shards.
        stream = worker_streams(corpus, tok, cfg.workers * ranks_per_worker, cfg.batch_size, cfg.seq_len,
                                cfg.seed)[ctx.rank]
        evb = eval_batches(corpus, tok, cfg.seq_len, cfg.batch_size, cfg.eval_batches) if ctx.rank == 0 else []
        comm = communicator_for(ctx, cfg.link, seed=cfg.seed, timeout_s=timeout_s)
        worker = Worker(model, comm, stream, cfg, inner_group=ctx.inner_group)
        start_step, real_elapsed = 0, 0.0
        if found is not None:
            path, meta = found
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
                meta = {"config": _finite_json(asdict(cfg)), "runtime": "distributed",
                        "ranks_per_worker": ranks_per_worker,
                        "real_elapsed": real_elapsed + time.perf_counter() - t_run}
                ckpt.publish(root, step, entries, meta, keep=cfg.keep_checkpoints)
            dist.barrier()

        metrics_path = out / "metrics.jsonl"
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
                    mf.write(json.dumps(_finite_json(rec)) + "\n")
                    mf.flush()

            summary = run_training(cfg, [worker], evb, cfg.workers, log, cfg.progress and ctx.rank == 0,
                                   start_step, save, real_elapsed, evaluate_on=ctx.rank == 0)
        finally:
            if mf is not None:
                mf.close()
        comm.barrier()
        # Link accounting comes from each worker's first rank (the one that uses the link).
        mine = {"outer": ctx.is_outer_rank, "stats": comm.stats.as_dict(), "wall": summary["real_wall_s"]}
        every: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        if ctx.rank != 0:
            return None
        _aggregate(summary, [e for e in every if e["outer"]])
        summary.update(runtime="distributed", ranks_per_worker=ranks_per_worker, backend=ctx.backend,
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


def in_distributed_env() -> bool:
    """Whether this process was started by torchrun or `eagerloco launch`."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


__all__ = ["in_distributed_env", "train_distributed"]
