"""`eagerloco compare`: run a grid of methods on the same data, model, seed and token budget.

Every run of a grid shares one base :class:`~eagerloco.train.TrainConfig`; a grid entry only
changes the outer algorithm, so differences in the report come from the method alone. Runs go
one after another in this process, each into ``<out>/runs/<name>``; a run whose ``summary.json``
was written with the same settings is reused, so a killed compare is cheap to rerun. The report
(``report.md``, ``summary.json`` and the plots, see :mod:`eagerloco.report`) goes to ``<out>``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError, OuterConfig
from eagerloco.schedule import apply_delay


@dataclass(frozen=True)
class GridEntry:
    """One method of a comparison: a short name (CLI, run directory), the report's label, and the
    OuterConfig fields it sets; every field it does not set comes from the base configuration."""

    name: str
    label: str
    outer: dict[str, Any] = field(default_factory=dict)
    lowered_lr: bool = False  # outer lr <- --lowered-outer-lr


# Method-specific fields are always set by the entry, so a base config file written for another
# method (say streaming with overlap) cannot leak into an entry where it would be invalid.
_METHOD_FIELDS = {"method": "diloco", "fragments": 1, "overlap_steps": 0, "eager_rounds": 1}

ENTRIES: dict[str, GridEntry] = {
    e.name: e
    for e in (
        GridEntry("dp", "data-parallel", {"method": "dp"}),
        GridEntry("no-overlap", "no overlap", {"method": "diloco"}),
        GridEntry("overlap-1", "1-inner-step overlap", {"method": "diloco", "overlap_steps": 1}),
        GridEntry("delayed-1", "1-outer-step naive delayed", {"method": "delayed", "eager_rounds": 1}),
        GridEntry("delayed-1-lowlr", "1-outer-step naive delayed, lowered lr",
                  {"method": "delayed", "eager_rounds": 1}, lowered_lr=True),
        GridEntry("eager-1", "1-outer-step eager", {"method": "eager", "eager_rounds": 1}),
        GridEntry("eager-2", "2-outer-steps eager", {"method": "eager", "eager_rounds": 2}),
        # Beyond the eager paper's table: eager with the lowered outer lr too (at this scale the default
        # 0.7 with Nesterov 0.9 overshoots on the half-stale eager update), streaming, 4-bit exchange,
        # the other eager weighting.
        GridEntry("eager-1-lowlr", "1-outer-step eager, lowered lr",
                  {"method": "eager", "eager_rounds": 1}, lowered_lr=True),
        GridEntry("eager-2-lowlr", "2-outer-steps eager, lowered lr",
                  {"method": "eager", "eager_rounds": 2}, lowered_lr=True),
        GridEntry("delayed-2", "2-outer-steps naive delayed", {"method": "delayed", "eager_rounds": 2}),
        GridEntry("eager-1-stale-avg", "1-outer-step eager, stale-average weighting",
                  {"method": "eager", "eager_weighting": "stale_average"}),
        GridEntry("eager-1-4bit", "1-outer-step eager, 4-bit", {"method": "eager", "codec": "e2m1"}),
        GridEntry("streaming-2", "streaming P=2", {"method": "streaming", "fragments": 2}),
        GridEntry("streaming-2-overlap-1", "streaming P=2, 1-inner-step overlap",
                  {"method": "streaming", "fragments": 2, "overlap_steps": 1}),
        GridEntry("streaming-2-overlap-1-4bit", "streaming P=2, 1-inner-step overlap, 4-bit",
                  {"method": "streaming", "fragments": 2, "overlap_steps": 1, "codec": "e2m1"}),
        GridEntry("streaming-2-eager-1-4bit", "streaming P=2, 1-outer-step eager, 4-bit",
                  {"method": "eager", "fragments": 2, "codec": "e2m1"}),
    )
}

#: The eager paper's comparison (its Table of 500M-model results) plus the data-parallel baseline.
PAPER_GRID = ["dp", "no-overlap", "overlap-1", "delayed-1", "delayed-1-lowlr", "eager-1", "eager-2"]
ALL_GRID = list(ENTRIES)
#: What `--sweep inner-steps` compares at each H unless --grid says otherwise.
SWEEP_GRID = ["no-overlap", "delayed-1", "eager-1"]
GRIDS = {"paper": PAPER_GRID, "all": ALL_GRID}

#: Eval loss the eager paper reports for its 500M model at H = 30 (ALGORITHMS.md section 6).
PAPER_EVAL_LOSS = {"no-overlap": 2.67, "overlap-1": 2.67, "delayed-1": 3.01, "delayed-1-lowlr": 2.73,
                   "eager-1": 2.69, "eager-2": 2.73}

#: compare's own defaults, used where neither a flag nor the config file sets the field. The link
#: carries one fp32 exchange of the tiny model between 2 workers in about 1 s: longer than the 1-step
#: overlap hides, shorter than one round of H = 20 steps (~1.2 s at ~60 ms a step), so the
#: methods' tolerated windows show up in the compute-utilization column.
COMPARE_DEFAULTS: dict[str, Any] = {"inner_steps": 20, "bandwidth_gbps": 0.03, "latency_ms": 50.0}
DEFAULT_OUT = "runs/compare"
#: `make demo`: the paper grid on the default data, with the zero-shot benchmarks, in well under 10
#: minutes on 2 cores. One thread: two threads on two cores slow down 2-40x as soon as anything else
#: runs. --sim-step-time pins the link clock, so the link columns do not depend on machine load either.
DEMO_ARGV = ["--out", "runs/demo", "--steps", "200", "--sim-step-time", "0.06", "--threads", "1",
             "--eval-tasks", "hellaswag,piqa,arc_easy", "--eval-limit", "100"]
DEFAULT_SWEEP_H = "10,20,50"

#: TrainConfig fields that do not change a run's numbers: a cached run is reused across them.
_CACHE_IGNORED = {"out", "progress", "resume", "checkpoint_every", "keep_checkpoints", "tokens"}
#: Flags that choose the method; in compare the grid entry does.
_PER_ENTRY_FLAGS = ("method", "fragments", "overlap_steps", "eager_rounds")


def grid_help(sep: str = "; ") -> str:
    return sep.join(f"{e.name} ({e.label})" for e in ENTRIES.values())


def resolve_grid(spec: str) -> list[GridEntry]:
    """'paper', 'all', or a comma list of entry names, labels without commas, or those two grids."""
    by_label = {e.label.lower(): e for e in ENTRIES.values()}
    chosen: list[GridEntry] = []
    unknown = []
    for raw in spec.split(","):
        name = raw.strip()
        if name in GRIDS:
            found = [ENTRIES[n] for n in GRIDS[name]]
        else:
            one = ENTRIES.get(name) or by_label.get(name.lower())
            found = [one] if one is not None else []
        if not found:
            unknown.append(name)
        chosen += [e for e in found if e not in chosen]
    if unknown or not chosen:
        bad = ", ".join(repr(u) for u in unknown) or repr(spec)
        raise ConfigError(
            f"--grid: unknown entry {bad}; pass 'paper', 'all' or a comma list of these names:\n  "
            + grid_help("\n  ")
        )
    return chosen


def tolerated_steps(outer: OuterConfig) -> int:
    """Inner steps an exchange may take before it is applied: the schedule's own number."""
    return apply_delay(outer.method, outer.inner_steps, outer.overlap_steps, outer.eager_rounds)


