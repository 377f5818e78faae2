"""Peer benchmark: eagerloco's outer machinery beside torchft's DiLoCo on one small workload.

Run from the repository root: ``.venv/bin/python bench/peer/run.py`` (see README.md beside it).

Every variant trains the same 0.94M-parameter GPT for the same inner steps on 2 replica processes
over gloo on loopback; the plain loop (no outer machinery, each process alone) is the reference for
overhead. Each variant runs in its own pair of fresh processes, one variant after another, and the
whole set is repeated (alternating the order) because a shared 2-core machine is noisy: the report
gives the median over repeats. Results: bench/results/peer.json and bench/results/peer.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
TORCHFT_VERSION = "0.2.0"
VARIANTS = (
    "plain",
    "torchft_diloco",
    "torchft_diloco_bucketized",
    "torchft_streaming",
    "ours_diloco",
    "ours_streaming",
    "ours_eager",
    "torchft_streaming_overlap",
    "ours_streaming_overlap",
    "floor_diloco",
    "floor_streaming",
    "floor_streaming_overlap",
)
LABELS = {
    "plain": "plain loop (no outer machinery)",
    "torchft_diloco": "torchft DiLoCo",
    "torchft_diloco_bucketized": "torchft DiLoCo, bucketized",
    "torchft_streaming": "torchft Streaming (2 fragments, bucketized)",
    "ours_diloco": "eagerloco DiLoCo",
    "ours_streaming": "eagerloco Streaming (P = 2)",
    "ours_eager": "eagerloco eager (P = 1, 1 round)",
    "torchft_streaming_overlap": "torchft Streaming, overlapped (fragment_sync_delay = tau)",
    "ours_streaming_overlap": "eagerloco Streaming (P = 2), overlapped (tau)",
    "floor_diloco": "floor: bare all-reduce, DiLoCo's bytes and steps",
    "floor_streaming": "floor: bare all-reduce, Streaming's bytes and steps",
    "floor_streaming_overlap": "floor: bare all-reduce, Streaming's, waited tau steps later",
}
#: (ours, torchft reference) pairs of the goal: ours costs at most half of torchft's bucketized overhead.
GOALS = (("ours_diloco", "torchft_diloco_bucketized"), ("ours_streaming", "torchft_streaming"),
         ("ours_streaming_overlap", "torchft_streaming_overlap"))
#: The bare exchange of each pair's schedule (same bytes, same steps, nothing else).
FLOORS = {"ours_diloco": "floor_diloco", "ours_streaming": "floor_streaming",
          "ours_streaming_overlap": "floor_streaming_overlap"}

INSTALL = f"""torchft {TORCHFT_VERSION} is not installed in this environment. Install it (CPU, keeping torch 2.13.0):

    cd {ROOT}
    .venv/bin/pip download --no-deps torchft=={TORCHFT_VERSION} -d /tmp/torchft-wheel
    .venv/bin/pip install --no-deps /tmp/torchft-wheel/torchft-{TORCHFT_VERSION}-*.whl
    .venv/bin/pip install "opentelemetry-api>=1.39" "opentelemetry-sdk>=1.39" \\
        "opentelemetry-exporter-otlp-proto-http>=1.39"

then run this again (it sets TORCHFT_USE_OTEL=false itself). Or run only eagerloco's variants:
    .venv/bin/python bench/peer/run.py --variants plain ours_diloco ours_streaming ours_eager
"""


def torchft_version() -> str | None:
    """The installed torchft's version if it imports, else None (with the reason on stderr)."""
    os.environ.setdefault("TORCHFT_USE_OTEL", "false")
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process; keep its log quiet
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as e:  # missing, or a missing dependency (opentelemetry)
        print(f"cannot import torchft: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return importlib.metadata.version("torchft")


def run_pair(variant: str, rep: int, args: argparse.Namespace, logdir: Path) -> list[dict[str, Any]]:
    """Start the replicas of one variant, wait for them, return their results (replica order)."""
    import torch.distributed as dist

    # A fresh store per run: process-group keys from an earlier run must not be seen by a later one.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    lighthouse = None
    env = dict(os.environ)
    if str(variant).startswith("torchft"):
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.replicas)
        env["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(args.replicas),
        LOCAL_WORLD_SIZE=str(args.replicas), TORCHELASTIC_USE_AGENT_STORE="True", BENCH_RUN=f"{variant}/{rep}",
        TORCHFT_USE_OTEL="false", RUST_LOG="warn", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        BENCH_OVERLAP_STEPS=str(args.overlap_steps),
    )
    procs, outs, logs = [], [], []
    for r in range(args.replicas):
        out = logdir / f"{variant}_{rep}_{r}.json"
        log = logdir / f"{variant}_{rep}_{r}.log"
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, str(WORKER), str(variant), str(r), str(args.replicas), str(args.steps),
               str(args.inner_steps), str(out)]
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env_r, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        del store
    results = []
    for p, out, log in zip(procs, outs, logs, strict=True):
        if p.returncode != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{variant} (repeat {rep}) failed with exit code {p.returncode}; log {log}:\n{tail}")
        results.append(json.loads(out.read_text()))
    return results


