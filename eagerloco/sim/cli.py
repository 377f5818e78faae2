"""``eagerloco simulate``: compute utilization of each method on a given link, before paying for a run.

Entry points for the main console script::

    add_parser(subparsers)  # registers "simulate" and set_defaults(func=run)
    run(args) -> int        # exit code: 0, or 2 with a message naming the bad flag

Modes: the default tables (least bandwidth per target, utilization per bandwidth, bytes);
``--paper`` (the papers' accounting, printed with the table); ``--paper --compare-reference``
(ours beside the papers' published tables, cell by cell); ``--plan`` (the cheapest settings that
reach ``--target-cu`` at ``--bandwidth-gbps``). Everything printed is also in the report
dictionary that ``--json`` writes. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagerloco.codec_sizes import SCALE_BYTES
from eagerloco.sim import paper
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import (
    PATTERNS,
    PRESETS,
    ModelSpec,
    SimError,
    Variant,
    default_variants,
    flops_step_time,
    fragment_count,
    fragment_layer_counts,
    select_variants,
    traffic,
    with_name,
)
from eagerloco.sim.report import cell_key, format_text, jsonable
from eagerloco.sim.search import bandwidth_grid, least_bandwidth

__all__ = ["add_arguments", "add_parser", "compute", "format_text", "jsonable", "main", "run", "settings_from_args"]

DEFAULT_TARGETS = "0.5,0.8,0.9,0.95,0.99"
MAX_INNER_STEPS = 100_000
MAX_ROUNDS_IN_FLIGHT = 64


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``simulate`` subcommand with all its flags; its handler is :func:`run`."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate compute utilization of each method against link bandwidth",
        description=(
            "Event simulation of each method's schedule (the same one training uses) on a link that "
            "carries one transfer at a time. Reports compute utilization = compute time / wall time "
            "over a long run, the least bandwidth reaching each target, and bytes per token."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The simulate flags (separate from add_parser so a standalone parser can reuse them)."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="1b,10b,100b",
        help=f"comma list of presets ({', '.join(PRESETS)}) or 'custom' (needs --params and --layers)",
    )
    m.add_argument("--params", type=float, help="parameter count (custom model, or override a preset)")
    m.add_argument("--layers", type=int, help="transformer blocks (custom model, or override a preset)")
    m.add_argument("--step-time", type=float, help="seconds per inner step (forward + backward)")
    m.add_argument(
        "--accel-tflops",
        type=float,
        help="derive the step time as 6*params*tokens / (TFLOP/s of one worker * --mfu)",
    )
    m.add_argument(
        "--mfu",
        type=float,
        help="model FLOPs utilization: with --accel-tflops (default 0.6) it sets the step time; for a "
        "preset it rescales the preset's step time (stated at 0.6) by 0.6 / MFU",
    )
    m.add_argument(
        "--tokens-per-step",
        type=float,
        default=float(2**20),
        help="tokens one worker processes per inner step (step time from FLOPs; bytes per token)",
    )
    a = p.add_argument_group("method")
    a.add_argument(
        "--method",
        help="comma list of methods (dp, diloco, streaming, delayed, eager) or row keys; default: all rows",
    )
    a.add_argument("--workers", "-M", type=int, help="workers M across the slow link (default 2)")
    a.add_argument("--inner-steps", "-H", type=int, default=100, help="inner steps per round H")
    a.add_argument("--fragment-layers", type=int, default=3, help="blocks per streaming fragment")
    a.add_argument(
        "--fragments", type=int, help="number of streaming fragments P (overrides --fragment-layers)"
    )
    a.add_argument("--tau", default="1", help="comma list of streaming overlaps tau (inner steps)")
    a.add_argument("--eager-rounds", default="1,2", help="comma list of k for eager (rounds tolerated)")
    a.add_argument("--delayed-rounds", default="1", help="comma list of k for naive delayed")
    a.add_argument(
        "--eager-streaming",
        action="store_true",
        help="delayed/eager rows exchange the streaming fragments instead of the whole model",
    )
    c = p.add_argument_group("exchange")
    c.add_argument("--bits", type=int, help="bits per value of outer gradients (default 32; 16 with --paper)")
    c.add_argument("--low-bits", type=int, default=4, help="bits of the extra quantized Streaming row")
    c.add_argument("--dp-bits", type=int, default=16, help="bits per gradient value for data-parallel")
    c.add_argument("--pattern", choices=PATTERNS, default="strided", help="blocks of each streaming fragment")
    c.add_argument("--block", type=int, default=32, help="values per scale block for formats below 16 bits")
    c.add_argument("--scale-bytes", type=int,
                   help=f"bytes per block scale below 16 bits (default: {SCALE_BYTES}, what the codecs "
                   "store; 0 with --paper)")
    c.add_argument(
        "--transport",
        choices=("ring", "allgather"),
        default="ring",
        help="ring: 2(M-1)/M of the payload per worker; allgather: (M-1) payloads for quantized "
        "outer gradients, as the runtime sends them to keep FP32 sums",
    )
    n = p.add_argument_group("link")
    n.add_argument(
        "--bandwidth-gbps", "--bandwidth", dest="bandwidth_gbps", help="comma list of Gbit/s to report"
    )
    n.add_argument("--latency-ms", type=float, default=0.0, help="latency added to every transfer")
    s = p.add_argument_group("search and output")
    s.add_argument("--target-cu", help=f"comma list of utilization targets in (0, 1], e.g. {DEFAULT_TARGETS}")
    s.add_argument("--bw-min", type=float, default=1e-3, help="lowest bandwidth of the grid (Gbit/s)")
    s.add_argument("--bw-max", type=float, default=1e5, help="highest bandwidth of the grid (Gbit/s)")
    s.add_argument("--grid-per-decade", type=int, default=100, help="grid points per factor of 10")
    s.add_argument("--warmup-rounds", type=int, default=8, help="steady state: rounds simulated before measuring")
    s.add_argument("--measure-rounds", type=int, default=32, help="steady state: rounds measured")
    s.add_argument(
        "--rounds",
        type=int,
        help="measure a short run of N rounds from a cold start instead of the steady state "
        "(exchanges still in flight at the end are not waited for)",
    )
    s.add_argument("--paper", action="store_true",
                   help="the papers' accounting: 16-bit outer gradients, FP4 without scale bytes, M=2, "
                   "ring, no latency, their bandwidth grid (printed with the result)")
    s.add_argument("--compare-reference", action="store_true",
                   help="with --paper: ours beside the papers' published tables, ratio per cell")
    s.add_argument("--plan", action="store_true",
                   help="the cheapest settings reaching --target-cu at --bandwidth-gbps (one model)")
    s.add_argument("--tokens", type=float, default=25e9, help="training tokens for the total-bytes column")
    s.add_argument("--plot", metavar="DIR", help="write cu_<model>.png per model to DIR")
    s.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH ('-': stdout)")


# ----------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Validated inputs of one simulate invocation."""

    models: list[ModelSpec]
    variants: list[Variant]
    dp_bits: int
    workers: int
    inner_steps: int
    fragment_layers: int
    fragments: int | None
    block: int
    scale_bytes: int
    transport: str
    latency_ms: float
    bandwidths: list[float]
    targets: list[float]
    bw_min: float
    bw_max: float
    per_decade: int
    warmup_rounds: int
    rounds: int
    tokens_per_step: float
    tokens: float
    pattern: str = "strided"
    cold_rounds: int | None = None
    paper: bool = False
    grid: np.ndarray | None = None  # explicit grid (--paper), else bw_min..bw_max per_decade
    notes: list[str] = field(default_factory=list)

    def fragments_for(self, model: ModelSpec) -> int:
        return (
            self.fragments
            if self.fragments is not None
            else fragment_count(model.layers, self.fragment_layers)
        )


