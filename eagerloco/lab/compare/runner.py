"""Running a comparison: plan every run of a grid from one base config, then train or reuse each.

An entry changes only the outer algorithm, so the report's differences come from the method alone. Runs go one
after another into ``<out>/runs/<name>``; one whose ``summary.json`` has the same settings is reused.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.flags import build_train_config, config_tables
from eagerloco.jsonfiles import finite_json
from eagerloco.lab.compare.grid import (
    CACHE_IGNORED,
    COMPARE_DEFAULTS,
    DEFAULT_OUT,
    ENTRIES,
    METHOD_FIELDS,
    PER_ENTRY_FLAGS,
    GridEntry,
    tolerated_steps,
    tolerated_text,
)
from eagerloco.lab.compare.tune import value_text


@dataclass
class PlannedRun:
    entry: GridEntry
    cfg: TrainConfig
    run_dir: Path
    inner_steps: int
    in_sweep: bool = False
    seed: int | None = None  # set in a seeded comparison (--seeds, --tune)
    setting: dict[str, Any] | None = None  # the swept values of a tuning run, or those chosen
    tag: str | None = None  # a unique name when run_dir's own is not (runs/<name>/seed<s>)

    @property
    def key(self) -> str:
        return self.tag or self.run_dir.name


def entry_config(base: Any, entry: GridEntry, run_dir: Path, lowered_lr: float, inner_steps: int | None = None) -> Any:
    """The base TrainConfig with this entry's outer settings and its own output directory."""
    outer = {**METHOD_FIELDS, **entry.outer}
    if entry.lowered_lr:
        outer["outer_lr"] = lowered_lr
    if inner_steps is not None:
        outer["inner_steps"] = inner_steps
    # compare owns <out>/runs: a run it does not reuse is retrained over whatever that directory held.
    return replace(base, **entry.train, outer=replace(base.outer, **outer), out=str(run_dir), overwrite=True)


def checked(cfg: TrainConfig, where: str) -> TrainConfig:
    """``cfg`` validated as its run will validate it (with its model's blocks); a ConfigError names ``where`` first."""
    from eagerloco.model import model_config

    num_blocks = model_config(cfg.model).n_layers
    try:
        cfg.validate()
        cfg.outer.validate(num_blocks=num_blocks)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err
    return cfg


def plan_runs(
    base: Any, entries: list[GridEntry], out: Path, lowered_lr: float, sweep_h: list[int] | None = None
) -> list[PlannedRun]:
    """Every run of the comparison, validated (with the model's block count) before any trains."""
    plans = []
    for h in sweep_h or [None]:
        for e in entries:
            name = e.name if h is None else f"H{h}-{e.name}"
            where = f"grid entry {e.name!r}" + (f" at H = {h}" if h is not None else "")
            cfg = checked(entry_config(base, e, out / "runs" / name, lowered_lr, h), where)
            plans.append(PlannedRun(e, cfg, out / "runs" / name, cfg.outer.inner_steps, h is not None))
    return plans


def _cache_view(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in finite_json(config).items() if k not in CACHE_IGNORED}


def cached_summary(plan: PlannedRun) -> dict[str, Any] | None:
    """The run's summary.json if it exists, is readable and was made with the same settings."""
    path = plan.run_dir / "summary.json"
    if not path.is_file() or not (plan.run_dir / "metrics.jsonl").is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        return None
    # A setting added since that run was made had its default then.
    if _cache_view({**asdict(TrainConfig()), **saved["config"]}) != _cache_view(asdict(plan.cfg)):
        return None
    return saved


def _outer_brief(cfg: Any) -> str:
    o = cfg.outer
    parts = [o.method]
    if not o.per_step:
        parts.append(f"H={o.inner_steps}")
    if o.fragments > 1:
        parts.append(f"P={o.fragments}")
    if o.overlap_steps:
        parts.append(f"tau={o.overlap_steps}")
    if o.rounds_in_flight:
        parts.append(f"k={o.rounds_in_flight}")
    if o.codec != "fp32":
        parts.append(o.codec)
    parts.append(f"outer lr {o.outer_lr:g}")
    return ", ".join(parts)