#: A step whose outer machinery took less than this is a plain step (no sync, no outer work).
QUIET_STEP_S = 5e-4


def inrun_rounds(step_s: list[float], outer_steps: list[float], h: int) -> list[float]:
    """Each outer round's wall time over what its steps would take without outer work, minus 1, in
    percent (see :func:`inrun_overhead_pct`)."""
    quiet = [t for t, o in zip(step_s, outer_steps, strict=True) if o < QUIET_STEP_S]
    base = statistics.median(quiet or step_s)
    return [100 * (sum(step_s[i : i + h]) / (h * base) - 1) for i in range(0, len(step_s) - h + 1, h)]


def inrun_overhead_pct(step_s: list[float], outer_steps: list[float], h: int) -> float:
    """The typical outer round's wall time over what its steps would take without outer work, minus 1,
    in percent.

    The reference is the median wall time of this same run's steps that did no outer work, so the
    machine's speed, which drifts by 10% or more between runs here, cancels out. The loop is cut into
    rounds of H steps, each holding its syncs; the median over rounds leaves out the rare hiccup
    (a descheduled process, a page-cache flush) that otherwise dominates a mean over 200 steps. Every
    cost of a sync counts: the machinery, the collective, waiting for the peer. What it cannot see is
    a slowdown of the plain steps themselves (background threads competing for the cores), so the
    report keeps the cross-run measures beside it. The plain loop's value is the estimator's own bias,
    which the report subtracts.
    """
    return statistics.median(inrun_rounds(step_s, outer_steps, h))


def summarize_run(results: list[dict[str, Any]], h: int) -> dict[str, Any]:
    """One run of a variant: the slower replica's wall time, per-worker means, and the last arriver.

    At a blocking sync the replica that arrives first also waits for the other one; on a loaded
    machine that wait is mostly noise (the peer was descheduled), not the cost of the machinery.
    Taking, at every inner step, the smaller of the replicas' times (the one that arrived last
    and waited only for the exchange itself) and summing gives the "last arriver" times.
    """

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in results)

    def last_arriver(key: str) -> float:
        return sum(min(step) for step in zip(*(r[key] for r in results), strict=True))

    out = {
        "wall_s": max(r["wall_s"] for r in results),
        "cpu_s": mean("cpu_s"),
        "outer_s": mean("outer_s"),
        "outer_last_s": last_arriver("outer_steps"),
        "blocked_s": mean("blocked_s"),
        "blocked_last_s": last_arriver("blocked_steps"),
        "bytes_sent": int(mean("bytes_sent")),
        "syncs": int(mean("syncs")),
        "train_loss_last20": mean("train_loss_last20"),
        "eval_loss": mean("eval_loss"),
    }
    out["outer_share_pct"] = 100 * out["outer_last_s"] / (out["wall_s"] - out["outer_last_s"])
    rounds = [inrun_rounds(r["wall_steps"], r["outer_steps"], h) for r in results]
    slower = max(range(len(rounds)), key=lambda i: statistics.median(rounds[i]))
    out["inrun_pct"] = statistics.median(rounds[slower])
    out["inrun_rounds"] = rounds[slower]  # the slower replica's rounds, for the confidence intervals
    out["replicas"] = [{k: v for k, v in r.items() if not k.endswith("_steps")} for r in results]
    return out


