"""Workers of unequal speed: each worker's compute utilization with a fixed H and with --adaptive-steps.

Run from the repository root: ``nice -n 10 .venv/bin/python bench/hetero/run.py [--seeds 3]`` (see README.md).

Real worker processes (``eagerloco launch``, gloo on loopback, the emulated link) train the tiny GPT, every
inner step paced (``--sim-step-time``) and each worker slowed to its ``--worker-speeds`` share: two workers
(1, 0.5) and four (1, 1, 0.5, 0.25), DiLoCo and eager, per seed three runs:

- fixed: H on every worker for T ticks (the fastest idles while the slowest finishes its round);
- adaptive, equal tokens: --adaptive-steps for the rounds that train on the fixed run's tokens;
- adaptive, equal wall: --adaptive-steps for the rounds that take the fixed run's wall clock, as the two runs
  before measured it (the fixed run's wall over the equal-tokens run's wall per tick).

Per run: each worker's compute utilization (its compute seconds over the run's wall) beside the simulator's
prediction (``eagerloco.sim.hetero.per_worker_cu``, a cold start of the run's rounds), tokens per second, the
final eval loss. Results: bench/results/hetero.json and bench/results/hetero.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagerloco.lab.compare.stats import mean_interval, paired_difference
from eagerloco.schedule import round_lengths
from eagerloco.sim.hetero import per_worker_cu
from eagerloco.sim.model import ModelSpec, Variant, traffic

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SETUPS = {2: [1.0, 0.5], 4: [1.0, 1.0, 0.5, 0.25]}
METHODS = ("diloco", "eager")
MODES = ("fixed", "adaptive, equal tokens", "adaptive, equal wall")
TINY_BLOCKS = 4


def ticks_of(mode: str, speeds: list[float], h: int, ticks: int, done: dict[str, dict[str, Any]]) -> int:
    """The run's ticks (a multiple of H): T; the ticks giving the fixed run's tokens; or the ticks giving its
    wall clock at the equal-tokens run's measured wall per tick (``done``: those two runs by mode)."""
    if mode == "fixed":
        return ticks
    if mode == "adaptive, equal wall":
        fixed, short = done["fixed"], done["adaptive, equal tokens"]
        return h * max(1, round(fixed["wall_s"] / (short["wall_s"] / short["ticks"]) / h))
    per_tick = sum(round_lengths(h, speeds)) / h  # workers' inner steps per tick
    rounds = math.ceil(ticks * len(speeds) / per_tick / h)
    return rounds * h


def run_one(args: argparse.Namespace, workers: int, method: str, mode: str, seed: int, out: Path,
            done: dict[str, dict[str, Any]], reuse: list[dict[str, Any]]) -> dict[str, Any]:
    """One run (or the same run from ``reuse``, an earlier report's runs)."""
    speeds = SETUPS[workers]
    steps = ticks_of(mode, speeds, args.inner_steps, args.ticks, done)
    for r in reuse:
        if (r["workers"], r["method"], r["mode"], r["seed"], r["ticks"]) == (workers, method, mode, seed, steps):
            return r
    argv = ["--workers", str(workers), "--model", "tiny", "--batch-size", "2", "--seq-len", "32",
            "--steps", str(steps), "--inner-steps", str(args.inner_steps), "--method", method,
            "--eval-batches", "8", "--log-every", str(args.inner_steps), "--seed", str(seed), "--no-progress",
            "--sim-step-time", repr(args.step_time), "--worker-speeds", ",".join(f"{v:g}" for v in speeds),
            "--bandwidth-gbps", repr(args.bandwidth_gbps), "--latency-ms", repr(args.latency_ms),
            "--warmup-steps", "4", "--outer-lr", repr(args.outer_lr), "--out", str(out), "--overwrite"]
    if mode != "fixed":
        argv.append("--adaptive-steps")
    cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", str(workers), "--", *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{out.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    # The run's wall clock: until its last worker is done (a worker that finishes first idles until then).
    wall = max(w["compute_s"] + w["blocked_s"] + w["overhead_s"] for w in s["per_worker"])
    rounds = steps // args.inner_steps
    spec = ModelSpec("tiny", float(s["num_params"]), TINY_BLOCKS, args.step_time)
    variant = Variant(method, method, method, 32)
    tr = traffic(spec, variant, workers, args.inner_steps, 1, transport="ring")
    sim = per_worker_cu(spec, variant, tr, _lanes(args.bandwidth_gbps), speeds, args.latency_ms, args.inner_steps,
                        8, 32, rounds)["fixed" if mode == "fixed" else "adaptive"][0]
    return {
        "workers": workers, "speeds": speeds, "method": method, "mode": mode, "seed": seed, "ticks": steps,
        "cu": [w["compute_s"] / wall for w in s["per_worker"]], "sim_cu": [float(c) for c in sim],
        "blocked_s": [w["blocked_s"] for w in s["per_worker"]],
        "slow_steps": s.get("slow_steps", 0), "tokens": s["tokens"], "wall_s": wall,
        "tokens_per_s": s["tokens"] / wall, "final_eval_loss": s["final_eval_loss"],
        "worker_steps": s.get("worker_steps", [steps] * workers), "launch_s": time.perf_counter() - t0,
    }


