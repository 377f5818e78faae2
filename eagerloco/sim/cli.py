"""``eagerloco simulate``: compute utilization of each method on a given link, before paying for a run.

Entry points for the main console script::

    add_parser(subparsers)  # registers "simulate" and set_defaults(func=run)
    run(args) -> int        # exit code: 0, or 2 with a message naming the bad flag

Everything printed is also in the report dictionary that ``--json`` writes.
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

from eagerloco.codecs import SCALE_BYTES
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import (
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
from eagerloco.sim.search import bandwidth_grid, least_bandwidth, meets

DEFAULT_TARGETS = "0.5,0.8,0.9,0.95,0.99"


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
    m.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilization for --accel-tflops")
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
    a.add_argument("--workers", "-M", type=int, default=2, help="workers M across the slow link")
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
    c.add_argument("--bits", type=int, default=32, help="bits per value of outer gradients")
    c.add_argument("--low-bits", type=int, default=4, help="bits of the extra quantized Streaming row")
    c.add_argument("--dp-bits", type=int, default=16, help="bits per gradient value for data-parallel")
    c.add_argument("--block", type=int, default=32, help="values per scale block for formats below 16 bits")
    c.add_argument("--scale-bytes", type=int, default=SCALE_BYTES,
                   help="bytes per block scale below 16 bits (default: what the codecs store)")
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
    s.add_argument("--warmup-rounds", type=int, default=8, help="rounds simulated before measuring")
    s.add_argument("--rounds", type=int, default=32, help="rounds measured")
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
            step = flops_step_time(model.params, args.tokens_per_step, args.accel_tflops, args.mfu)
            model = with_name(model, step_time=step)
        models.append(model)

    _at_least("--workers", args.workers, 1)
    _at_least("--inner-steps", args.inner_steps, 1)
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
    _at_least("--rounds", args.rounds, 1)
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
        rounds=args.rounds,
        tokens_per_step=args.tokens_per_step,
        tokens=args.tokens,
    )
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
    grid = bandwidth_grid(s.bw_min, s.bw_max, s.per_decade)
    lanes = np.concatenate([grid, np.asarray(s.bandwidths, dtype=float), [math.inf]])
    curves: dict[str, list[tuple[str, np.ndarray]]] = {}
    out_models = []
    for model in s.models:
        P = s.fragments_for(model)
        dp_bytes_per_step = None
        rows = []
        curves[model.name] = []
        for v in s.variants:
            tr = traffic(model, v, s.workers, s.inner_steps, P, s.block, s.scale_bytes, s.transport)
            res = simulate(model, v, tr, lanes, s.latency_ms, s.inner_steps, s.warmup_rounds, s.rounds)
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
                    "least_bandwidth_gbps": {_key(t): least_bandwidth(grid, cu_grid, t) for t in s.targets},
                    "cu_at_bandwidth": {_key(b): float(c) for b, c in zip(s.bandwidths, cu_bw, strict=True)},
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
            "tokens_per_step": s.tokens_per_step,
            "tokens": s.tokens,
        },
        "grid": {"min_gbps": s.bw_min, "max_gbps": s.bw_max, "per_decade": s.per_decade, "points": len(grid)},
        "models": out_models,
        "notes": s.notes,
    }
    return report, curves, grid


def jsonable(x: Any) -> Any:
    """The report with infinite floats as the string "inf", so the JSON is strict."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def _key(x: float) -> str:
    return "inf" if math.isinf(x) else repr(float(x))


# ------------------------------------------------------------------------------------------- format


def _fmt_bw(x: float | None, cu_inf: float, target: float, bw_max: float) -> str:
    if x is not None:
        return f"{x:.3g}"
    return f">{bw_max:g}" if bool(meets(cu_inf, target)) else "never"


def _fmt_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.4g}"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} B"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for n, r in enumerate([header, *rows]):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_text(report: dict[str, Any]) -> str:
    """The tables a person reads; every number in them is in the report."""
    st = report["settings"]
    g = report["grid"]
    parts = []
    for m in report["models"]:
        mod = m["model"]
        counts = sorted(set(m["fragment_layer_counts"]))
        parts.append(
            f"model {mod['name']}: {_fmt_count(mod['params'])} params, {mod['layers']} layers, "
            f"step {mod['step_time']:.3g} s; M={st['workers']}, H={st['inner_steps']}, "
            f"P={m['fragments']} fragments of {'/'.join(map(str, counts))} layers, "
            f"latency {st['latency_ms']:g} ms, {st['transport']} exchange"
        )
        if st["targets"]:
            header = ["Gbit/s to reach CU"] + [f"{100 * t:g}%" for t in st["targets"]]
            rows = [
                [r["label"]]
                + [
                    _fmt_bw(
                        r["least_bandwidth_gbps"][_key(t)], r["cu_at_infinite_bandwidth"], t, g["max_gbps"]
                    )
                    for t in st["targets"]
                ]
                for r in m["rows"]
            ]
            parts.append(_table(header, rows))
        if st["bandwidths_gbps"]:
            header = ["CU at Gbit/s"] + [f"{b:g}" for b in st["bandwidths_gbps"]]
            rows = [[r["label"]] + [f"{c:.4f}" for c in r["cu_at_bandwidth"].values()] for r in m["rows"]]
            parts.append(_table(header, rows))
        header = [
            "bytes per worker",
            "per token",
            "dp / this",
            "peak transfer",
            f"at {st['tokens']:.3g} tokens",
        ]
        rows = [
            [
                r["label"],
                f"{r['bytes_per_token']:.4g}",
                "-" if r["dp_ratio"] is None else f"{r['dp_ratio']:.1f}x",
                _fmt_bytes(r["peak_transfer_bytes"]),
                _fmt_bytes(r["total_bytes"]),
            ]
            for r in m["rows"]
        ]
        parts.append(_table(header, rows))
        parts.append("")
    parts.append(
        f"grid {g['min_gbps']:g}..{g['max_gbps']:g} Gbit/s, {g['per_decade']} points per decade; "
        f"CU over {st['rounds']} rounds after {st['warmup_rounds']} of warm-up; "
        f"{st['tokens_per_step']:.4g} tokens per worker per step"
        + (f"; simulated in {report['seconds']:.2f} s" if "seconds" in report else "")
    )
    parts.extend(f"note: {n}" for n in report["notes"])
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Simulate, print the tables, and write --json / --plot outputs; 2 on invalid input."""
    started = time.perf_counter()
    try:
        settings = settings_from_args(args)
        if args.plot is not None and Path(args.plot).exists() and not Path(args.plot).is_dir():
            raise SimError(f"--plot must name a directory, {args.plot!r} is a file")
    except SimError as e:
        print(f"eagerloco simulate: error: {e}", file=sys.stderr)
        return 2
    report, curves, grid = compute(settings)
    text_out = sys.stderr if args.json == "-" else sys.stdout
    if args.plot is not None:
        from eagerloco.sim.plot import plot_cu

        written = []
        for m in report["models"]:
            name = m["model"]["name"]
            title = (
                f"{name}: {_fmt_count(m['model']['params'])} params, step {m['model']['step_time']:.3g} s, "
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
    if args.json is not None:
        data = json.dumps(jsonable(report), indent=2, allow_nan=False)
        if args.json == "-":
            print(data)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(data + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m eagerloco.sim``) until the main CLI wires the subcommand in."""
    parser = argparse.ArgumentParser(prog="eagerloco")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))
