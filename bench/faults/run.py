"""Fault benchmark: what a dead worker and a straggler cost, against a clean run.

Run from the repository root: ``.venv/bin/python bench/faults/run.py`` (see README.md beside it).

Part 1, real processes (gloo on loopback, ``eagerloco launch``): a 4-worker eager run of the tiny
GPT, clean, then with worker 1 slowed 1.5x, then with worker 3 killed (SIGKILL at a fixed inner
step) and restarted to rejoin while worker 1 is slowed, then killed without a restart. Reported:
inner steps lost (work the dead worker did after its last exchange that reached the model),
worker-steps missing while it was away, time to re-form the group, final eval loss and wall time.

Part 2, stragglers per method: the same slowdown in the in-process runtime on a simulated clock
(exact and repeatable: the numbers do not depend on this machine's load), for dp, DiLoCo,
Streaming, delayed and eager (1 and 2 rounds), plus real runs of DiLoCo and eager.

Results: bench/results/faults.json and bench/results/faults.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from testing import faults  # noqa: E402

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER", "EAGERLOCO_REJOIN", "EAGERLOCO_FAULT_KILL")


def common(args: argparse.Namespace) -> list[str]:
    return ["--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--eval-batches", "8", "--no-progress",
            "--log-every", "10", "--seed", "11", "--steps", str(args.steps), "--inner-steps", str(args.inner_steps),
            "--warmup-steps", "10"]


def launch(name: str, args: argparse.Namespace, method: list[str], train_extra: list[str],
           launch_extra: list[str], kill: str | None, workdir: Path) -> dict[str, Any]:
    """One multi-process run; returns its summary plus the launcher's exit code and wall time."""
    out = workdir / name
    cmd = [sys.executable, "-m", "eagerloco", "launch", "--workers", str(args.workers), *launch_extra, "--",
           *common(args), *method, "--workers", str(args.workers), "--dist-timeout", "30", "--out", str(out),
           *train_extra]
    env = faults.environment({k: v for k, v in os.environ.items() if k not in _DIST_ENV}, kill=kill)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    (workdir / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not (out / "summary.json").exists():
        raise SystemExit(f"{name} failed (exit {p.returncode}); log: {workdir / f'{name}.log'}\n{p.stdout[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    s["launcher_wall_s"] = wall
    print(f"  {name}: eval loss {s['final_eval_loss']:.4f}, training wall {s['wall_s']:.1f} s", flush=True)
    return s


def fault_runs(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    eager = ["--method", "eager", "--outer-lr", "0.4"]  # the eager paper's tuned outer lr
    slow = ["--slow-worker", f"1:{args.slow}"]
    kill = f"3:{args.kill_step}:0.05"  # worker 3 dies 50 ms into inner step kill_step + 1
    runs = {
        "clean": ([], [], None),
        "slow": (slow, [], None),
        "kill+rejoin+slow": (slow, ["--elastic", "--max-restarts", "1"], kill),
        "kill": ([], ["--elastic"], kill),
    }
    out = {}
    for name, (extra, lx, k) in runs.items():
        out[name] = launch(f"eager-{name}", args, eager, extra, lx, k, workdir)
    for name, extra in (("clean", []), ("slow", slow)):
        out[f"diloco-{name}"] = launch(f"diloco-{name}", args, ["--method", "diloco"], extra, [], None, workdir)
    return out


def simulated(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """Stragglers per method on the in-process runtime's simulated clock."""
    import torch

    from eagerloco.config import LinkConfig, OuterConfig
    from eagerloco.train import TrainConfig, train

    torch.set_num_threads(1)
    h = args.inner_steps
    methods = {
        "dp": OuterConfig(method="dp", inner_steps=h),
        "diloco": OuterConfig(method="diloco", inner_steps=h),
        "streaming P=2, tau=1": OuterConfig(method="streaming", inner_steps=h, fragments=2, overlap_steps=1),
        "delayed k=1": OuterConfig(method="delayed", inner_steps=h, outer_lr=0.4),
        "eager k=1": OuterConfig(method="eager", inner_steps=h, outer_lr=0.4),
        "eager k=2": OuterConfig(method="eager", inner_steps=h, eager_rounds=2, outer_lr=0.4),
    }
    rows = []
    for label, oc in methods.items():
        res = {}
        for factor in (1.0, args.slow):
            cfg = TrainConfig(
                model="tiny", batch_size=4, seq_len=64, eval_batches=4, steps=args.sim_steps, warmup_steps=10,
                workers=args.workers, seed=11, progress=False, log_every=10**6, sim_step_time=args.step_time,
                out=str(workdir / f"sim-{label.replace(' ', '_').replace(',', '')}-{factor}"),
                slow_workers=[f"1:{factor}"] if factor != 1.0 else [], outer=oc,
                link=LinkConfig(bandwidth_gbps=args.bandwidth_gbps, latency_ms=args.latency_ms),
            )
            res[factor] = train(cfg)
        base, slow = res[1.0], res[args.slow]
        fast = [w for i, w in enumerate(slow["per_worker"]) if i != 1]
        rows.append({
            "method": label,
            "wall_clean_s": base["wall_s"], "wall_slow_s": slow["wall_s"],
            "slowdown": slow["wall_s"] / base["wall_s"],
            "fast_blocked_clean_s": sum(w["blocked_s"] for i, w in enumerate(base["per_worker"]) if i != 1)
            / len(fast),
            "fast_blocked_slow_s": sum(w["blocked_s"] for w in fast) / len(fast),
            "cu_clean": base["compute_utilization"], "cu_slow": slow["compute_utilization"],
            "eval_loss_clean": base["final_eval_loss"], "eval_loss_slow": slow["final_eval_loss"],
        })
        print(f"  {label}: wall {base['wall_s']:.1f} -> {slow['wall_s']:.1f} s (simulated)", flush=True)
    return rows


def lost(s: dict[str, Any]) -> tuple[int, int, float, str]:
    """(inner steps lost, worker-steps missing, seconds re-forming, when it rejoined)."""
    joined = [e for e in s.get("faults", []) if e["event"] == "joined"]
    return (s.get("lost_inner_steps", 0), s["workers"] * s["steps"] - s.get("worker_steps", s["workers"] * s["steps"]),
            s.get("recovery_s", 0.0), str(joined[0]["step"]) if joined else "-")


def report(args: argparse.Namespace, real: dict[str, dict[str, Any]], sim: list[dict[str, Any]]) -> str:
    clean = real["clean"]
    lines = [
        "# Faults: a dead worker and a straggler against a clean run",
        "",
        f"Tiny GPT ({clean['num_params']:,} parameters), {args.workers} workers, {args.steps} inner steps, "
        f"H = {args.inner_steps}, batch 4 x 64 tokens per worker, Brown Corpus, one process per worker "
        f"(gloo on loopback), this machine ({os.cpu_count()} cores). Worker 3 is killed (SIGKILL) 50 ms into "
        f"inner step {args.kill_step + 1}; worker 1 is slowed {args.slow}x (it sleeps {args.slow - 1:g}x its "
        "measured compute after every step).",
        "",
        "## Eager (outer lr 0.4), real processes",
        "",
        "| run | final eval loss | vs clean | training wall s | steps lost | worker-steps missing "
        "| re-forming s | rejoined at step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {"clean": "clean", "slow": f"worker 1 slowed {args.slow}x",
              "kill+rejoin+slow": f"worker 3 killed and restarted, worker 1 slowed {args.slow}x",
              "kill": "worker 3 killed, not restarted"}
    for key, label in labels.items():
        s = real[key]
        steps_lost, missing, rec, rejoin = lost(s)
        lines.append(
            f"| {label} | {s['final_eval_loss']:.4f} | {s['final_eval_loss'] - clean['final_eval_loss']:+.4f} "
            f"| {s['wall_s']:.1f} | {steps_lost} | {missing} of {args.workers * args.steps} | {rec:.2f} | {rejoin} |"
        )
    lines += [
        "",
        "*steps lost*: inner steps the dead worker computed after the launch of its last exchange that "
        "reached the model (its partial round); the exchange that was in flight when it died is rerun "
        "among the survivors. *worker-steps missing*: steps nobody computed because the worker was away "
        "(from its death until it was admitted again). *re-forming*: the longest time a worker spent "
        "agreeing on the new membership, rebuilding the groups and (for the rejoin) handing over the state.",
        "",
        "## Stragglers per method",
        "",
        f"Simulated clock (in-process runtime, exact): {args.workers} workers, {args.sim_steps} steps of "
        f"{args.step_time} s, link {args.bandwidth_gbps} Gbit/s and {args.latency_ms} ms, worker 1 at "
        f"{args.slow}x. *fast blocked*: seconds each other worker waits, on average.",
        "",
        "| method | wall s, clean | wall s, straggler | slowdown | fast blocked s, clean | fast blocked s, straggler "
        "| CU straggler | eval loss equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sim:
        same = "yes" if r["eval_loss_clean"] == r["eval_loss_slow"] else "no"
        lines.append(
            f"| {r['method']} | {r['wall_clean_s']:.1f} | {r['wall_slow_s']:.1f} | {r['slowdown']:.3f} "
            f"| {r['fast_blocked_clean_s']:.2f} | {r['fast_blocked_slow_s']:.2f} | {r['cu_slow']:.3f} | {same} |"
        )
    lines += ["", "Real processes (training wall time, seconds):", "",
              "| method | clean | straggler | slowdown |", "|---|---|---|---|"]
    for m, (a, b) in {"diloco": (real["diloco-clean"], real["diloco-slow"]),
                      "eager k=1": (real["clean"], real["slow"])}.items():
        lines.append(f"| {m} | {a['wall_s']:.1f} | {b['wall_s']:.1f} | {b['wall_s'] / a['wall_s']:.3f} |")
    lines += ["", f"Generated by `bench/faults/run.py` on {time.strftime('%Y-%m-%d')} "
              f"({platform.python_version()}, {platform.machine()})."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--kill-step", type=int, default=55)
    ap.add_argument("--slow", type=float, default=1.5)
    ap.add_argument("--sim-steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0)
    ap.add_argument("--latency-ms", type=float, default=100.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per real run")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--skip-real", action="store_true", help="only the simulated straggler table")
    args = ap.parse_args()
    if args.workers < 4 or not 0 < args.kill_step < args.steps or not (math.isfinite(args.slow) and args.slow >= 1):
        ap.error("needs --workers >= 4 (worker 3 is killed), 0 < --kill-step < --steps and --slow >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        workdir = Path(tmp)
        print("stragglers per method (simulated clock):", flush=True)
        sim = simulated(args, workdir)
        real: dict[str, dict[str, Any]] = {}
        if not args.skip_real:
            print("real processes:", flush=True)
            real = fault_runs(args, workdir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    keep = ("final_eval_loss", "wall_s", "launcher_wall_s", "recovery_s", "lost_inner_steps", "worker_steps",
            "faults", "final_outer", "blocked_s", "compute_utilization", "members", "per_worker")
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "real": {k: {f: v.get(f) for f in keep} for k, v in real.items()}, "simulated": sim,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    (args.out_dir / "faults.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if real:
        md = report(args, real, sim)
        (args.out_dir / "faults.md").write_text(md)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