def _lanes(bandwidth: float) -> Any:
    import numpy as np

    return np.asarray([bandwidth], dtype=float)


def _iv(values: list[float], fmt: str = "{:.3f}") -> str:
    iv = mean_interval(values)
    if iv is None:
        return "n/a"
    return fmt.format(iv.mean) + (f" [{fmt.format(iv.lo)}, {fmt.format(iv.hi)}]" if iv.n > 1 else "")


def render(report: dict[str, Any]) -> str:
    st, runs = report["settings"], report["runs"]
    lines = [
        "# Workers of unequal speed: fixed H against --adaptive-steps",
        "",
        f"Generated by `bench/hetero/run.py` on {report['machine']} ({report['date']}). Real processes "
        f"(`eagerloco launch`, gloo on loopback), tiny GPT, batch 2 x 32 tokens, H = {st['inner_steps']}, every "
        f"inner step paced at {st['step_time']:g} s for the fastest worker and 1/speed times that for the others "
        f"(`--sim-step-time`, `--worker-speeds`), emulated link {st['bandwidth_gbps']:g} Gbit/s with "
        f"{st['latency_ms']:g} ms latency, FP32 exchange, outer lr {st['outer_lr']:g} (Nesterov 0.9). "
        f"Seeds {st['seeds']}; intervals are 90% Student-t over "
        "seeds. CU of a worker: its compute seconds over the run's wall clock (until its last worker is done: "
        "compute, blocked and outer-machinery seconds of the worker that took longest; a worker that ends first "
        "idles until then; start-up, evaluation and the final drain are left out); `sim`: "
        "`eagerloco simulate --worker-speeds` for the same settings (a cold start of the run's rounds).",
        "",
        f"Runs: fixed, T = {st['ticks']} ticks (H on every worker); adaptive at equal tokens, the rounds whose "
        "tokens reach the fixed run's; adaptive at equal wall clock, the rounds whose wall clock (at the equal-tokens "
        "run's measured wall per tick) is the fixed run's. A tick is an inner step of the fastest worker.",
        "",
    ]
    for workers in sorted({r["workers"] for r in runs}):
        for method in METHODS:
            rows = [r for r in runs if r["workers"] == workers and r["method"] == method]
            if not rows:
                continue
            speeds = rows[0]["speeds"]
            lines += [f"## {workers} workers (speeds {', '.join(f'{v:g}' for v in speeds)}), {method}", ""]
            head = ["run", "ticks"] + [f"CU w{m} ({v:g}) / sim" for m, v in enumerate(speeds)]
            head += ["tokens", "tokens/s", "wall s", "final eval loss"]
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for mode in MODES:
                group = [r for r in rows if r["mode"] == mode]
                if not group:
                    continue
                cells = [mode, str(group[0]["ticks"])]
                for m in range(workers):
                    cells.append(f"{_iv([r['cu'][m] for r in group])} / {group[0]['sim_cu'][m]:.3f}")
                cells += [f"{group[0]['tokens']:,}", _iv([r["tokens_per_s"] for r in group], "{:.0f}"),
                          _iv([r["wall_s"] for r in group], "{:.1f}"), _iv([r["final_eval_loss"] for r in group])]
                lines.append("| " + " | ".join(cells) + " |")
            base = {r["seed"]: r["final_eval_loss"] for r in rows if r["mode"] == "fixed"}
            for mode in MODES[1:]:
                d = paired_difference({r["seed"]: r["final_eval_loss"] for r in rows if r["mode"] == mode}, base)
                if d is not None:
                    lines.append(f"\nEval loss, {mode} minus fixed (paired by seed): {d.mean:+.3f} "
                                 f"[{d.lo:+.3f}, {d.hi:+.3f}]")
            slow = sum(r["slow_steps"] for r in rows)
            lines += ["", f"Inner steps over their pace (slow_steps): {slow}.", ""]
    return "\n".join(lines) + "\n"