def tolerated_text(outer: OuterConfig, step_s: float | None) -> str:
    """'0', '1 step (0.06 s)', '1 round = 20 steps (1.20 s)': steps from the schedule, seconds on
    the link's clock (steps x mean measured step time)."""
    steps = tolerated_steps(outer)
    if steps == 0:
        return "0"
    secs = f" ({steps * step_s:.2f} s)" if step_s is not None and math.isfinite(step_s) else ""
    if outer.method in ("delayed", "eager"):
        k = outer.eager_rounds
        return f"{k} round{'s' if k != 1 else ''} = {steps} steps{secs}"
    return f"{steps} step{'s' if steps != 1 else ''}{secs}"


@dataclass
class PlannedRun:
    entry: GridEntry
    cfg: Any  # TrainConfig (imported lazily: train imports torch)
    run_dir: Path
    inner_steps: int
    in_sweep: bool = False

    @property
    def key(self) -> str:
        return self.run_dir.name


def entry_config(base: Any, entry: GridEntry, run_dir: Path, lowered_lr: float, inner_steps: int | None = None) -> Any:
    """The base TrainConfig with this entry's outer settings and its own output directory."""
    outer = {**_METHOD_FIELDS, **entry.outer}
    if entry.lowered_lr:
        outer["outer_lr"] = lowered_lr
    if inner_steps is not None:
        outer["inner_steps"] = inner_steps
    return replace(base, outer=replace(base.outer, **outer), out=str(run_dir))


