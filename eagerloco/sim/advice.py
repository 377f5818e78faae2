"""What ``simulate --plan`` tells a person: its assumptions, the answer as commands to copy, its measured cost
in loss, the runner-up, and whether the answer rests on an assumed step time.

A sparse answer runs with error feedback and plain averaging, as SparseLoCo and the committed comparison did.
The measured costs are copied from ``bench/results`` (an installed package has none); a test checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagerloco.config import flag_name
from eagerloco.sim.plan import describe, plan_tables

#: The error-feedback decay of a top-k exchange (SparseLoCo's).
SPARSE_ERROR_FEEDBACK = 0.95
#: How much a plan's step time may be off: the answer is checked at the step time times each of these.
STEP_TIME_FACTORS = (0.5, 2.0)


@dataclass(frozen=True)
class Measured:
    """A row of a committed comparison: final eval loss minus DiLoCo's in FP32 (no overlap), paired by seed,
    mean and 90% interval in nats (tiny GPT of 0.92M parameters, 2 workers, 400 steps, 3 seeds)."""

    source: str  # the directory under bench/results
    row: str  # the row's name in its summary.json
    label: str
    mean: float
    lo: float
    hi: float
    outer_lr: float | None = None  # the outer lr the comparison tuned for it (sparse rows: plain averaging)


#: (family of the plan, exchange format) -> what was measured for it.
MEASURED: dict[tuple[str, str], Measured] = {
    ("dp", "fp32"): Measured("compare_seeds_400", "dp", "data-parallel", -0.282, -0.457, -0.106),
    ("diloco", "e2m1"): Measured("compression", "no-overlap-4bit", "DiLoCo, e2m1", -0.004, -0.018, 0.009),
    ("streaming-tau", "fp32"): Measured("compare_seeds_400", "overlap-1", "1-inner-step overlap, P=1",
                                        0.025, -0.059, 0.109),
    ("eager", "fp32"): Measured("compare_seeds_400", "eager-1", "1-outer-step eager", 0.140, 0.125, 0.155),
    ("eager", "e2m1"): Measured("compare_seeds_400", "eager-1-4bit", "1-outer-step eager, e2m1",
                                0.154, 0.122, 0.186),
    ("diloco", "2bit top1024/4096"): Measured("compression", "sparseloco-25", "SparseLoCo 25%",
                                              -0.143, -0.203, -0.083, 1.0),
    ("diloco", "2bit top256/4096"): Measured("compression", "sparseloco-6", "SparseLoCo 6%",
                                             -0.082, -0.122, -0.041, 1.5),
    ("diloco", "2bit top64/4096"): Measured("compression", "sparseloco-1.5", "SparseLoCo 1.5%",
                                            0.014, -0.009, 0.037, 1.5),
    ("streaming", "2bit top64/4096"): Measured("compression", "streaming-2-sparseloco-1.5",
                                               "streaming P=2, SparseLoCo 1.5%", 0.020, -0.029, 0.070, 2.0),
    ("eager", "2bit top64/4096"): Measured("compression", "eager-1-sparseloco-1.5", "eager, SparseLoCo 1.5%",
                                           0.148, 0.116, 0.180, 1.5),
}


def measured_for(row: dict[str, Any]) -> tuple[str, Measured] | None:
    """The format measured for this row's method and its measurement: the row's own, or for a dense one the nearest
    measured (e2m1, then fp32); None when nothing comparable ran."""
    formats = [row["format"]] if row["topk"] is not None else [row["format"], "e2m1", "fp32"]
    return next(((f, MEASURED[(row["family"], f)]) for f in formats if (row["family"], f) in MEASURED), None)


#: (family, format) -> the shared support in the tuned Pareto at M = 8 (bench/results/many_workers.md): its final eval
#: loss minus FP32 DiLoCo's on Brown, paired by seed over 3 seeds, mean and 90% interval, each at its tuned outer lr
#: (this row's), and the error-feedback decay it ran with (a drawn support sends a value every few rounds: the
#: 0.95 of top-k keeps too much stale error).
SHARED_MEASURED: dict[tuple[str, str], tuple[float, float, float, float, float]] = {
    ("diloco", "2bit shared1024/4096"): (-0.067, -0.141, 0.007, 2.0, 0.6),
    ("diloco", "2bit shared512/4096"): (-0.065, -0.15, 0.021, 5.0, 0.4),
    ("diloco", "2bit shared256/4096"): (-0.071, -0.179, 0.037, 10.0, 0.2),
}


def measured_note(row: dict[str, Any]) -> str:
    """One line: the measured loss cost of the row's setting, or that none was measured."""
    shared = SHARED_MEASURED.get((row["family"], row["format"]))
    if shared is not None:
        return (f"measured loss cost: {shared[0]:+.3f} nats [{shared[1]:+.3f}, {shared[2]:+.3f}] against DiLoCo in "
                "fp32, both tuned (tiny GPT, 8 workers, 200 steps, 3 seeds, Brown; at DiLoCo's loss on the KJV too: "
                "bench/results/many_workers.md)")
    found = measured_for(row)
    if found is None:
        return "measured loss cost: none in bench/results for this method and format"
    fmt, m = found
    other = f", measured with {fmt}" if fmt != row["format"] else ""
    return (f"measured loss cost: {m.mean:+.3f} nats [{m.lo:+.3f}, {m.hi:+.3f}] against DiLoCo in fp32 "
            f"({m.label}{other}; tiny GPT, 2 workers, 3 seeds: bench/results/{m.source})")