def findings(md_path: Path) -> str:
    """The hand-written "## Findings" section of an earlier hetero.md, kept when the tables are rewritten."""
    text = md_path.read_text() if md_path.is_file() else ""
    at = text.find("\n## Findings")
    return text[at:] if at >= 0 else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workers", default="2,4", help="comma list of 2 and 4")
    p.add_argument("--ticks", type=int, default=32, help="T: ticks of the fixed run (a multiple of H)")
    p.add_argument("--inner-steps", type=int, default=8, help="H")
    p.add_argument("--step-time", type=float, default=0.1, help="seconds per inner step of the fastest worker")
    p.add_argument("--bandwidth-gbps", type=float, default=0.1)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--outer-lr", type=float, default=0.3,
                   help="outer SGD lr, Nesterov 0.9 (the papers' 0.7 makes eager diverge in this short run)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--scratch", type=Path, default=Path("/tmp/eagerloco-bench-hetero"))
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render-only", action="store_true", help="rewrite hetero.md from hetero.json")
    p.add_argument("--reuse", action="store_true",
                   help="take from hetero.json every run it has with the same settings and ticks")
    args = p.parse_args()
    json_path, md_path = args.out_dir / "hetero.json", args.out_dir / "hetero.md"
    if args.render_only:
        md_path.write_text(render(json.loads(json_path.read_text())) + findings(md_path))
        return 0
    reuse = json.loads(json_path.read_text())["runs"] if args.reuse and json_path.is_file() else []
    runs = []
    for seed in range(args.seeds):
        for workers in (int(w) for w in args.workers.split(",")):
            for method in METHODS:
                done: dict[str, dict[str, Any]] = {}
                for mode in MODES:
                    name = f"m{workers}-{method}-{mode.replace(', ', '-').replace(' ', '_')}-s{seed}"
                    r = done[mode] = run_one(args, workers, method, mode, seed, args.scratch / name, done, reuse)
                    print(f"{name}: CU {[round(c, 3) for c in r['cu']]} (sim {[round(c, 3) for c in r['sim_cu']]}), "
                          f"{r['tokens_per_s']:.0f} tokens/s, eval {r['final_eval_loss']:.4f}", flush=True)
                    runs.append(r)
    report = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "date": time.strftime("%Y-%m-%d"),
        "settings": {"seeds": list(range(args.seeds)), "ticks": args.ticks, "inner_steps": args.inner_steps,
                     "step_time": args.step_time, "bandwidth_gbps": args.bandwidth_gbps,
                     "latency_ms": args.latency_ms, "outer_lr": args.outer_lr},
        "runs": runs,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(render(report) + findings(md_path))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