def plan_runs(
    base: Any, entries: list[GridEntry], out: Path, lowered_lr: float, sweep_h: list[int] | None = None
) -> list[PlannedRun]:
    """Every run of the comparison, validated (with the model's block count) before any trains."""
    from eagerloco.model import model_config

    num_blocks = model_config(base.model).n_layers
    plans = []
    for h in sweep_h or [None]:
        for e in entries:
            name = e.name if h is None else f"H{h}-{e.name}"
            cfg = entry_config(base, e, out / "runs" / name, lowered_lr, h)
            try:
                cfg.validate()
                cfg.outer.validate(num_blocks=num_blocks)
            except ConfigError as err:
                where = f"grid entry {e.name!r}" + (f" at H = {h}" if h is not None else "")
                raise ConfigError(f"{where}: {err}") from err
            plans.append(PlannedRun(e, cfg, out / "runs" / name, cfg.outer.inner_steps, h is not None))
    return plans


def _canonical(obj: Any) -> Any:
    """JSON-comparable form of a config (inf/nan as strings, as train writes them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def _cache_view(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in _canonical(config).items() if k not in _CACHE_IGNORED}


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
    if _cache_view(saved["config"]) != _cache_view(asdict(plan.cfg)):
        return None
    return saved


def _outer_brief(cfg: Any) -> str:
    o = cfg.outer
    parts = [o.method]
    if o.method != "dp":
        parts.append(f"H={o.inner_steps}")
    if o.fragments > 1:
        parts.append(f"P={o.fragments}")
    if o.overlap_steps:
        parts.append(f"tau={o.overlap_steps}")
    if o.method in ("delayed", "eager"):
        parts.append(f"k={o.eager_rounds}")
    if o.codec != "fp32":
        parts.append(o.codec)
    parts.append(f"outer lr {o.outer_lr:g}")
    return ", ".join(parts)


def run_plans(plans: list[PlannedRun], force: bool = False) -> list[dict[str, Any]]:
    """Train (or reuse) each planned run in order, printing one line as it starts and one as it ends."""
    from eagerloco.report import fmt_bytes, fmt_cu, fmt_loss
    from eagerloco.train import train

    results = []
    for i, plan in enumerate(plans, 1):
        head = f"[{i}/{len(plans)}] {plan.entry.label}" + (f" @ H={plan.inner_steps}" if plan.in_sweep else "")
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


def _result(plan: PlannedRun, summary: dict[str, Any], cached: bool) -> dict[str, Any]:
    steps = summary.get("steps") or plan.cfg.steps
    compute = summary.get("compute_s")
    step_s = compute / steps if isinstance(compute, (int, float)) and steps else None
    kept = {k: v for k, v in summary.items() if k not in ("config", "per_worker")}
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
    }


# --------------------------------------------------------------------------------------------------
# Command line


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``compare`` subcommand; its handler is :func:`run`."""
    p = subparsers.add_parser(
        "compare",
        help="run a grid of methods on the same data, model, seed and budget; write a report",
        description=(
            "Trains every method of a grid in this process on the same data, model, seed and token "
            "budget, over the simulated link, and writes <out>/report.md (table), <out>/summary.json "
            "and plots of eval loss against steps, link wall-clock and bytes. Runs already in "
            "<out>/runs with the same settings are reused (--force retrains). "
            f"Grid entries: {grid_help()}."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The compare flags: the training flags of `train` plus the grid, sweep and report options."""
    from eagerloco.cli import _add_train_flags

    _add_train_flags(p)
    g = p.add_argument_group("comparison")
    g.add_argument("--grid", default=None,
                   help="'paper' (default: the eager paper's comparison plus data-parallel), 'all', "
                        f"or a comma list of entries: {', '.join(ENTRIES)}")
    g.add_argument("--sweep", choices=("inner-steps",), default=None,
                   help="inner-steps: run each grid entry (default: no-overlap,delayed-1,eager-1) at every H "
                        "of --inner-steps-list")
    g.add_argument("--inner-steps-list", default=None,
                   help=f"comma list of H for --sweep inner-steps (default {DEFAULT_SWEEP_H})")
    g.add_argument("--lowered-outer-lr", type=float, default=None,
                   help="outer lr of the 'lowered lr' entries (default: half the outer lr, 0.35)")
    g.add_argument("--force", action="store_true", help="retrain runs even when <out>/runs has them")
    if "--tokens" not in p._option_string_actions:  # older training flags had no --tokens
        g.add_argument("--tokens", type=int, default=None, help="token budget over all workers; sets --steps")
    if "--threads" not in p._option_string_actions:
        g.add_argument("--threads", type=int, default=None,
                       help="torch intra-op threads (default: torch's choice, one per core); 1 is far faster "
                            "when other jobs share the cores")


def _config_file_keys(path: Path | None) -> set[str]:
    """Field names the config file sets (top level, [outer], [link]); its errors are reported later."""
    if path is None or not path.is_file():
        return set()
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()
    keys = {k for k, v in raw.items() if not isinstance(v, dict)}
    for table in ("outer", "link"):
        if isinstance(raw.get(table), dict):
            keys |= set(raw[table])
    return keys


def build_base_config(args: argparse.Namespace) -> tuple[Any, Path]:
    """The shared TrainConfig of every run (defaults <- compare defaults <- file <- flags) and <out>."""
    from eagerloco.cli import build_train_config

    given = [f for f in _PER_ENTRY_FLAGS if getattr(args, f, None) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"compare: {flags} is chosen by each grid entry; pick entries with --grid "
                          f"(one of: {', '.join(ENTRIES)})")
    if getattr(args, "tokens", None) is not None and args.steps is not None:
        raise ConfigError("compare: pass either --steps or --tokens (the budget every run shares), not both")
    if getattr(args, "resume", None):
        raise ConfigError("compare: --resume is per run; compare reuses finished runs by itself (--force retrains)")
    explicit = _config_file_keys(args.config) | {k for k, v in vars(args).items() if v is not None}
    ns = argparse.Namespace(**vars(args))
    for key, value in COMPARE_DEFAULTS.items():
        if key not in explicit:
            setattr(ns, key, value)
    cfg = build_train_config(ns)
    if args.tokens is not None and not _train_has_field("tokens"):
        if args.tokens < 1:
            raise ConfigError(f"--tokens must be a positive integer token budget, got {args.tokens}")
        cfg.steps = -(-args.tokens // (cfg.batch_size * cfg.seq_len * cfg.workers))
    if "eval_every" not in explicit:
        cfg.eval_every = max(1, cfg.steps // 10)  # an eval-loss curve, not just the final point
    out = Path(args.out if args.out is not None else DEFAULT_OUT if "out" not in explicit else cfg.out)
    return cfg.validate(), out


def _train_has_field(name: str) -> bool:
    from eagerloco.train import TrainConfig

    return name in {f.name for f in fields(TrainConfig)}


def _parse_h_list(text: str) -> list[int]:
    try:
        hs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        hs = []
    if not hs or any(h < 1 for h in hs):
        raise ConfigError(f"--inner-steps-list must be a comma list of integers >= 1 (e.g. 10,20,50), got {text!r}")
    return sorted(set(hs))


def run(args: argparse.Namespace) -> int:
    """`eagerloco compare`: plan and check every run, train or reuse them, write the report."""
    from eagerloco.report import write_report

    if args.sweep is None and args.inner_steps_list is not None:
        raise ConfigError("--inner-steps-list needs --sweep inner-steps")
    sweep_h = None
    if args.sweep == "inner-steps":
        if args.inner_steps is not None:
            raise ConfigError("--sweep inner-steps takes H from --inner-steps-list, not --inner-steps")
        sweep_h = _parse_h_list(args.inner_steps_list or DEFAULT_SWEEP_H)
    default_grid = "paper" if sweep_h is None else ",".join(SWEEP_GRID)
    entries = resolve_grid(args.grid if args.grid is not None else default_grid)
    base, out = build_base_config(args)
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be an integer >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    lowered = args.lowered_outer_lr if args.lowered_outer_lr is not None else base.outer.outer_lr / 2
    if not (math.isfinite(lowered) and lowered > 0):
        raise ConfigError(f"--lowered-outer-lr must be a positive number, got {lowered}")
    plans = plan_runs(base, entries, out, lowered, sweep_h)
    link = f"{base.link.bandwidth_gbps:g} Gbit/s + {base.link.latency_ms:g} ms"
    print(f"compare: {len(plans)} runs of {base.steps} steps x {base.workers} workers ({base.model}, "
          f"seed {base.seed}, link {link}) -> {out}", flush=True)
    t0 = time.perf_counter()
    results = run_plans(plans, force=args.force)
    meta = {
        "kind": "sweep-inner-steps" if sweep_h else "grid",
        "grid": [e.name for e in entries],
        "sweep_inner_steps": sweep_h,
        "lowered_outer_lr": lowered,
        "base_config": asdict(base),
        "elapsed_s": time.perf_counter() - t0,
    }
    paths = write_report(out, results, meta)
    reused = sum(r["cached"] for r in results)
    print()
    print(paths["table"])
    print(f"\n{len(results) - reused} run(s) trained, {reused} reused, in {meta['elapsed_s']:.0f} s; "
          f"plots and summary.json beside the report")
    print(f"report: {paths['report']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m eagerloco.compare``) with the same error handling as the CLI."""
    import sys

    from eagerloco.data import DataError

    parser = argparse.ArgumentParser(prog="eagerloco")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, DataError) as e:
        print(f"eagerloco: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
