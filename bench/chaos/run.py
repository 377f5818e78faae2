"""Chaos benchmark: a randomized schedule of kills, freezes and signals against multi-process runs.

Run from the repository root: ``.venv/bin/python bench/chaos/run.py`` (see README.md beside it).

Each run is a small multi-process training run (``eagerloco launch``, tiny GPT, checkpoints every
few steps). While it trains, faults drawn at random hit it: SIGKILL, SIGTERM or SIGSTOP to one
training rank, SIGINT, SIGTERM, SIGHUP or SIGKILL to the launcher. After each fault the benchmark
waits for every process to end, looks for tracebacks in the output and for processes left behind
(every process carries a tag in its environment), checks that the newest checkpoint verifies, and
starts the run again with ``--resume``. After the last fault the run is resumed to its end and its
numbers are compared with an uninterrupted run of the same settings.

Results: bench/results/chaos.json and bench/results/chaos.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.chaoslib import default_signals, reap, tagged, tagged_env  # noqa: E402
from eagerloco import checkpoint as ckpt  # noqa: E402

#: (target, signal): a training rank or the launcher.
FAULTS = [("rank", signal.SIGKILL), ("rank", signal.SIGTERM), ("rank", signal.SIGSTOP),
          ("launcher", signal.SIGINT), ("launcher", signal.SIGTERM), ("launcher", signal.SIGHUP),
          ("launcher", signal.SIGKILL)]


def train_args(args: argparse.Namespace, out: Path) -> list[str]:
    return ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "2", "--no-progress",
            "--log-every", "1", "--seed", "13", "--workers", str(args.workers), "--method", "diloco",
            "--inner-steps", "2", "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
            "--keep-checkpoints", "0", "--dist-timeout", str(args.dist_timeout), "--out", str(out)]


def command(args: argparse.Namespace, out: Path, resume: bool) -> list[str]:
    # --spawn-ranks: each rank an interpreter of its own, whose environment names its RANK (a rank forked from the
    # rank server keeps the server's), so that the faults find the training ranks (chaoslib.tagged).
    return [sys.executable, "-m", "eagerloco", "launch", "--workers", str(args.workers), "--grace-s", "10",
            "--spawn-ranks", "--",
            *train_args(args, out), *(["--resume"] if resume else [])]


def newest_step(out: Path) -> int:
    found = ckpt.newest_intact(ckpt.checkpoint_root(out))
    return found[1] if found else 0


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln]


def one_attempt(args: argparse.Namespace, out: Path, tag: str, resume: bool, fault: tuple[str, int] | None,
                rng: random.Random, log: Path) -> dict[str, Any]:
    """Start (or resume) the run; inject the fault once a new checkpoint exists; wait for every process."""
    before = newest_step(out)
    t0 = time.monotonic()
    with log.open("w") as f:
        p = subprocess.Popen(command(args, out, resume), stdout=f, stderr=subprocess.STDOUT, env=tagged_env(tag, ROOT),
                             cwd=ROOT)
        injected = None
        while fault is not None and p.poll() is None and time.monotonic() - t0 < args.timeout:
            if newest_step(out) > before:
                time.sleep(rng.uniform(0.0, args.max_delay))
                target, sig = fault
                if target == "launcher":
                    pid = p.pid
                else:
                    ranks = [pid for pid, e in tagged(tag).items() if e["rank"] and pid != p.pid]
                    pid = rng.choice(ranks) if ranks else p.pid
                if p.poll() is None:
                    os.kill(pid, sig)
                    injected = {"target": target, "signal": signal.Signals(sig).name}
                break
            time.sleep(0.1)
        try:
            rc = p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
    orphans = reap(tag)  # counted, then killed
    text = log.read_text(errors="replace")
    newest = ckpt.list_checkpoints(ckpt.checkpoint_root(out))
    intact = True
    if newest:
        try:
            ckpt.verify(newest[-1])
        except ckpt.CheckpointError:
            intact = False
    return {"rc": rc, "fault": injected, "tracebacks": text.count("Traceback (most recent call last)"),
            "orphans": orphans, "newest_checkpoint_intact": intact, "newest_step": newest_step(out),
            "seconds": round(time.monotonic() - t0, 1), "log": str(log)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--faults-per-run", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--dist-timeout", type=float, default=10)
    ap.add_argument("--max-delay", type=float, default=2.0, help="seconds after a new checkpoint, at most")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=300, help="per attempt")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    default_signals()  # children of a background job would inherit an ignored SIGINT
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="eagerloco-chaos-"))
    print(f"chaos: seed {seed}, work in {work}", flush=True)
    ref_tag = uuid.uuid4().hex
    ref = one_attempt(args, work / "reference", ref_tag, False, None, rng, work / "reference.log")
    reference = json.loads((work / "reference" / "summary.json").read_text())
    print(f"  reference: eval loss {reference['final_eval_loss']:.6f} ({ref['seconds']} s)", flush=True)
    # Every kind of fault before any twice: a shuffled deck of them, dealt in order.
    deck: list[tuple[str, int]] = []
    while len(deck) < args.runs * args.faults_per_run:
        deck += rng.sample(FAULTS, len(FAULTS))
    runs = []
    for i in range(args.runs):
        out, tag = work / f"run{i}", uuid.uuid4().hex
        attempts = []
        for k in range(args.faults_per_run + 1):
            fault = deck.pop(0) if k < args.faults_per_run else None
            a = one_attempt(args, out, tag, k > 0, fault, rng, work / f"run{i}-{k}.log")
            attempts.append(a)
            print(f"  run {i} attempt {k}: fault {a['fault']}, exit {a['rc']}, tracebacks {a['tracebacks']}, "
                  f"orphans {a['orphans']}, newest checkpoint step {a['newest_step']} "
                  f"({'intact' if a['newest_checkpoint_intact'] else 'DAMAGED'}), {a['seconds']} s", flush=True)
        while attempts[-1]["rc"] != 0 and len(attempts) < args.faults_per_run + 3:  # one more go to finish
            attempts.append(one_attempt(args, out, tag, True, None, rng, work / f"run{i}-{len(attempts)}.log"))
        summary = out / "summary.json"
        finished = attempts[-1]["rc"] == 0 and summary.exists()
        s = json.loads(summary.read_text()) if finished else {}
        logged = steps_logged(out)
        lost = (not finished or logged != list(range(1, args.steps + 1))
                or not all(a["newest_checkpoint_intact"] for a in attempts))
        runs.append({
            "attempts": attempts, "finished": finished, "steps_logged_ok": logged == list(range(1, args.steps + 1)),
            "final_eval_loss": s.get("final_eval_loss"),
            "same_numbers": finished and s["final_eval_loss"] == reference["final_eval_loss"]
            and s["final_train_loss"] == reference["final_train_loss"],
            "data_lost": lost,
        })
    faults = [a["fault"] for r in runs for a in r["attempts"] if a["fault"]]
    kinds: dict[str, int] = {}
    for f in faults:
        key = f"{f['signal']} to {'the launcher' if f['target'] == 'launcher' else 'a rank'}"
        kinds[key] = kinds.get(key, 0) + 1
    attempts = [a for r in runs for a in r["attempts"]] + [ref]
    result = {
        "seed": seed, "settings": vars(args) | {"out": str(args.out)}, "reference": {
            "final_eval_loss": reference["final_eval_loss"], "final_train_loss": reference["final_train_loss"]},
        "runs_tried": len(runs), "faults_injected": len(faults), "faults_by_kind": kinds,
        "runs_finished": sum(r["finished"] for r in runs),
        "runs_with_uninterrupted_numbers": sum(bool(r["same_numbers"]) for r in runs),
        "tracebacks_seen": sum(a["tracebacks"] for a in attempts),
        "orphans_left": sum(a["orphans"] for a in attempts),
        "runs_with_data_lost": sum(r["data_lost"] for r in runs),
        "runs": runs, "python": platform.python_version(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    rows = [("runs tried", result["runs_tried"], ""), ("faults injected", result["faults_injected"],
             ", ".join(f"{v} x {k}" for k, v in sorted(kinds.items()))),
            ("runs finished (after --resume)", result["runs_finished"], f"of {len(runs)}"),
            ("runs ending with the uninterrupted run's numbers", result["runs_with_uninterrupted_numbers"],
             f"eval loss {reference['final_eval_loss']:.6f}, bit for bit"),
            ("tracebacks seen", result["tracebacks_seen"], "goal 0"),
            ("orphans left", result["orphans_left"], "goal 0"),
            ("runs with data lost", result["runs_with_data_lost"], "goal 0: a damaged newest checkpoint, a missing "
             "or repeated metrics line, or no summary")]
    md = ["# Chaos: random kills, freezes and signals against multi-process runs", "",
          f"{args.runs} runs of {args.workers} workers (one process each, gloo on loopback), tiny GPT, DiLoCo H = 2, "
          f"{args.steps} steps, a checkpoint every {args.checkpoint_every}, --dist-timeout {args.dist_timeout:g} s; "
          f"{args.faults_per_run} faults per run (every kind before any twice, in random order), "
          f"each within {args.max_delay:g} s of a new checkpoint, "
          f"then --resume to the end (seed {seed}).", "",
          "| what | count | note |", "|---|---|---|"]
    md += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    md += ["", f"Generated by `bench/chaos/run.py` on {result['date']} ({result['python']}, {result['machine']})."]
    (args.out / "chaos.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