def aggregate(runs: dict[str, list[dict[str, Any]]], steps: int) -> dict[str, dict[str, Any]]:
    """Medians over repeats; overheads against the plain loop's medians."""
    keys = ("wall_s", "cpu_s", "outer_s", "outer_last_s", "blocked_s", "blocked_last_s", "outer_share_pct",
            "inrun_pct", "train_loss_last20", "eval_loss")
    table: dict[str, dict[str, Any]] = {}
    for v, rs in runs.items():
        row: dict[str, Any] = {k: statistics.median(r[k] for r in rs) for k in keys}
        syncs = rs[0]["syncs"]
        row.update(
            steps_per_s=steps / row["wall_s"],
            bytes_sent_per_worker=rs[0]["bytes_sent"],
            syncs=syncs,
            blocked_ms_per_sync=1e3 * row["blocked_s"] / syncs if syncs else 0.0,
            blocked_last_ms_per_sync=1e3 * row["blocked_last_s"] / syncs if syncs else 0.0,
            outer_last_ms_per_sync=1e3 * row["outer_last_s"] / syncs if syncs else 0.0,
            wall_s_each=[r["wall_s"] for r in rs],
        )
        table[v] = row
    if "plain" in table:
        plain = table["plain"]
        walls, cpus = plain["wall_s_each"], [r["cpu_s"] for r in runs["plain"]]
        plain["noise_pct"] = 100 * (max(walls) - min(walls)) / plain["wall_s"]
        plain["cpu_noise_pct"] = 100 * (max(cpus) - min(cpus)) / plain["cpu_s"]
        inrun = [r["inrun_pct"] for r in runs["plain"]]
        plain["inrun_noise_pct"] = max(inrun) - min(inrun)
        for row in table.values():
            row["inrun_overhead_pct"] = row["inrun_pct"] - plain["inrun_pct"]
            row["overhead_pct"] = 100 * (row["wall_s"] / plain["wall_s"] - 1)
            row["cpu_overhead_pct"] = 100 * (row["cpu_s"] / plain["cpu_s"] - 1)
    return table


#: The three ways the report measures overhead: (key in the table, how the report names it, the
#: key of the plain loop's spread across repeats that bounds what the measure can resolve).
MEASURES = (
    ("inrun_overhead_pct", "wall time vs the same run's plain steps (the goal's measure, drift-free)",
     "inrun_noise_pct"),
    ("overhead_pct", "wall time vs the plain loop's run", "noise_pct"),
    ("outer_share_pct", "outer-step time of the last arriver over the rest of the loop", None),
    ("cpu_overhead_pct", "CPU seconds vs plain", "cpu_noise_pct"),
)