def run_plans(plans: list[PlannedRun], force: bool = False) -> list[dict[str, Any]]:
    """Train (or reuse) each planned run in order, printing one line as it starts and one as it ends."""
    from eagerloco.lab.compare.report import fmt_cu, fmt_loss
    from eagerloco.train import train  # imports torch: only when something trains
    from eagerloco.units import fmt_bytes

    results = []
    _check_run_dirs([p for p in plans if force or cached_summary(p) is None])
    for i, plan in enumerate(plans, 1):
        head = f"[{i}/{len(plans)}] {plan.entry.label}" + (f" @ H={plan.inner_steps}" if plan.in_sweep else "")
        if plan.seed is not None:
            head += f", seed {plan.seed}" + (f", {_setting_brief(plan.setting)}" if plan.setting else "")
        summary = None if force else cached_summary(plan)
        cached = summary is not None
        t0 = time.perf_counter()
        if summary is None:
            print(f"{head} ({_outer_brief(plan.cfg)}): training {plan.cfg.steps} steps -> {plan.run_dir}", flush=True)
            summary = train(plan.cfg)
        else:
            print(f"{head}: reusing {plan.run_dir / 'summary.json'}", flush=True)
        sent = fmt_bytes(summary.get("bytes_sent_per_worker"))
        took = "" if cached else f"  ({time.perf_counter() - t0:.0f} s)"
        print(f"    eval loss {fmt_loss(summary.get('final_eval_loss'))}  sent {sent}  "
              f"CU {fmt_cu(summary.get('compute_utilization'))}{took}", flush=True)
        results.append(_result(plan, summary, cached))
    step_times = [r["step_s"] for r in results if r["step_s"] is not None]
    mean_step = sum(step_times) / len(step_times) if step_times else None
    for r, plan in zip(results, plans, strict=True):
        r["mean_step_s"] = mean_step
        r["tolerated_s"] = r["tolerated_steps"] * mean_step if mean_step is not None else None
        r["tolerated"] = tolerated_text(plan.cfg.outer, mean_step)
    return results


def print_done(results: list[dict[str, Any]], elapsed_s: float, report: Path,
               beside: str = "plots and summary.json") -> None:
    """The closing lines of a comparison: how many runs trained and were reused, in how long, and the report."""
    reused = sum(r["cached"] for r in results)
    print(f"\n{len(results) - reused} run(s) trained, {reused} reused, in {elapsed_s:.0f} s; "
          f"{beside} beside the report")
    print(f"report: {report}")


def _check_run_dirs(plans: list[PlannedRun]) -> None:
    """Before anything trains: each run directory to (re)train holds nothing but an earlier eagerloco run's
    files, the only ones its run removes (:func:`eagerloco.train.rundir.check_fresh_start`)."""
    from eagerloco.train.rundir import check_fresh_start

    for plan in plans:
        try:
            check_fresh_start(plan.cfg, plan.run_dir)
        except ConfigError as e:
            raise ConfigError(f"compare, run {plan.key}: {e}") from None


def _setting_brief(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k} {value_text(v)}" for k, v in setting.items())


def _result(plan: PlannedRun, summary: dict[str, Any], cached: bool) -> dict[str, Any]:
    steps = summary.get("steps") or plan.cfg.steps
    compute = summary.get("compute_s")
    step_s = compute / steps if isinstance(compute, (int, float)) and steps else None
    kept = {k: v for k, v in summary.items() if k not in ("config", "per_worker")}
    wall, per = summary.get("wall_s"), summary.get("per_worker") or []
    if isinstance(wall, (int, float)) and wall > 0 and per:  # each worker's CU and idle seconds (unequal speeds)
        kept.update(worker_cu=[w["compute_s"] / wall for w in per], worker_idle_s=[w["blocked_s"] for w in per])
    return {
        "name": plan.entry.name,
        "label": plan.entry.label,
        "key": plan.key,
        "run_dir": str(plan.run_dir),
        "cached": cached,
        "tolerated_steps": tolerated_steps(plan.cfg.outer),
        "step_s": step_s,
        "outer": asdict(plan.cfg.outer),
        **kept,
        "inner_steps": plan.inner_steps,
        **({"seed": plan.seed, "setting": plan.setting or {}} if plan.seed is not None else {}),
    }


def build_base_config(args: argparse.Namespace) -> tuple[Any, Path]:
    """The shared TrainConfig of every run (defaults <- compare defaults <- file <- flags), validated, and <out>."""
    given = [f for f in PER_ENTRY_FLAGS if getattr(args, f, None) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"compare: {flags} is chosen by each grid entry; pick entries with --grid "
                          f"(one of: {', '.join(ENTRIES)})")
    if getattr(args, "tokens", None) is not None and args.steps is not None:
        raise ConfigError("compare: pass either --steps or --tokens (the budget every run shares), not both")
    if getattr(args, "resume", None):
        raise ConfigError("compare: --resume is per run; compare reuses finished runs by itself (--force retrains)")
    explicit = {k for k, v in vars(args).items() if v is not None}
    if args.config is not None:  # what the file sets, in any of its tables
        explicit |= {k for table in config_tables(args.config).values() for k in table}
    ns = argparse.Namespace(**vars(args))
    for key, value in COMPARE_DEFAULTS.items():
        if key not in explicit:
            setattr(ns, key, value)
    cfg = build_train_config(ns)
    if "eval_every" not in explicit:
        cfg.eval_every = max(1, cfg.steps // 10)  # an eval-loss curve, not just the final point
    out = Path(args.out if args.out is not None else DEFAULT_OUT if "out" not in explicit else cfg.out)
    return cfg, out