def _split(flag: str, text: str | None) -> list[str]:
    if text is None:
        return []
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise SimError(f"{flag} needs at least one value, got {text!r}")
    return items


def _floats(flag: str, text: str | None) -> list[float]:
    out = []
    for x in _split(flag, text):
        try:
            out.append(float(x))
        except ValueError:
            raise SimError(f"{flag} takes numbers separated by commas, got {x!r}") from None
    return out


def _ints(flag: str, text: str | None, low: int) -> list[int]:
    out = []
    for x in _split(flag, text):
        try:
            v = int(x)
        except ValueError:
            raise SimError(f"{flag} takes integers separated by commas, got {x!r}") from None
        if v < low:
            raise SimError(f"{flag} values must be integers >= {low}, got {v}")
        out.append(v)
    return out


def _positive(flag: str, v: float | None, allow_inf: bool = False) -> None:
    if v is None:
        return
    if math.isnan(v) or v <= 0 or (math.isinf(v) and not allow_inf):
        raise SimError(
            f"{flag} must be a positive {'number (inf allowed)' if allow_inf else 'finite number'}, got {v}"
        )


def _at_least(flag: str, v: int | None, low: int) -> None:
    if v is not None and v < low:
        raise SimError(f"{flag} must be an integer >= {low}, got {v}")


