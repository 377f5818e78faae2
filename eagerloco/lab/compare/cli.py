"""`eagerloco compare`: its flags and the command, from the plan to the report."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.extras import check
from eagerloco.flags import add_train_flags
from eagerloco.lab.compare.grid import DEFAULT_SWEEP_H, ENTRIES, SWEEP_GRID, grid_help, resolve_grid
from eagerloco.lab.compare.runner import build_base_config, plan_runs, print_done, run_plans
from eagerloco.lab.compare.seeded import TUNE_SEED_OFFSET, mark_divergence, run_seeded
from eagerloco.lab.compare.tune import parse_tune


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
    add_train_flags(p)
    g = p.add_argument_group("comparison")
    g.add_argument("--grid", default=None,
                   help="'paper' (default: the eager paper's comparison plus data-parallel), 'all', 'baselines', "
                        "'compression' (bench/results/compression), 'compression-best' (its two best beside DiLoCo), "
                        f"or a comma list of entries: {', '.join(ENTRIES)}")
    g.add_argument("--sweep", choices=("inner-steps",), default=None,
                   help="inner-steps: run each grid entry (default: no-overlap,delayed-1,eager-1) at every H "
                        "of --inner-steps-list")
    g.add_argument("--inner-steps-list", default=None,
                   help=f"comma list of H for --sweep inner-steps (default {DEFAULT_SWEEP_H})")
    g.add_argument("--lowered-outer-lr", type=float, default=None,
                   help="outer lr of the 'lowered lr' entries (default: half the outer lr, 0.35)")
    g.add_argument("--force", action="store_true", help="retrain runs even when <out>/runs has them")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice, one per core); 1 is far faster "
                        "when other jobs share the cores")
    g = p.add_argument_group("seeds and tuning")
    g.add_argument("--seeds", type=int, default=None,
                   help="run every grid entry with N seeds (--seed, --seed + 1, ...; each sets the data split and "
                        "order, the initialization and the worker shards); the report gives the mean and a 90%% t "
                        "interval of the final eval loss and of the difference to no overlap, paired by seed, and "
                        "adds the baselines (data-parallel, a single worker, plain averaging)")
    g.add_argument("--tune", action="append", default=None, metavar="KEY=V1,V2,...",
                   help="sweep a setting per method on a tuning seed and run the seeded comparison at each method's "
                        "best (lowest held-out loss), e.g. --tune outer_lr=0.2,0.35,0.5,0.7,1.0; repeatable (the "
                        "product of the values is swept); entries that fix the setting (data-parallel, plain "
                        "averaging, the lowered-lr rows) are not swept")
    g.add_argument("--tune-seed", type=int, default=None,
                   help=f"seed of the tuning sweep (default --seed + {TUNE_SEED_OFFSET}, a seed the comparison "
                        "does not report)")
    g.add_argument("--tuned-from", default=None, metavar="DIR",
                   help="run each entry at the setting a finished --tune comparison in DIR chose for it (by entry "
                        "name), e.g. a --sweep inner-steps at the outer lr tuned at the base H")


def _parse_h_list(text: str) -> list[int]:
    try:
        hs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        hs = []
    if not hs or any(h < 1 for h in hs):
        raise ConfigError(f"--inner-steps-list must be a comma list of integers >= 1 (e.g. 10,20,50), got {text!r}")
    return sorted(set(hs))


def prepare(args: argparse.Namespace) -> tuple[TrainConfig, Path, float]:
    """The checked base configuration, output directory and lowered-lr outer lr; ConfigError for a bad setting."""
    base, out = build_base_config(args)
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be an integer >= 1, got {threads}")
    lowered = args.lowered_outer_lr if args.lowered_outer_lr is not None else base.outer.outer_lr / 2
    if not (math.isfinite(lowered) and lowered > 0):
        raise ConfigError(f"--lowered-outer-lr must be a positive number, got {lowered}")
    return base, out, lowered


def use_threads(args: argparse.Namespace) -> None:
    """Give torch the intra-op threads of --threads (checked by :func:`prepare`), if given."""
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)


def run(args: argparse.Namespace) -> int:
    """`eagerloco compare`: plan and check every run, train or reuse them, write the report."""
    from eagerloco.lab.compare.report import PLOT_NEEDS, write_report

    check("matplotlib", PLOT_NEEDS)  # the report's plots: refused before training, not after
    if args.sweep is None and args.inner_steps_list is not None:
        raise ConfigError("--inner-steps-list needs --sweep inner-steps")
    sweep_h = None
    if args.sweep == "inner-steps":
        if args.inner_steps is not None:
            raise ConfigError("--sweep inner-steps takes H from --inner-steps-list, not --inner-steps")
        sweep_h = _parse_h_list(args.inner_steps_list or DEFAULT_SWEEP_H)
    default_grid = "paper" if sweep_h is None else ",".join(SWEEP_GRID)
    entries = resolve_grid(args.grid if args.grid is not None else default_grid)
    seeds = getattr(args, "seeds", None)
    if seeds is not None and (isinstance(seeds, bool) or seeds < 1):
        raise ConfigError(f"--seeds must be an integer >= 1, got {seeds}")
    axes = parse_tune(getattr(args, "tune", None) or [])
    if getattr(args, "tune_seed", None) is not None and not axes:
        raise ConfigError("--tune-seed needs --tune")
    if getattr(args, "tune_seed", None) is not None and args.tune_seed < 0:
        raise ConfigError(f"--tune-seed must be an integer >= 0, got {args.tune_seed}")
    base, out, lowered = prepare(args)
    use_threads(args)
    if seeds is not None or axes or getattr(args, "tuned_from", None) is not None:
        return run_seeded(args, entries, base, out, lowered, sweep_h, axes)
    plans = plan_runs(base, entries, out, lowered, sweep_h)
    link = f"{base.link.bandwidth_gbps:g} Gbit/s + {base.link.latency_ms:g} ms"
    print(f"compare: {len(plans)} runs of {base.steps} steps x {base.workers} workers ({base.model}, "
          f"seed {base.seed}, link {link}) -> {out}", flush=True)
    t0 = time.perf_counter()
    results = run_plans(plans, force=args.force)
    mark_divergence(results, plans)
    meta = {
        "kind": "sweep-inner-steps" if sweep_h else "grid",
        "grid": [e.name for e in entries],
        "sweep_inner_steps": sweep_h,
        "lowered_outer_lr": lowered,
        "base_config": asdict(base),
        "elapsed_s": time.perf_counter() - t0,
    }
    paths = write_report(out, results, meta)
    print()
    print(paths["table"])
    print_done(results, meta["elapsed_s"], paths["report"])
    return 0