def goal_checks(table: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours at most half of torchft's (bucketized) overhead, on each measure.

    Where the reference overhead is not above the plain loop's own spread across repeats, the
    noise swamped it: the check says "inconclusive" rather than pass or fail on a meaningless limit.
    """
    checks = []
    plain = table.get("plain", {})
    for ours, ref in GOALS:
        if ours not in table or ref not in table or "overhead_pct" not in table[ours]:
            continue
        c: dict[str, Any] = {"ours": ours, "reference": ref}
        for key, _, noise_key in MEASURES:
            o, t = table[ours][key], table[ref][key]
            noise = plain.get(noise_key, 0.0) if noise_key else 0.0
            verdict = "inconclusive" if t <= max(noise, 0.0) else ("PASS" if o <= t / 2 else "FAIL")
            c[key] = {"ours": o, "reference": t, "limit": t / 2, "noise": noise, "verdict": verdict}
        floor = FLOORS.get(ours)
        if floor in table and "inrun_overhead_pct" in table[floor]:
            f = table[floor]["inrun_overhead_pct"]
            c["beyond_floor"] = {"floor": floor, "floor_pct": f, "ours": table[ours]["inrun_overhead_pct"] - f,
                                 "reference": table[ref]["inrun_overhead_pct"] - f}
        checks.append(c)
    return checks


#: Resamples of the bootstrap behind the confidence intervals, and their level.
BOOTSTRAP = 4000
CONFIDENCE = 0.90


def pooled_interval(runs: dict[str, list[dict[str, Any]]], weights: dict[str, float],
                    seed: int = 0) -> tuple[float, float, float] | None:
    """sum over variants v of weights[v] * (median of v's rounds pooled over its repeats), in percent,
    with a CONFIDENCE interval: (estimate, low, high); None where a run lacks per-round data.

    Cluster bootstrap: each variant's repeats are resampled with replacement (a repeat's rounds stay
    together, since the machine's speed drifts between runs, not within one) and the statistic is
    recomputed; the interval is the central CONFIDENCE of those values.
    """
    rounds = {v: [r.get("inrun_rounds") for r in runs.get(v, [])] for v in weights}
    if any(not rs or any(x is None for x in rs) for rs in rounds.values()):
        return None

    def stat(pick: dict[str, list[list[float]]]) -> float:
        return sum(w * statistics.median([x for r in pick[v] for x in r]) for v, w in weights.items())

    rng = random.Random(seed)
    samples = sorted(
        stat({v: [rs[rng.randrange(len(rs))] for _ in rs] for v, rs in rounds.items()})  # type: ignore[misc]
        for _ in range(BOOTSTRAP)
    )
    tail = (1 - CONFIDENCE) / 2
    return stat(rounds), samples[int(tail * BOOTSTRAP)], samples[int((1 - tail) * BOOTSTRAP) - 1]  # type: ignore[arg-type]


def interval_checks(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The goal on pooled rounds, with confidence intervals, as a total and beyond the floor.

    total: ours - plain <= (torchft - plain) / 2, i.e. d = ours - torchft/2 - plain/2 <= 0.
    beyond the floor: ours - floor <= (torchft - floor) / 2, i.e. d = ours - torchft/2 - floor/2 <= 0.
    PASS when the whole interval of d is at or below 0, FAIL when it is above, else unresolved.
    """
    out = []
    for ours, ref in GOALS:
        if "plain" not in runs or ours not in runs or ref not in runs:
            continue
        c: dict[str, Any] = {"ours": ours, "reference": ref}
        for name, base in (("total", "plain"), ("beyond_floor", FLOORS.get(ours))):
            if base is None or base not in runs:
                continue
            o = pooled_interval(runs, {ours: 1.0, base: -1.0})
            t = pooled_interval(runs, {ref: 1.0, base: -1.0})
            d = pooled_interval(runs, {ours: 1.0, ref: -0.5, base: -0.5})
            if o is None or t is None or d is None:
                continue
            verdict = "PASS" if d[2] <= 0 else "FAIL" if d[1] > 0 else "unresolved"
            c[name] = {"base": base, "ours": o, "reference": t, "ours_minus_limit": d, "verdict": verdict}
        if len(c) > 2:
            out.append(c)
    return out


def markdown(report: dict[str, Any]) -> str:
    cfg, env, table = report["config"], report["environment"], report["table"]
    noise = table.get("plain", {}).get("noise_pct")
    lines = [
        "# Peer benchmark: eagerloco beside torchft DiLoCo",
        "",
        f"{cfg['params']:,}-parameter GPT, {cfg['replicas']} replicas (processes, gloo on loopback), "
        f"H = {cfg['inner_steps']}, {cfg['steps']} inner steps, batch {cfg['batch']} x {cfg['seq_len']} tokens, "
        f"inner AdamW, outer SGD lr {cfg['outer_lr']} (eager {cfg['eager_outer_lr']}) momentum 0.9 Nesterov, "
        f"fp32 exchanges, 1 thread per process; the overlapped Streaming variants use tau = "
        f"{cfg.get('overlap_steps', 1)}. Median of {cfg['repeats']} repeats (order alternated). "
        f"torch {env['torch']}, torchft {env['torchft']}, {env['cpus']} cores; load average "
        f"{env['loadavg_start'][0]} at start, {env['loadavg_end'][0]} at end; {env['bench_seconds']:.0f} s in all.",
        "",
        "| variant | wall s | inner steps/s | overhead: in-run | overhead: wall | overhead: CPU | "
        "outer s: mean / last arriver | outer share (last arriver) | blocked s: mean / last arriver | "
        "blocked ms/sync (last arriver) | syncs | MB sent/worker | train loss (last 20) | eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, row in table.items():
        base = v == "plain"
        inrun = (f"({row['inrun_pct']:+.1f}%)" if base else f"{row.get('inrun_overhead_pct', float('nan')):+.1f}%")
        ov = "-" if base else f"{row.get('overhead_pct', float('nan')):+.1f}%"
        cpu = "-" if base else f"{row.get('cpu_overhead_pct', float('nan')):+.1f}%"
        lines.append(
            f"| {LABELS.get(v, v)} | {row['wall_s']:.2f} | {row['steps_per_s']:.2f} | {inrun} | {ov} | {cpu} | "
            f"{row['outer_s']:.2f} / {row['outer_last_s']:.2f} | {row['outer_share_pct']:.1f}% | "
            f"{row['blocked_s']:.2f} / {row['blocked_last_s']:.2f} | {row['blocked_last_ms_per_sync']:.1f} | "
            f"{row['syncs']} | {row['bytes_sent_per_worker'] / 1e6:.1f} | {row['train_loss_last20']:.3f} | "
            f"{row['eval_loss']:.3f} |"
        )
    lines += [
        "",
        "- overhead: in-run: the median outer round's wall time (H steps, its syncs included) over H times "
        "the median time of the same run's steps without outer work, minus 1 (the slower replica; median "
        "over repeats), less the plain loop's own value (in brackets: the estimator's bias). The machine's "
        "speed drifts between runs but hardly within one, and the median over rounds leaves out rare "
        "hiccups, so this resolves what the cross-run measures cannot; it would miss a slowdown of the "
        "plain steps themselves (blocking DiLoCo and Streaming run no background work between syncs; an "
        "overlapped exchange runs during the steps it overlaps, the median of the plain steps mostly leaves "
        "those out)"
        + (f"; its spread across the plain loop's repeats is {table['plain']['inrun_noise_pct']:.1f} points."
           if "inrun_noise_pct" in table.get("plain", {}) else "."),
        "- overhead: wall: median wall time (slower replica) over the plain loop's, minus 1. "
        + (f"The plain loop's own wall times spread by {noise:.1f}% across repeats (noise)." if noise else ""),
        "- overhead: CPU: CPU seconds of each process (all threads) during the loop, over the plain loop's"
        + (f" (whose own spread across repeats is {table['plain']['cpu_noise_pct']:.1f}%)."
           if "cpu_noise_pct" in table.get("plain", {}) else "."),
        "- outer s: time on the training thread inside the outer machinery (eagerloco: "
        "`before_inner_step` + `after_inner_step` + the final `drain`; torchft: its optimizer pre/post "
        "hooks, where all of DiLoCo's work runs). Mean: per replica. Last arriver: at every step the smaller "
        "of the two replicas' times (the one that did not also wait for a late peer), summed. Outer share: "
        "last-arriver outer time over the rest of the loop, an overhead estimate that a loaded machine "
        "disturbs least.",
        "- blocked s: eagerloco `comm.stats.blocked_s` (waiting on an exchange); torchft: time in "
        "`start_quorum`, in the all-reduce `wait()`s and in `should_commit` (its blocking calls).",
        "- MB sent/worker: eagerloco `comm.stats.bytes_sent`; torchft: the bytes handed to "
        "`manager.allreduce`, times the ring all-reduce factor 2(M-1)/M.",
        f"- the best possible loss on this synthetic chain is ln 4 = {cfg['best_loss']:.3f}.",
        "",
        "## Goal: our overhead at most half of torchft's bucketized overhead",
        "",
    ]
    for c in report["goal"]:
        lines.append(f"- {LABELS[c['ours']]} against {LABELS[c['reference']]}:")
        for key, name, noise_key in MEASURES:
            m = c[key]
            noise = f", plain loop's spread {m['noise']:.1f}%" if noise_key else ""
            lines.append(f"  - {name}: {m['ours']:+.1f}% vs {m['reference']:+.1f}% (limit {m['limit']:+.1f}%"
                         f"{noise}): **{m['verdict']}**")
        b = c.get("beyond_floor")
        if b is not None:
            lines.append(f"  - the bare exchange of this schedule ({LABELS[b['floor']]}) costs {b['floor_pct']:+.1f}% "
                         f"in-run, which any implementation pays here; beyond it: ours {b['ours']:+.1f}%, "
                         f"torchft {b['reference']:+.1f}%")
    if not report["goal"]:
        lines.append("- not checked (a variant of the comparison was not run).")
    checks = report.get("intervals") or []
    if checks:
        pct = int(100 * CONFIDENCE)
        lines += [
            "",
            f"### The in-run measure on all rounds of all repeats, with {pct}% confidence intervals",
            "",
            "Every round of every repeat (the slower replica's, each over its own run's plain steps) pooled, "
            "the median taken, the plain loop's (or the floor's) subtracted; the intervals come from "
            f"resampling whole repeats ({BOOTSTRAP} times). The goal holds when the interval of "
            "ours - limit lies at or below 0.",
            "",
            "| comparison | measured against | ours | torchft | ours - limit (torchft / 2) | verdict |",
            "|---|---|---|---|---|---|",
        ]

        def fmt(x: list[float]) -> str:
            return f"{x[0]:+.2f}% [{x[1]:+.2f}, {x[2]:+.2f}]"

        for c in checks:
            for name in ("total", "beyond_floor"):
                m = c.get(name)
                if m is None:
                    continue
                against = "the plain loop" if name == "total" else f"the floor ({LABELS[m['base']]})"
                lines.append(f"| {LABELS[c['ours']]} vs {LABELS[c['reference']]} | {against} | {fmt(m['ours'])} | "
                             f"{fmt(m['reference'])} | {fmt(m['ours_minus_limit'])} | **{m['verdict']}** |")
    lines += [
        "",
        "At a blocking sync (DiLoCo, Streaming with no overlap) the replica that arrives first waits "
        "for the other; any method with the same H pays that, whatever its machinery costs. The "
        "last-arriver share leaves it out and compares the machinery alone.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="inner steps per run")
    ap.add_argument("--inner-steps", type=int, default=10, help="H, inner steps per outer round")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--overlap-steps", type=int, default=1,
                    help="tau of the overlapped Streaming variants (torchft's fragment_sync_delay); < H/2")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant (median reported)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--from-json", type=Path, help="rebuild the report from an earlier peer.json (no runs)")
    args = ap.parse_args(argv)
    per_fragment = args.inner_steps // 2  # both Streaming variants use 2 fragments
    if not 1 <= args.overlap_steps < per_fragment:
        ap.error(f"--overlap-steps must be at least 1 and below H / 2 = {per_fragment} (each of the 2 fragments "
                 f"syncs every {per_fragment} steps, and its exchange must land before the next one starts); "
                 f"got {args.overlap_steps}")
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        report["table"] = aggregate(report["runs"], report["config"]["steps"])
        report["goal"] = goal_checks(report["table"])
        report["intervals"] = interval_checks(report["runs"])
        return write_report(report, args.out_dir)

    if "plain" not in args.variants:
        args.variants = ["plain", *args.variants]
    tft = None
    if any(v.startswith("torchft") for v in args.variants):
        tft = torchft_version()
        if tft is None:
            print(INSTALL, file=sys.stderr)
            return 2
    import torch

    sys.path.insert(0, str(WORKER.parent))
    import workload as wl

    loadavg_start = os.getloadavg()
    t_start = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        for rep in range(args.repeats):
            order = args.variants if rep % 2 == 0 else list(reversed(args.variants))
            for v in order:
                t0 = time.monotonic()
                run = summarize_run(run_pair(v, rep, args, Path(tmp)), args.inner_steps)
                runs[v].append(run)
                print(f"[repeat {rep + 1}/{args.repeats}] {v:27s} wall {run['wall_s']:6.2f} s  cpu "
                      f"{run['cpu_s']:6.2f} s  outer {run['outer_s']:5.2f} s (last arriver "
                      f"{run['outer_last_s']:5.2f} s)  eval loss "
                      f"{run['eval_loss']:.3f}  ({time.monotonic() - t0:.0f} s with startup)", flush=True)
    table = aggregate(runs, args.steps)
    report: dict[str, Any] = {
        "config": {
            "steps": args.steps, "inner_steps": args.inner_steps, "replicas": args.replicas,
            "repeats": args.repeats, "variants": args.variants, "params": wl.build_model().num_params(),
            "batch": wl.BATCH, "seq_len": wl.SEQ_LEN, "inner_lr": wl.INNER_LR, "outer_lr": wl.OUTER_LR,
            "eager_outer_lr": wl.EAGER_OUTER_LR,
            "outer_momentum": wl.OUTER_MOMENTUM, "codec": "fp32", "best_loss": wl.BEST_LOSS,
            "fragments": {"torchft_streaming": 2, "ours_streaming": 2, "ours_eager": 1,
                          "torchft_streaming_overlap": 2, "ours_streaming_overlap": 2},
            "overlap_steps": args.overlap_steps,
        },
        "environment": {
            "torch": torch.__version__, "torchft": tft, "python": platform.python_version(),
            "platform": platform.platform(), "cpus": os.cpu_count(), "threads_per_process": 1,
            "loadavg_start": [round(x, 2) for x in loadavg_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "bench_seconds": round(time.monotonic() - t_start, 1),
        },
        "table": table,
        "goal": goal_checks(table),
        "intervals": interval_checks(runs),
        "runs": runs,
    }
    return write_report(report, args.out_dir)


def write_report(report: dict[str, Any], out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "peer.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    (out_dir / "peer.md").write_text(md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