def _bits(flag: str, v: int) -> None:
    if not 1 <= v <= 32:
        raise SimError(f"{flag} must be a number of bits per value in 1..32 (e.g. 32, 16, 8, 4), got {v}")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Check every flag; raise SimError naming the first bad one."""
    names = [x.lower() for x in _split("--model", args.model)]
    for name in names:
        if name not in PRESETS and name != "custom":
            raise SimError(f"--model: unknown preset {name!r}; choose from {', '.join(PRESETS)} or custom")
    _positive("--params", args.params)
    _at_least("--layers", args.layers, 1)
    _positive("--step-time", args.step_time)
    _positive("--tokens-per-step", args.tokens_per_step)
    overrides = {
        k: v
        for k, v in (("params", args.params), ("layers", args.layers), ("step_time", args.step_time))
        if v is not None
    }
    if args.accel_tflops is not None and args.step_time is not None:
        raise SimError("--step-time and --accel-tflops both set the step time; give one of them")
    if (overrides or args.accel_tflops is not None) and len(names) != 1:
        raise SimError(
            "--params/--layers/--step-time/--accel-tflops describe one model; give a single --model "
            f"(got {args.model!r})"
        )
    models = []
    for name in names:
        if name == "custom":
            if args.params is None or args.layers is None:
                raise SimError("--model custom needs --params and --layers")
            if args.step_time is None and args.accel_tflops is None:
                raise SimError(
                    "--model custom needs --step-time, or --accel-tflops (with --mfu, --tokens-per-step)"
                )
            model = ModelSpec("custom", args.params, args.layers, args.step_time or 0.0)
        else:
            model = with_name(PRESETS[name], **overrides)
        if args.accel_tflops is not None:
            mfu = paper.PRESET_MFU if args.mfu is None else args.mfu
            step = flops_step_time(model.params, args.tokens_per_step, args.accel_tflops, mfu)
            model = with_name(model, step_time=step)
        elif args.mfu is not None and name != "custom" and args.step_time is None:
            if not 0 < args.mfu <= 1:
                raise SimError(f"--mfu must be in (0, 1], got {args.mfu}")
            model = with_name(model, step_time=model.step_time * paper.PRESET_MFU / args.mfu)
        models.append(model)
    if args.compare_reference and not args.paper:
        raise SimError("--compare-reference compares with the papers' accounting: add --paper")
    # --paper only changes defaults: a flag given explicitly still wins.
    bits = args.bits if args.bits is not None else (paper.PAPER_BITS if args.paper else 32)
    scale_bytes = args.scale_bytes if args.scale_bytes is not None else (0 if args.paper else SCALE_BYTES)
    workers = args.workers if args.workers is not None else paper.PAPER_WORKERS
    args = argparse.Namespace(**{**vars(args), "bits": bits, "scale_bytes": scale_bytes, "workers": workers})

    _at_least("--workers", args.workers, 1)
    _at_least("--inner-steps", args.inner_steps, 1)
    if args.inner_steps > MAX_INNER_STEPS:
        raise SimError(f"--inner-steps must be at most {MAX_INNER_STEPS:,} (the papers use 30 to 500; the "
                       f"simulator walks whole rounds), got {args.inner_steps:,}")
    _at_least("--fragment-layers", args.fragment_layers, 1)
    _at_least("--fragments", args.fragments, 1)
    for model in models:
        if args.fragments is not None and args.fragments > model.layers:
            raise SimError(
                f"--fragments ({args.fragments}) exceeds the {model.layers} blocks of model {model.name}"
            )
    for flag in ("--bits", "--low-bits", "--dp-bits"):
        _bits(flag, getattr(args, flag[2:].replace("-", "_")))
    _at_least("--block", args.block, 1)
    _at_least("--scale-bytes", args.scale_bytes, 0)
    taus = _ints("--tau", args.tau, 0)
    eager_ks = _ints("--eager-rounds", args.eager_rounds, 1)
    delayed_ks = _ints("--delayed-rounds", args.delayed_rounds, 1)
    for flag, ks in (("--eager-rounds", eager_ks), ("--delayed-rounds", delayed_ks)):
        if max(ks) > MAX_ROUNDS_IN_FLIGHT:
            raise SimError(f"{flag} values must be at most {MAX_ROUNDS_IN_FLIGHT} (rounds an exchange may take; "
                           f"the papers use 1 and 2), got {max(ks):,}")
    rows = default_variants(
        bits=args.bits,
        dp_bits=args.dp_bits,
        low_bits=args.low_bits,
        taus=tuple(dict.fromkeys(taus)),
        delayed_rounds=tuple(dict.fromkeys(delayed_ks)),
        eager_rounds=tuple(dict.fromkeys(eager_ks)),
        eager_fragmented=args.eager_streaming,
    )
    wanted = [x.lower() for x in _split("--method", args.method)] if args.method is not None else None
    variants = select_variants(rows, wanted)

    bandwidths = _floats("--bandwidth-gbps", args.bandwidth_gbps)
    for b in bandwidths:
        if math.isnan(b) or b <= 0:
            raise SimError(f"--bandwidth-gbps values must be positive Gbit/s (inf allowed), got {b}")
    if math.isnan(args.latency_ms) or not math.isfinite(args.latency_ms) or args.latency_ms < 0:
        raise SimError(f"--latency-ms must be a finite number >= 0, got {args.latency_ms}")
    target_text = args.target_cu if args.target_cu is not None or bandwidths else DEFAULT_TARGETS
    targets = _floats("--target-cu", target_text)
    for t in targets:
        if not 0 < t <= 1:
            raise SimError(f"--target-cu values must be in (0, 1], got {t}")
    _positive("--bw-min", args.bw_min)
    _positive("--bw-max", args.bw_max)
    if args.bw_min >= args.bw_max:
        raise SimError(f"--bw-min ({args.bw_min}) must be below --bw-max ({args.bw_max})")
    _at_least("--grid-per-decade", args.grid_per_decade, 1)
    _at_least("--warmup-rounds", args.warmup_rounds, 0)
    _at_least("--measure-rounds", args.measure_rounds, 1)
    _at_least("--rounds", args.rounds, 1)
    if args.plan and (len(bandwidths) != 1 or len(targets) != 1 or len(models) != 1):
        raise SimError("--plan needs one --model, one --bandwidth-gbps and one --target-cu")
    _positive("--tokens", args.tokens)

    s = Settings(
        models=models,
        variants=variants,
        dp_bits=args.dp_bits,
        workers=args.workers,
        inner_steps=args.inner_steps,
        fragment_layers=args.fragment_layers,
        fragments=args.fragments,
        block=args.block,
        scale_bytes=args.scale_bytes,
        transport=args.transport,
        latency_ms=args.latency_ms,
        bandwidths=bandwidths,
        targets=targets,
        bw_min=args.bw_min,
        bw_max=args.bw_max,
        per_decade=args.grid_per_decade,
        warmup_rounds=args.warmup_rounds,
        rounds=args.measure_rounds,
        tokens_per_step=args.tokens_per_step,
        tokens=args.tokens,
        pattern=args.pattern,
        cold_rounds=args.rounds,
        paper=args.paper,
        grid=paper.paper_grid() if args.paper else None,
    )
    if args.paper:
        s.notes.extend(f"paper accounting: {a}" for a in paper.PAPER_ASSUMPTIONS)
    for model in models:
        P = s.fragments_for(model)
        for v in variants:
            if v.fragmented and v.overlap_steps and v.overlap_steps * P >= s.inner_steps:
                s.notes.append(
                    f"{model.name}: {v.label} has tau*P = {v.overlap_steps * P} >= H = {s.inner_steps}; "
                    "simulated as is, but training refuses it (exchanges of several fragments overlap)"
                )
    return s


# ------------------------------------------------------------------------------------------ compute


def compute(s: Settings) -> tuple[dict[str, Any], dict[str, list[tuple[str, np.ndarray]]], np.ndarray]:
    """Simulate every (model, row); returns the report, the CU curves per model and the grid."""
    grid = s.grid if s.grid is not None else bandwidth_grid(s.bw_min, s.bw_max, s.per_decade)
    lanes = np.concatenate([grid, np.asarray(s.bandwidths, dtype=float), [math.inf]])
    curves: dict[str, list[tuple[str, np.ndarray]]] = {}
    out_models = []
    for model in s.models:
        P = s.fragments_for(model)
        dp_bytes_per_step = None
        rows = []
        curves[model.name] = []
        for v in s.variants:
            tr = traffic(model, v, s.workers, s.inner_steps, P, s.block, s.scale_bytes, s.transport, s.pattern)
            res = simulate(
                model, v, tr, lanes, s.latency_ms, s.inner_steps, s.warmup_rounds, s.rounds, s.cold_rounds
            )
            cu_grid = res.cu[: len(grid)]
            cu_bw = res.cu[len(grid) : len(grid) + len(s.bandwidths)]
            cu_inf = float(res.cu[-1])
            curves[model.name].append((v.label, cu_grid))
            if v.method == "dp":
                dp_bytes_per_step = tr.bytes_per_step
            rows.append(
                {
                    **v.as_dict(),
                    "fragments": len(tr.transfers) if v.method != "dp" else 1,
                    "least_bandwidth_gbps": {cell_key(t): least_bandwidth(grid, cu_grid, t) for t in s.targets},
                    "cu_at_bandwidth": {cell_key(b): float(c) for b, c in zip(s.bandwidths, cu_bw, strict=True)},
                    "cu_at_infinite_bandwidth": cu_inf,
                    "bytes_per_step": tr.bytes_per_step,
                    "bytes_per_token": tr.bytes_per_step / s.tokens_per_step,
                    "peak_transfer_bytes": tr.peak_bytes,
                    "total_bytes": tr.bytes_per_step / s.tokens_per_step * s.tokens,
                }
            )
        if dp_bytes_per_step is None:  # the ratio is against data-parallel even when its row is not shown
            dp = Variant("dp", "data-parallel", "dp", s.dp_bits)
            dp_bytes_per_step = traffic(model, dp, s.workers, s.inner_steps, P).bytes_per_step
        for r in rows:
            r["dp_ratio"] = dp_bytes_per_step / r["bytes_per_step"] if r["bytes_per_step"] > 0 else None
        out_models.append(
            {
                "model": model.as_dict(),
                "fragments": P,
                "fragment_layer_counts": fragment_layer_counts(model.layers, P),
                "dp_bytes_per_token": dp_bytes_per_step / s.tokens_per_step,
                "rows": rows,
            }
        )
    report = {
        "settings": {
            "workers": s.workers,
            "inner_steps": s.inner_steps,
            "fragment_layers": s.fragment_layers,
            "fragments": s.fragments,
            "block": s.block,
            "scale_bytes": s.scale_bytes,
            "transport": s.transport,
            "latency_ms": s.latency_ms,
            "bandwidths_gbps": s.bandwidths,
            "targets": s.targets,
            "warmup_rounds": s.warmup_rounds,
            "rounds": s.rounds,
            "cold_rounds": s.cold_rounds,
            "pattern": s.pattern,
            "paper": s.paper,
            "tokens_per_step": s.tokens_per_step,
            "tokens": s.tokens,
        },
        "grid": {"min_gbps": float(grid[0]), "max_gbps": float(grid[-1]),
                 "per_decade": (len(grid) - 1) / math.log10(grid[-1] / grid[0]), "points": len(grid)},
        "models": out_models,
        "notes": s.notes,
    }
    return report, curves, grid


# ---------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Simulate, print the tables, and write --json / --plot outputs; 2 on invalid input."""
    started = time.perf_counter()
    try:
        settings = settings_from_args(args)
        if args.plot is not None and Path(args.plot).exists() and not Path(args.plot).is_dir():
            raise SimError(f"--plot must name a directory, {args.plot!r} is a file")
        if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
            raise SimError(f"--json {args.json}: the directory {Path(args.json).parent} does not exist; "
                           "create it or pick another path")
    except SimError as e:
        print(f"eagerloco simulate: error: {e}", file=sys.stderr)
        return 2
    text_out = sys.stderr if args.json == "-" else sys.stdout
    if args.compare_reference or args.plan:
        report, text = special(args, settings)
        report["seconds"] = time.perf_counter() - started
        print(text, file=text_out)
        write_json(args.json, report)
        return 0
    report, curves, grid = compute(settings)
    if args.plot is not None:
        from eagerloco.sim.plot import plot_cu

        written = []
        for m in report["models"]:
            name = m["model"]["name"]
            title = (
                f"{name}: {m['model']['params']:.3g} params, step {m['model']['step_time']:.3g} s, "
                f"M={settings.workers}, H={settings.inner_steps}, P={m['fragments']}"
            )
            safe = name.replace("*", "-custom")
            written.append(
                str(plot_cu(Path(args.plot) / f"cu_{safe}.png", title, grid, curves[name], settings.targets))
            )
        report["plots"] = written
    report["seconds"] = time.perf_counter() - started
    print(format_text(report), file=text_out)
    for path in report.get("plots", []):
        print(f"wrote {path}", file=text_out)
    write_json(args.json, report)
    return 0


def special(args: argparse.Namespace, s: Settings) -> tuple[dict[str, Any], str]:
    """--compare-reference and --plan: their report and text."""
    if args.compare_reference:
        mfu = paper.PRESET_MFU if args.mfu is None else args.mfu
        report = paper.compare(mfu, s.cold_rounds, s.pattern)
        return report, paper.format_compare(report)
    from eagerloco.sim.plan import format_plan, plan

    report = plan(s.models[0], s.bandwidths[0], s.targets[0], s.workers, s.fragment_layers, s.scale_bytes,
                  s.transport, s.latency_ms, s.pattern, s.dp_bits)
    return report, format_plan(report) + "".join(f"\nnote: {n}" for n in s.notes)


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """Write the report as strict JSON to path ('-': stdout); nothing when path is None."""
    if path is None:
        return
    data = json.dumps(jsonable(report), indent=2, allow_nan=False)
    if path == "-":
        print(data)
    else:
        Path(path).write_text(data + "\n")  # its directory was checked before simulating


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m eagerloco.sim``) until the main CLI wires the subcommand in."""
    parser = argparse.ArgumentParser(prog="eagerloco")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))
