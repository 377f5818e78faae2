"""Chaos benchmark for separate jobs: mismatched settings, missing and silent peers, kills, signals at the
rendezvous and mid-run, resumes from different steps, an evaluation that outlasts the timeout.

Run from the repository root: ``nice -n 10 .venv/bin/python bench/chaos_jobs/run.py`` (see README.md
beside it).

Every worker is its own process (``eagerloco train --outer-addr 127.0.0.1:PORT --worker-id I --workers
M``, its own ``--out``), as a user starts them by hand or through a scheduler. Each scenario runs
several times (M = 2 and 3, a different seed and port each time); for every job the benchmark records
its exit, the tracebacks and C++ frames in its output, whether it hung, how long it waited after the
fault, whether it ended with wrong numbers (or exited 0 where it must fail), and whether a file a user
planted in its --out, or a checkpoint it published, was lost.

Results: bench/results/chaos_jobs.json and bench/results/chaos_jobs.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.chaos_jobs import scenarios as sc  # noqa: E402
from bench.chaoslib import default_signals  # noqa: E402

GOALS = "0 crash marks, 0 hangs, every wait within the timeout plus 10 s, 0 wrong results, 0 files lost"


def schedule(args: argparse.Namespace) -> list[tuple[str, Callable[[sc.Bench], list[dict[str, Any]]]]]:
    """Every try of every scenario, in order: (the scenario's row, the call that runs it)."""
    tries: list[tuple[str, Callable[[sc.Bench], list[dict[str, Any]]]]] = []
    reps = range(args.reps)

    def m(r: int) -> int:
        return 2 if r % 2 == 0 else 3

    def seed(r: int) -> int:
        return args.seed + r

    def add(row: str, fn: Callable[..., list[dict[str, Any]]], *a: Any) -> None:
        tries.append((row, lambda b: fn(b, *a)))

    for r in reps:  # first: the clean runs every comparison needs, and how long a run takes
        add("clean run", sc.clean, m(r), seed(r))
    mismatches = [("--seed", lambda s: str(s + 100)), ("--outer-lr", lambda s: "0.35"),
                  ("--steps", lambda s: str(args.steps + 2)), ("--inner-steps", lambda s: "4"),
                  ("--method", lambda s: "eager"), ("--workers", None)]
    for flag, value in mismatches:
        for r in reps:
            v = str(m(r) + 1) if value is None else value(seed(r))
            add(f"mismatched {flag}", sc.mismatch, m(r), seed(r), flag, v, (r + 1) % m(r))
    for r in reps:
        add("missing worker 0", sc.missing, m(r), seed(r), 0)
    for r in reps:
        add("missing worker other than 0", sc.missing, m(r), seed(r), m(r) - 1)
    for r in reps:
        add("silent coordinator", sc.silent, m(r), seed(r))
    for r in reps:
        add("SIGKILL mid-run", sc.kill, m(r), seed(r), r % m(r), False)
    for r in reps:
        add("SIGKILL mid-run (--elastic)", sc.kill, m(r), seed(r), m(r) - 1, True)
    for r in reps:
        add("SIGKILL mid-run (--elastic, worker 0)", sc.kill, m(r), seed(r), 0, True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        for r in reps:
            add(f"{sig.name} at the rendezvous", sc.signal_rendezvous, m(r), seed(r), sig)
    for sig in (signal.SIGINT, signal.SIGTERM):
        for r in reps:
            add(f"{sig.name} mid-run", sc.signal_running, m(r), seed(r), sig, (r + (sig == signal.SIGTERM)) % m(r))
    for r in reps:
        add("resume from different steps", sc.resume, m(r), seed(r), (r + 1) % m(r), r % m(r), 1 + r % 2)
    for r in reps:
        add("evaluation outlasting --dist-timeout", sc.slow_eval, m(r), seed(r), (r + 1) % m(r), args.eval_delay)
    return [t for t in tries if not args.only or any(o in t[0] for o in args.only) or t[0] == "clean run"]


def row(name: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of one scenario's jobs."""
    waits = [r for r in recs if "wait_s" in r]
    lines = [r for r in recs if "clear_line" in r]
    return {
        "scenario": name, "tries": len({r["try"] for r in recs}), "jobs": len(recs),
        "exits": dict(sorted(Counter(str(r["rc"]) for r in recs).items())),
        "expected_exits": sum(r["expected_exit"] for r in recs),
        "crash_marks": sum(r["crash_marks"] for r in recs), "jobs_with_crash_marks": sum(
            r["crash_marks"] > 0 for r in recs),
        "hangs": sum(r["hang"] for r in recs),
        "waits": len(waits), "waits_within": sum(r["wait_ok"] for r in waits),
        "longest_wait_s": max((r["wait_s"] for r in waits), default=None),
        "wrong_results": sum(bool(r["wrong"]) for r in recs),
        "files_lost": sum(len(r["files_lost"]) for r in recs),
        "clear_lines": sum(r["clear_line"] for r in lines), "lines": len(lines),
        "orphans": sum(r.get("orphans", 0) for r in recs),
    }


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    head = ("| scenario | tries | jobs | exits (status x jobs) | expected exit | crash marks (jobs) | hangs | "
            "waits within timeout + 10 s (longest) | wrong results | files lost | one-line error naming the cause |")
    md = ["# Chaos: separate jobs (`eagerloco train --outer-addr`)", "",
          f"Every worker its own process and its own `--out` (gloo on loopback), tiny GPT, DiLoCo H = 2, "
          f"{s['steps']} steps, a checkpoint every 2 (`--keep-checkpoints 3`), `--eval-every {s['eval_every']}`, "
          f"`--dist-timeout {s['dist_timeout']:g}`; each scenario {s['reps']} times (M = 2 and 3 in turn, a "
          f"different seed and port each time). Before each try, `notes.txt` and `mine/best.pth` are planted in "
          f"every `--out`, and `checkpoints/mine/best.pth` too before a `--resume` (a fresh run refuses a `--out` "
          f"holding files at its own paths, naming them).", "", head, "|" + "---|" * 11]
    for r in [*result["rows"], result["totals"]]:
        exits = ", ".join(f"{k} x {v}" for k, v in r["exits"].items())
        wait = f"{r['waits_within']} of {r['waits']}" + (f" ({r['longest_wait_s']:.1f} s)" if r["waits"] else "")
        name = f"**{r['scenario']}**" if r["scenario"] == "total" else r["scenario"]
        md.append(f"| {name} | {r['tries']} | {r['jobs']} | {exits} | {r['expected_exits']} of {r['jobs']} | "
                  f"{r['crash_marks']} ({r['jobs_with_crash_marks']}) | {r['hangs']} | {wait} | {r['wrong_results']} | "
                  f"{r['files_lost']} | {r['clear_lines']} of {r['lines']} |")
    m = result["machine"]
    md += ["", f"**Goals:** {GOALS}. Orphan processes left: {result['totals']['orphans']}.", "",
           "*Expected exit*: 0 where the job must finish; 2 (a setting) or 3 (a peer) where it must stop with "
           "an error; 130 or 143 for the job a SIGINT or SIGTERM was sent to; -9 for the job killed. "
           "*Crash marks*: `Traceback`, `frame #` (C++ stack frames) and `terminate called` in a job's output. "
           "*Hang*: a job still running the timeout plus 10 s after it should have ended (then killed). "
           "*Wait*: from the fault (the job reaching the run, for a peer that never comes; the signal; the "
           "victim's death; the last job's arrival, for settings that differ) to the job's exit. "
           "*Wrong result*: exit 0 where the job must fail, or exit 0 with a final eval loss or final outer "
           "parameters that differ (bit for bit) from the clean run of the same seed where they must match, or "
           "a resume from another step than the newest every job has. "
           "*Files lost*: a planted file missing or changed, or a published checkpoint that fails "
           "`eagerloco.checkpoint.verify`. *One-line error*: the last line of a job that must stop starts with "
           "`eagerloco: ` and names the flag, the worker or the signal (beside the goals: a job that reaches the "
           "rendezvous after the others stopped can only say that worker 0 is not there).", "",
           f"Machine: {m['cores']} cores, load average {m['load_before']} before and {m['load_after']} after "
           f"(shared with other work), Python {m['python']}, torch {m['torch']}, {m['platform']}. "
           f"Took {result['seconds']:.0f} s on {result['date']}.", "",
           f"Command: `{result['command']}`"]
    if result["findings"]:
        md += ["", "## Jobs that missed a goal or an expectation", ""]
        md += [f"- {f}" for f in result["findings"]]
    return "\n".join(md) + "\n"


def findings(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        why = [w for w, bad in (("crash marks", r["crash_marks"]), ("hang", r["hang"]), ("wrong: " + r["wrong"],
               r["wrong"]), (f"files lost {r['files_lost']}", r["files_lost"]),
               (f"waited {r.get('wait_s')} s", r.get("wait_ok") is False),
               ("unexpected exit", not r["expected_exit"]), ("no clear one-line error", r.get("clear_line") is False))
               if bad]
        if why:
            out.append(f"{r['scenario']} (M = {r['workers']}, seed {r['seed']}, worker {r['worker']}, "
                       f"{r['fault'] or 'no fault'}): exit {r['rc']}; {'; '.join(why)}; last line: "
                       f"`{r['last_line'][:300]}`")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="tries of each scenario (M = 2 and 3 in turn)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dist-timeout", type=float, default=8.0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-delay", type=float, default=None, help="seconds (default 1.5 x --dist-timeout)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--only", nargs="*", default=None, help="run only the scenarios whose name has one of these")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    args.eval_delay = 1.5 * args.dist_timeout if args.eval_delay is None else args.eval_delay
    default_signals()
    load_before = [round(x, 2) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="eagerloco-chaos-jobs-"))
    print(f"chaos_jobs: work in {work}", flush=True)
    bench = sc.Bench(work, args.steps, args.dist_timeout, args.eval_every)
    t0 = time.monotonic()
    records: list[dict[str, Any]] = []
    for i, (name, call) in enumerate(schedule(args)):
        t = time.monotonic()
        recs = call(bench)
        for r in recs:
            r["scenario"], r["try"] = name, i
        records += recs
        print(f"  {name}: exits {[r['rc'] for r in recs]}, crash marks {sum(r['crash_marks'] for r in recs)}, "
              f"hangs {sum(r['hang'] for r in recs)}, waits {[r.get('wait_s') for r in recs]}, "
              f"wrong {sum(bool(r['wrong']) for r in recs)}, lost {sum(len(r['files_lost']) for r in recs)} "
              f"({time.monotonic() - t:.0f} s)", flush=True)
    names = list(dict.fromkeys(r["scenario"] for r in records))
    rows = [row(n, [r for r in records if r["scenario"] == n]) for n in names]
    totals = row("total", records)
    import torch

    niceness = os.nice(0)
    python = Path(sys.executable)
    python = python.relative_to(ROOT) if python.is_relative_to(ROOT) else python
    command = " ".join([str(python), os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    result = {
        "settings": vars(args) | {"out": str(args.out)}, "rows": rows, "totals": totals,
        "findings": findings(records), "jobs": records, "seconds": time.monotonic() - t0,
        "command": (f"nice -n {niceness} " if niceness else "") + command, "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": os.cpu_count(), "load_before": load_before,
                    "load_after": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.machine()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos_jobs.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = report(result)
    (args.out / "chaos_jobs.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
