"""The in-process runtime: M workers in one process over a simulated link (``eagerloco train``)."""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagerloco import checkpoint as ckpt
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import TrainConfig
from eagerloco.device import resolve_device
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.train.loop import Worker, prepare, run_training, task_evals
from eagerloco.train.outputs import RunOutput
from eagerloco.train.resume import announce_resume, checkpoint_meta, resume_checkpoint
from eagerloco.train.rundir import claim


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train M in-process workers on the configured text.

    With ``cfg.checkpoint_every``, checkpoints go to ``<out>/checkpoints``; ``cfg.resume`` continues
    from the newest valid one, giving the same numbers as a run that was never interrupted.

    Args:
        cfg: the run's settings (validated here).

    Returns:
        The summary, also written to ``<out>/summary.json`` (``metrics.jsonl`` beside it).

    Raises:
        ConfigError: an invalid setting, or a checkpoint that does not fit these settings.
        DataError: the data cannot be fetched or read.
    """
    cfg.validate()
    with claim(cfg):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    from eagerloco.data import worker_streams

    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    root = ckpt.checkpoint_root(out)
    found = resume_checkpoint(cfg)
    corpus, tok, base, evb = prepare(cfg)
    device = resolve_device(cfg.device)
    if device.type != "cpu":  # every worker on the one device, taking turns as on the CPU
        base = base.to(device)
    streams = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)
    group = InProcessGroup(cfg.workers, cfg.link, seed=cfg.seed, count_overhead=cfg.sim_step_time is None)
    workers = [
        Worker(base if m == 0 else copy.deepcopy(base), group.communicator(m), streams[m], cfg)
        for m in range(cfg.workers)
    ]
    start_step, real_elapsed = 0, 0.0
    if found is not None:
        path, meta = found
        for m, w in enumerate(workers):
            w.load_state_dict(ckpt.load_worker_state(path, m))
        group.load_state_dict(meta["group"])
        start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
        announce_resume(path, start_step, cfg)
    out.mkdir(parents=True, exist_ok=True)
    t_run = time.perf_counter()

    def save(step: int) -> None:
        states = {m: w.state_dict() for m, w in enumerate(workers)}
        meta = checkpoint_meta(cfg, real_elapsed + time.perf_counter() - t_run, group=group.state_dict())
        ckpt.save(root, step, states, meta, keep=cfg.keep_checkpoints)

    output = RunOutput(cfg, start_step, lambda: True)
    try:
        summary = run_training(cfg, workers, evb, cfg.workers, output.log, cfg.progress, start_step, save,
                               real_elapsed, final_evals=task_evals(cfg, tok))
    finally:
        output.close()
    summary["num_params"] = sum(p.numel() for p in base.parameters())
    summary["config"] = asdict(cfg)
    write_json_atomic(out / "summary.json", summary)
    return summary


__all__ = ["train"]
