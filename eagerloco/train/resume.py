"""Resuming a run: which checkpoint, whether its settings and layout match, what a checkpoint records."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagerloco import checkpoint as ckpt
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.jsonfiles import finite_json

#: Settings that may change between a run and its resumption without changing its numbers (the runtime's
#: layout is checked on its own: check_resume_layout). data_dir is where the cache of the named data lives,
#: not which data: --data and --tokenizer decide those.
RESUMABLE_CHANGES = {"progress", "resume", "overwrite", "out", "checkpoint_every", "keep_checkpoints", "eval_every",
                     "log_every", "runtime", "slow_workers", "eval_tasks", "eval_limit", "tensorboard", "device",
                     "peak_tflops", "data_dir"}


def check_resume_config(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse (ConfigError, naming each setting old and new) a checkpoint of settings that change the numbers."""
    now = finite_json(asdict(cfg))
    diffs = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if diffs:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diffs)
        raise ConfigError(
            f"--resume: the checkpoint was made with different settings ({detail}); "
            "rerun with the original settings or start a fresh run in another --out directory"
        )


def resume_checkpoint(cfg: TrainConfig, runtime: str = "inprocess") -> tuple[Path, dict[str, Any]] | None:
    """With ``cfg.resume``, the newest valid checkpoint under ``<out>/checkpoints`` and its meta (else None).

    ``runtime`` ("inprocess" or "distributed") is the one resuming: a checkpoint holds its writer's runtime
    state, so it resumes in the same one. ConfigError when there is none or it does not fit;
    CheckpointError when none is intact."""
    if not cfg.resume:
        return None
    root = ckpt.checkpoint_root(Path(cfg.out))
    found = ckpt.latest_valid(root, check=lambda meta: meta_problem(meta, cfg))
    if found is None:
        raise ConfigError(f"--resume: no checkpoint under {root}; run without --resume to start fresh")
    return check_checkpoint(cfg, runtime, found)


def check_checkpoint(cfg: TrainConfig, runtime: str, found: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """A verified checkpoint, returned once checked (ConfigError) to fit these settings and this runtime."""
    path, meta = found
    written = "distributed" if meta.get("runtime") == "distributed" else "inprocess"
    if written != runtime:
        how = {"inprocess": "in one process (`eagerloco train --resume` without a launcher)",
               "distributed": "on several processes (`eagerloco launch --workers M -- ... --resume` or torchrun)"}
        raise ConfigError(
            f"--resume: {path} was written by a run {how[written]}; it holds that runtime's state, "
            f"so resume it the same way"
        )
    check_resume_config(meta["config"], cfg)
    return found


def meta_problem(meta: dict[str, Any], cfg: TrainConfig) -> str:
    """What in a checkpoint's meta.json, beyond its files and step, a run of ``cfg`` cannot resume from, or "":
    every field the runtimes read is checked here first."""
    if not isinstance(meta.get("config"), dict):
        return "it records no 'config' table"
    step = meta["step"]
    if step > cfg.steps:
        return f"step {step} is past the run's last step ({cfg.steps})"
    elapsed = meta.get("real_elapsed", 0.0)
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed) or elapsed < 0:
        return f"real_elapsed {elapsed!r} is not a number of seconds"
    if meta.get("runtime") != "distributed":
        return InProcessGroup.state_problem(meta.get("group"))
    ranks = meta.get("ranks_per_worker", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        return f"ranks_per_worker {ranks!r} is not a number of ranks"
    if not isinstance(meta.get("fsdp", False), bool):
        return f"fsdp {meta['fsdp']!r} is not true or false"
    members = meta.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, int) and not isinstance(m, bool) for m in members):
        return f"members {members!r} is not a list of worker ids"
    return ""


def intact_steps(cfg: TrainConfig) -> list[int]:
    """The steps of the checkpoints under ``<out>/checkpoints`` that verify, oldest first."""
    found = ckpt.intact(ckpt.checkpoint_root(Path(cfg.out)), lambda m: meta_problem(m, cfg))
    return sorted(int(meta["step"]) for _, meta in found)


def checkpoint_at(cfg: TrainConfig, runtime: str, step: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of ``step``, verified (CheckpointError) and checked to fit (ConfigError)."""
    path = ckpt.checkpoint_dir(ckpt.checkpoint_root(Path(cfg.out)), step)
    meta = ckpt.verify(path, lambda m: meta_problem(m, cfg))
    return check_checkpoint(cfg, runtime, (path, meta))


def check_resume_layout(meta: dict[str, Any], ranks_per_worker: int, fsdp: bool) -> None:
    """Refuse (ConfigError) to resume a checkpoint of another layout: one file per rank, replicas or FSDP shards."""
    saved_r, saved_fsdp = int(meta.get("ranks_per_worker", 1)), bool(meta.get("fsdp", False))
    if (saved_r, saved_fsdp) != (ranks_per_worker, fsdp):
        def layout(r: int, f: bool) -> str:
            return f"--ranks-per-worker {r}" + (" --fsdp" if f else "")

        raise ConfigError(
            f"--resume: the checkpoint was written by a run with {layout(saved_r, saved_fsdp)}, this one has "
            f"{layout(ranks_per_worker, fsdp)}; resume with the original layout"
        )


def has_worker(meta: dict[str, Any], worker: int) -> bool:
    """Whether a checkpoint holds this worker's (rank's) file."""
    return any(e["file"] == f"worker_{worker}.pt" for e in meta["files"])


def own_last_state(root: Path, worker: int) -> dict[str, Any] | None:
    """This worker's state in the newest valid checkpoint that has one (a returning worker's data position)."""
    found = (path for path, meta in ckpt.intact(root) if has_worker(meta, worker))
    return next((ckpt.load_worker_state(path, worker) for path in found), None)


def checkpoint_meta(cfg: TrainConfig, real_elapsed: float, **extra: Any) -> dict[str, Any]:
    """What every checkpoint's meta.json records besides its files: the settings and the time spent."""
    return {"config": finite_json(asdict(cfg)), **extra, "real_elapsed": real_elapsed}