def settings(row: dict[str, Any]) -> dict[str, Any]:
    """The row as train's settings (OuterConfig's names; the link and workers too), with what its format needs."""
    out: dict[str, Any] = {"method": row["method"]}
    if row["family"] != "dp":
        out["inner_steps"] = row["inner_steps"]
        if row["fragments"] > 1:
            out["fragments"] = row["fragments"]
        if row["tau"]:
            out["overlap_steps"] = row["tau"]
        if row["eager_rounds"] > 1:
            out["eager_rounds"] = row["eager_rounds"]
    out["codec"] = row["codec"]
    if row.get("transport", "allgather") != "allgather":
        out["transport"] = row["transport"]
    if row["topk"] is not None:
        found = measured_for(row)
        # The decay and outer lr follow the support's density, whichever method (measured with DiLoCo).
        shared = next((v for (_, fmt), v in SHARED_MEASURED.items() if fmt == row["format"]), None)
        lr = found[1].outer_lr if found is not None else shared[3] if shared is not None else None
        beta = shared[4] if shared is not None else SPARSE_ERROR_FEEDBACK
        out.update(topk=row["topk"], topk_chunk=row["topk_chunk"], error_feedback=beta, outer_optimizer="average",
                   outer_lr=lr or 1.0)
    if row["adaptive_steps"]:
        out["adaptive_steps"] = True
    return out


def _flag(name: str, value: Any) -> str:
    flag = flag_name(name)
    return flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def train_command(row: dict[str, Any], report: dict[str, Any]) -> str:
    """``eagerloco train`` with the row's settings on the emulated link of the plan (and its speeds)."""
    link: dict[str, Any] = {"workers": report["workers"], "bandwidth_gbps": float(report["bandwidth_gbps"])}
    if report["latency_ms"]:
        link["latency_ms"] = float(report["latency_ms"])
    words = [_flag(k, v) for k, v in {**settings(row), **link}.items()]
    if report["worker_speeds"] is not None:
        words.append("--worker-speeds " + ",".join(f"{v:g}" for v in report["worker_speeds"]))
    return "eagerloco train " + " ".join(words)


def outer_loop_call(row: dict[str, Any], report: dict[str, Any]) -> str:
    """The same settings as ``outer_loop``'s OuterConfig, for a training loop of one's own."""
    args = ", ".join(f"{k}={v!r}" for k, v in settings(row).items())
    return f"outer_loop(model, optimizer, OuterConfig({args}))"


def _answer(title: str, row: dict[str, Any], report: dict[str, Any]) -> list[str]:
    speeds = f" (workers: {', '.join(f'{c:.3f}' for c in row['cu_per_worker'])})" if row["cu_per_worker"] else ""
    return [f"{title}: {describe(row)}{' with adaptive steps' if row['adaptive_steps'] else ''} -> "
            f"CU {row['cu']:.3f}{speeds}",
            f"  {train_command(row, report)}",
            f"  {outer_loop_call(row, report)}",
            f"  {measured_note(row)}"]


def format_decision(report: dict[str, Any], step_source: str, shifted: dict[float, dict[str, Any] | None] | None,
                    verbose: bool = False) -> str:
    """The plan as a person reads it: the assumptions, the answer, the runner-up, a warning where the answer changes
    with an assumed step time (``shifted``), and the full tables only when ``verbose``."""
    m, best = report["model"], report["best"]
    speeds = report["worker_speeds"]
    lines = [
        f"plan for {m['name']} ({m['params']:.3g} params, {m['layers']} layers) at {report['bandwidth_gbps']:g} "
        f"Gbit/s, target CU {100 * report['target']:g}%",
        f"assumed: {report['workers']} workers (--workers), latency {report['latency_ms']:g} ms (--latency-ms), "
        + ("equal speeds (--worker-speeds)" if speeds is None
           else "speeds " + ",".join(f"{v:g}" for v in speeds) + " (--worker-speeds)")
        + f", {report['transport']} exchange (--transport)",
        f"step time: {m['step_time']:.3g} s per inner step, {step_source}",
    ]
    if best is None:
        top = max(report["candidates"], key=lambda r: r["cu"])
        lines.append(f"no candidate reaches the target; the best reaches CU {top['cu']:.3f} ({describe(top)}): "
                     "lower --target-cu, or plan a faster link")
    else:
        lines += _answer("recommended", best, report)
        if report["runner_up"] is not None:
            lines += _answer("runner-up", report["runner_up"], report)
        lines.append("  (train builds its own --model, tiny by default, where outer_loop takes yours; "
                     "--bandwidth-gbps, --latency-ms and --worker-speeds emulate the link and the speeds: "
                     "leave them out on real ones)")
    if shifted and best is not None:
        other = {f: r for f, r in shifted.items() if r is None or describe(r) != describe(best)}
        if other:
            at = "; ".join(f"at {f * m['step_time']:.3g} s: {describe(r) if r else 'none reaches the target'}"
                           for f, r in other.items())
            lines.append(f"warning: the answer depends on the assumed step time ({at}); measure an inner step "
                         "and give it as --step-time")
    if verbose:
        lines += plan_tables(report)
    else:
        lines.append(f"(every format's cheapest and all {len(report['candidates'])} candidates: --verbose)")
    return "\n".join(lines)
