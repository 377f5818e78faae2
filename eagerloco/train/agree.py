"""What the workers of a run agree on before the first step: the settings that must match, the model, its
initial parameters, and the checkpoint step to resume from.

Each process parses its own command line: without this, jobs started with a different ``--seed`` would
train two models and both exit 0. Every difference stops every process with one line naming the setting
and each worker's value; jobs with different checkpoints resume from the newest step they all have."""

from __future__ import annotations

import sys
from dataclasses import asdict, fields
from typing import Any

from torch import nn

from eagerloco.comm.rendezvous import check_agreement, parameter_digest, shapes_digest
from eagerloco.config import ConfigError, TrainConfig, flag_name
from eagerloco.train.resume import checkpoint_at, intact_steps
from eagerloco.train.runtime import Found, Runtime

#: Settings each process may choose for itself: where it writes, what it shows, where it computes,
#: the timeouts it tolerates. Every other setting must be the same on every worker.
LOCAL_SETTINGS = frozenset({
    "out", "progress", "overwrite", "tensorboard", "log_every", "keep_checkpoints", "eval_tasks", "eval_limit",
    "eval_batches", "data_dir", "device", "precision", "compile", "peak_tflops", "tokens", "slow_workers",
    "sim_step_time",
    # runtime: how this process reaches the others (elastic must match: the membership protocol runs on all)
    "ranks_per_worker", "fsdp", "backend", "outer_backend", "dist_timeout", "outer_addr", "worker_id", "rejoin",
    "kernel_link_gbps",
})
FIX = "Start every worker with the same settings (and --resume every one of them, or none)"


def agreed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings every worker must share, by flag: the run's, its outer algorithm's, its link's and elastic."""
    out: dict[str, Any] = {}
    for section in (cfg, cfg.outer, cfg.link, cfg.runtime):
        for f in fields(section):
            if f.name in ("outer", "link", "runtime") or f.name in LOCAL_SETTINGS:
                continue
            value = getattr(section, f.name)
            out[flag_name(f.name)] = asdict(value) if hasattr(value, "__dataclass_fields__") else value
    return out


def agree_before_start(rt: Runtime, found: Found | None, model: nn.Module) -> Found | None:
    """Compare this process's settings, model and start with every other process's; returns the checkpoint to
    resume from (an older one where another worker lacks the newer). ConfigError naming what differs;
    PeerError for a worker that did not arrive."""
    place = rt.agreement()
    if place is None:
        return found
    cfg = rt.cfg
    mine: dict[str, Any] = {**agreed_settings(cfg), "model parameters": shapes_digest(model.named_parameters())}
    if found is None and not cfg.runtime.fsdp:  # a fresh start: the same seed must have given the same weights
        mine["initial parameters"] = parameter_digest(model.parameters())
    steps = intact_steps(cfg) if cfg.resume else None
    everyone = place.gather({"settings": mine, "steps": steps}, "start", cfg.runtime.dist_timeout)
    check_agreement({i: e["settings"] for i, e in everyone.items()}, place.name, FIX)
    if steps is None:
        return found
    have = {i: set(e["steps"]) for i, e in everyone.items()}
    common = set.intersection(*have.values())
    if not common:
        listed = "; ".join(f"{place.name(i)}: {sorted(s) or 'none'}" for i, s in have.items())
        raise ConfigError(f"--resume: the workers have no checkpoint step in common ({listed}); resume them from "
                          "checkpoints of one step, or start them all afresh")
    step = max(common)
    if found is not None and int(found[1]["step"]) == step:
        return found
    print(f"eagerloco: {place.name(place.me)}: resuming from step {step}, the newest checkpoint every worker "
          f"has (this one also has {', '.join(str(s) for s in sorted(have[place.me]) if s > step)})",
          file=sys.stderr, flush=True)
    return checkpoint_at(cfg, rt.checkpoint_kind, step)
