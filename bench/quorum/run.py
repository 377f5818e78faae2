"""Goodput under a scripted chaos schedule: four `eagerloco train --outer-addr` jobs at a coordinator, quorum
exchanges (`--quorum 3 --grace auto`) against all-or-nothing rounds, DiLoCo and eager, seeds paired.

Run from the repository root: ``nice -n 10 .venv/bin/python bench/quorum/run.py``. Each run: tiny model, steps
paced to --sim-step-time, the faults of :data:`SCHEDULE` at fixed seconds from the moment every job has logged
its first step. What each run's logs give, and how goodput is counted from them: bench/quorum/README.md.

Results: bench/results/quorum.json and bench/results/quorum.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.chaoslib import crash_marks, reap, tagged_env  # noqa: E402
from bench.sites.run import Proc, free_port  # noqa: E402
from testing import faults  # noqa: E402

PY = sys.executable
STEP_S, H, STEPS, WORKERS = 0.4, 8, 336, 4
QUORUM, GRACE_S = 3, "auto"  # auto: 12.2, from the recent spread of arrivals
#: --max-late-rounds of the quorum runs: a window may merge up to 8 exchanges late, which covers the schedule's 20 s
#: faults (about 6 rounds of 3.2 s) during which the slowed site and the slow uplink miss every exchange.
MAX_LATE = 8
EVAL_EVERY = 48
COMMON = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "4", "--no-progress",
          "--log-every", str(H // 2), "--inner-steps", str(H), "--steps", str(STEPS), "--sim-step-time", str(STEP_S),
          "--dist-timeout", "60", "--bandwidth-gbps", "1", "--latency-ms", "20",
          "--workers", str(WORKERS)]
#: t-quantile of a two-sided 90% interval with n - 1 degrees of freedom (paired over n seeds).
T90 = {2: 6.314, 3: 2.920, 4: 2.353, 5: 2.132}


@dataclass(frozen=True)
class Fault:
    """One entry of the chaos schedule, at ``at_s`` seconds from the moment every job has logged a step."""

    kind: str          # "stall" (SIGSTOP, SIGCONT after length_s), "kill" (SIGKILL, restarted at once with
                       # --resume), "slow" (extra_s more per inner step), "slow link" (extra_s more per round)
    worker: int
    at_s: float
    length_s: float = 0.0
    extra_s: float = 0.0


#: A kill and restart; a 30 s stall; a site at a third of the speed for 20 s (two more step times per step); a
#: slow uplink for one site for 20 s (its payload leaves 2.4 s late each round of 3.2 s of compute). One at a
#: time: with Q = 3 of 4, a quorum bypasses one late worker, and the killed one is out until its restarted job is
#: admitted (up to a minute on a loaded machine), so the kill comes first.
SCHEDULE = (
    Fault("kill", 3, 5.0),
    Fault("stall", 2, 52.0, 30.0),
    Fault("slow", 1, 84.0, 20.0, 2 * STEP_S),
    Fault("slow link", 0, 106.0, 20.0, 0.75 * H * STEP_S),
)


class Watch:
    """The records of one worker's metrics.jsonl with the wall time each was seen (read every 50 ms; a file
    started again by a restarted job is read from its start)."""

    def __init__(self, path: Path) -> None:
        self.path, self.records, self._pos = path, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read()
            time.sleep(0.05)

    def read(self) -> None:
        try:
            size = self.path.stat().st_size
            if size < self._pos:
                self._pos = 0
            with self.path.open() as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        lines = chunk.split("\n")
        self._pos += len(chunk) - len(lines[-1])
        now = time.time()
        for ln in lines[:-1]:
            try:
                self.records.append((now, json.loads(ln)))
            except ValueError:
                continue

    def last_step(self) -> int:
        return int(self.records[-1][1]["step"]) if self.records else 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.read()


def run(method: str, quorum: bool, seed: int, schedule: tuple[Fault, ...], out: Path, grace: str = GRACE_S
        ) -> dict[str, Any]:
    """One run of four jobs through ``schedule``; what the goodput and the losses are counted from."""
    port, tag = free_port(), uuid.uuid4().hex
    env = tagged_env(tag, ROOT)
    coordinator = Proc("coordinator", [PY, "-m", "eagerloco", "coordinator", "--host", "127.0.0.1",
                                       "--port", str(port)], env)
    time.sleep(2)
    elastic = not quorum or any(f.kind == "kill" for f in schedule)
    # Both modes evaluate every EVAL_EVERY steps: under a quorum an evaluating job is a late worker, bypassed like
    # any (12.10); all-or-nothing rounds wait for it. The evaluations give each run's loss by wall clock.
    mode = ["--eval-every", str(EVAL_EVERY)] + (
        ["--quorum", str(QUORUM), "--grace", grace, "--max-late-rounds", str(MAX_LATE)] if quorum else [])
    slow_files = {w: out / f"slow{w}" for w in range(WORKERS)}

    def job(w: int, *extra: str) -> Proc:
        argv = [PY, "-m", "eagerloco", "train", *COMMON, "--method", method, "--seed", str(seed), *mode,
                *(["--elastic"] if elastic else []), "--outer-addr", f"127.0.0.1:{port}", "--worker-id", str(w),
                "--out", str(out / f"w{w}"), *extra]
        return Proc(f"worker {w}", argv, faults.environment(env, slow=slow_files[w]))

    procs = {w: [job(w)] for w in range(WORKERS)}
    watches = {w: Watch(out / f"w{w}" / "metrics.jsonl") for w in range(WORKERS)}
    deadline = time.time() + 600
    while any(not w.records for w in watches.values()):
        if time.time() > deadline or any(p[-1].p.poll() is not None for p in procs.values()):
            raise RuntimeError("a job ended or hung before its first step:\n" + "\n".join(
                ln for p in procs.values() for _, ln in p[-1].lines[-20:]))
        time.sleep(0.05)
    t0 = time.time()
    done: list[dict[str, Any]] = []  # what the schedule did, when
    pending = sorted(schedule, key=lambda f: f.at_s)
    stopped: dict[int, float] = {}
    slowed: dict[int, float] = {}
    while any(p[-1].p.poll() is None for p in procs.values()):
        now = time.time() - t0
        for f in list(pending):
            if now < f.at_s:
                continue
            victim = procs[f.worker][-1]
            if f.kind == "stall":  # mid-window, so that the stop lands in compute, not in an exchange
                if watches[f.worker].last_step() % H != H // 2:
                    continue
                os.kill(victim.p.pid, signal.SIGSTOP)
                stopped[f.worker] = time.time()
            elif f.kind == "kill":
                victim.p.kill()
                victim.p.wait()
                procs[f.worker].append(job(f.worker, "--overwrite"))  # its state comes from a live worker
            else:
                every = H if f.kind == "slow link" else 1
                slow_files[f.worker].write_text(f"{f.extra_s}:{every}")
                slowed[f.worker] = time.time()
            done.append({**asdict(f), "t": round(time.time() - t0, 2)})
            pending.remove(f)
        for w, since in list(stopped.items()):
            f = next(f for f in schedule if f.kind == "stall" and f.worker == w)
            if time.time() - since >= f.length_s:
                os.kill(procs[w][-1].p.pid, signal.SIGCONT)
                done.append({"kind": "stall ends", "worker": w, "t": round(time.time() - t0, 2)})
                del stopped[w]
        for w, since in list(slowed.items()):
            f = next(f for f in schedule if f.kind in ("slow", "slow link") and f.worker == w)
            if time.time() - since >= f.length_s:
                slow_files[w].unlink()
                done.append({"kind": f"{f.kind} ends", "worker": w, "t": round(time.time() - t0, 2)})
                del slowed[w]
        if time.time() - t0 > 900:  # a hang: record it, end the run
            done.append({"kind": "hang: jobs killed", "t": round(time.time() - t0, 2)})
            for p in procs.values():
                p[-1].p.kill()
        time.sleep(0.05)
    for w in watches.values():
        w.stop()
    coordinator.p.terminate()
    coordinator.p.wait(30)
    orphans = reap(tag, 10)
    summaries = {w: json.loads((out / f"w{w}" / "summary.json").read_text())
                 for w in range(WORKERS) if (out / f"w{w}" / "summary.json").exists()}
    output = {w: "\n".join(ln for p in ps for _, ln in p.lines) for w, ps in procs.items()}
    drops = {w: [ln for ln in o.splitlines() if ln.startswith("eagerloco: quorum:") and "dropped" in ln]
             for w, o in output.items()}
    return {"method": method, "quorum": quorum, "seed": seed, "elastic": elastic, "t0": t0, "events": done,
            "grace": grace if quorum else None,
            "exit": {w: [p.p.returncode for p in ps] for w, ps in procs.items()},
            "records": {w: thin(watches[w].records, t0) for w in range(WORKERS)},
            "summaries": {w: {k: v for k, v in s.items() if k != "config"} for w, s in summaries.items()},
            "drop_lines": drops, "crash_marks": {w: crash_marks(o) for w, o in output.items()}, "orphans": orphans,
            "tail": {w: o.splitlines()[-5:] for w, o in output.items()}}


def thin(records: list[tuple[float, dict[str, Any]]], t0: float) -> list[list[Any]]:
    """What the JSON keeps of a job's records (seconds from t0, and the keys goodput and the losses read): the
    exchange steps, the evaluations, and the first and last of each incarnation."""
    keep = []
    for i, (t, r) in enumerate(records):
        edge = i in (0, len(records) - 1) or r["compute_s"] < records[i - 1][1]["compute_s"] or \
            records[i + 1][1]["compute_s"] < r["compute_s"]
        if edge or r["step"] % H == 0 or r.get("eval_loss") is not None:
            keep.append([round(t - t0, 3), {k: r[k] for k in ("step", "compute_s", "blocked_s", "loss", "eval_loss")
                                            if k in r}])
    return keep


def compute_at(records: list[dict[str, Any]], t: float) -> float:
    """A job's compute seconds at time ``t``, interpolated between the records around it."""
    before = [x for x in records if x["seen"] <= t]
    after = [x for x in records if x["seen"] > t]
    if not before or not after:
        return float((before or after)[-1 if before else 0]["compute_s"])
    a, b = before[-1], after[0]
    return a["compute_s"] + (b["compute_s"] - a["compute_s"]) * (t - a["seen"]) / (b["seen"] - a["seen"])


def goodput(r: dict[str, Any]) -> dict[str, Any]:
    """Goodput of one run (bench/quorum/README.md): compute seconds of steps whose outer gradients were merged,
    over the seconds the workers were available (M x the wall clock from the first logged step to the last, less
    the time the schedule stopped a worker or it was dead), and over M x that wall clock."""
    records = {int(w): rs for w, rs in r["records"].items()}
    start = min(rs[0][0] for rs in records.values())
    wall = max(rs[-1][0] for rs in records.values()) - start
    stalled = dead = computed = 0.0
    killed_steps = 0  # steps a killed job computed after its last exchange (they died with it)
    for e in r["events"]:
        if e["kind"] == "stall ends":  # it lands in a step, whose compute_s then holds it: taken off below
            stalled += e["t"] - next(x["t"] for x in r["events"] if x["kind"] == "stall" and x["worker"] == e["worker"])
    for w, rs in records.items():
        incarnations: list[list[dict[str, Any]]] = [[]]  # a restarted job's compute_s counts from 0 again
        for t, rec in rs:
            if incarnations[-1] and rec["compute_s"] < incarnations[-1][-1]["compute_s"]:
                incarnations.append([])
            incarnations[-1].append({**rec, "seen": t})
        for inc in incarnations[:-1]:
            killed_steps += int(inc[-1]["step"]) % H
        for e in r["events"]:
            if e["kind"] == "kill" and e["worker"] == w and len(incarnations) > 1:
                dead += incarnations[1][0]["seen"] - e["t"]
        computed += sum(float(inc[-1]["compute_s"]) for inc in incarnations)
        for e in r["events"]:  # the slowed site computes its steps at a third of the speed: compute time too
            if e["kind"] == "slow" and e["worker"] == w:
                end = next(x["t"] for x in r["events"] if x["kind"] == "slow ends" and x["worker"] == w)
                steps = (compute_at(incarnations[-1], end) - compute_at(incarnations[-1], e["t"])) / STEP_S
                computed += steps * e["extra_s"]
    pw = [s["per_worker"][0] for s in r["summaries"].values() if s.get("per_worker")]
    dropped = sum(int(x.get("late_dropped", 0)) for x in pw)
    # Each drop's line names its window's steps; the one at the run's end does not (counted as H).
    dropped_steps = sum(int(m.group(1)) if (m := re.search(r"\((\d+) steps", ln)) else H
                        for lines in r["drop_lines"].values() for ln in lines)
    lost = max([int(s.get("lost_inner_steps", 0)) for s in r["summaries"].values()] + [killed_steps])
    useful = computed - stalled - (lost + dropped_steps) * STEP_S
    available = WORKERS * wall - stalled - dead
    return {"wall_s": round(wall, 1), "available_s": round(available, 1), "useful_s": round(useful, 1),
            "goodput": round(useful / available, 3), "goodput_wall": round(useful / (WORKERS * wall), 3),
            "stalled_s": round(stalled, 1), "dead_s": round(dead, 1), "lost_steps": lost,
            "quorum_missed": sum(int(x.get("quorum_missed", 0)) for x in pw),
            "late_merged": sum(int(x.get("late_merged", 0)) for x in pw), "late_dropped": dropped,
            "dropped_steps": dropped_steps,
            "drop_lines": sum(len(v) for v in r["drop_lines"].values()),
            "slow_steps": sum(int(x.get("slow_steps", 0)) for x in pw)}


def losses(r: dict[str, Any]) -> dict[str, Any]:
    """Final eval loss (mean over the jobs that finished), tokens, and the eval losses by wall time."""
    finals = [s["final_eval_loss"] for s in r["summaries"].values()]
    evals = sorted((t, rec["step"], rec["eval_loss"]) for rs in r["records"].values() for t, rec in rs
                   if rec.get("eval_loss") is not None)
    tokens = max((s.get("tokens", 0) for s in r["summaries"].values()), default=0)
    return {"final_eval_loss": statistics.fmean(finals) if finals else math.nan, "tokens": tokens, "evals": evals}


def at_wall(r: dict[str, Any], wall_s: float) -> tuple[float, int] | None:
    """The run's newest eval loss (and its step) logged within ``wall_s`` seconds of its first logged step."""
    start = min(rs[0][0] for rs in r["records"].values())
    seen = [(step, loss) for t, step, loss in r["loss"]["evals"] if t - start <= wall_s]
    return (seen[-1][1], seen[-1][0]) if seen else None


def interval(deltas: list[float]) -> str:
    """Mean and paired 90% interval of ``deltas`` (one per seed)."""
    m = statistics.fmean(deltas)
    if len(deltas) < 2:
        return f"{m:+.3f}"
    h = T90.get(len(deltas), 1.645) * statistics.stdev(deltas) / math.sqrt(len(deltas))
    return f"{m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]"


def report(results: list[dict[str, Any]]) -> str:
    """bench/results/quorum.md: per run, then per method the quorum runs against the all-or-nothing ones."""
    for r in results:  # counted again from the records, as this file counts them now
        r["goodput"], r["loss"] = goodput(r), losses(r)
    sched = "; ".join(f"{f.kind} of worker {f.worker} at {f.at_s:g} s" + (f" for {f.length_s:g} s" if f.length_s
                                                                            else "") for f in SCHEDULE)
    lines = ["# Goodput under chaos: quorum exchanges against all-or-nothing rounds, measured", "",
             f"`bench/quorum/run.py`: 4 jobs (`eagerloco train --outer-addr`) at `eagerloco coordinator`, tiny model, "
             f"{STEPS} steps paced to {STEP_S} s (`--sim-step-time`), H = {H}, quorum runs `--quorum {QUORUM} "
             f"--grace {GRACE_S} --max-late-rounds {MAX_LATE}` (all-or-nothing: `--elastic`, no quorum). Schedule "
             f"(seconds from every job's first step): {sched}. Goodput as bench/quorum/README.md defines it; loss: "
             "final eval loss (mean over the jobs), at equal tokens the end of both runs (same steps), at equal wall "
             "clock the all-or-nothing run's "
             "last evaluation within the quorum run's wall clock.", "",
             "| method | rounds | seed | goodput | goodput (M x wall) | wall s | final loss | "
             "missed / merged late / dropped (log lines, steps) | faults run | exit (processes left) | load |",
             "|---" * 11 + "|"]
    for r in sorted(results, key=lambda r: (r["method"], r["quorum"], grace_of(r), r["seed"])):
        g = r["goodput"]
        kinds = sorted({e["kind"] for e in r["events"] if not e["kind"].endswith("ends")})
        rounds = f"quorum, grace {grace_of(r)}" if r["quorum"] else "all-or-nothing"
        lines.append(f"| {r['method']} | {rounds} | {r['seed']} | "
                     f"{g['goodput']:.3f} | {g['goodput_wall']:.3f} | {g['wall_s']:.0f} | "
                     f"{r['loss']['final_eval_loss']:.4f} | {g['quorum_missed']} / {g['late_merged']} / "
                     f"{g['late_dropped']} ({g['drop_lines']}, {g['dropped_steps']}) | {', '.join(kinds) or 'none'} | "
                     f"{exits(r)} ({r['orphans']}) | {r['load'][0]:.1f} |")
    lines += ["", "## Quorum against all-or-nothing, paired by seed", "",
              "| method | goodput quorum | goodput all-or-nothing | final loss, quorum - all-or-nothing (equal "
              "tokens), 90% | quorum's final - all-or-nothing's at the quorum run's wall clock | seeds |",
              "|---|---|---|---|---|---|"]
    for method in sorted({r["method"] for r in results}):
        chaos = [r for r in results if r["method"] == method and r["schedule"]]
        pairs = [(q, a) for q in chaos for a in chaos if q["seed"] == a["seed"] and q["quorum"] and not a["quorum"]
                 and grace_of(q) == GRACE_S
                 and q["schedule"] == a["schedule"]]
        if not pairs:
            continue
        gq = [q["goodput"]["goodput"] for q, _ in pairs]
        ga = [a["goodput"]["goodput"] for _, a in pairs]
        tokens = [q["loss"]["final_eval_loss"] - a["loss"]["final_eval_loss"] for q, a in pairs]
        walls = [q["loss"]["final_eval_loss"] - w[0] for q, a in pairs
                 if (w := at_wall(a, q["goodput"]["wall_s"])) is not None]
        lines.append(f"| {method} | {statistics.fmean(gq):.3f} ({min(gq):.3f}-{max(gq):.3f}) | "
                     f"{statistics.fmean(ga):.3f} ({min(ga):.3f}-{max(ga):.3f}) | {interval(tokens)} | "
                     f"{interval(walls) if walls else 'n/a'} | {len(pairs)} |")
    return "\n".join(lines + simulated()) + "\n"


def grace_of(r: dict[str, Any]) -> str | None:
    """The quorum run's --grace (runs recorded before the bench kept it ran with 0.5 s)."""
    return r.get("grace", "0.5") if r["quorum"] else None


def exits(r: dict[str, Any]) -> str:
    """Each job's exit statuses (a killed and restarted job's two), compact."""
    return " ".join(f"{w}:{'/'.join(map(str, rcs))}" for w, rcs in r["exit"].items())


def simulated() -> list[str]:
    """The simulated goodput from 8 to 10,000 workers (bench/results/quorum_sim.json), DiLoCo's and eager's rows."""
    path = ROOT / "bench" / "results" / "quorum_sim.json"
    if not path.exists():
        return []
    lines = ["", "## Beside it: goodput simulated from 8 to 10,000 workers", "",
             "From `bench/results/quorum_sim.md` (`eagerloco simulate --goodput`, docs/algorithms.md 12.9: a 10b "
             "model, H = 100, restart 600 s, Q = ceil(0.9 M), over M x the wall clock), all-or-nothing / quorum:", "",
             "| scenario | M | DiLoCo | eager |", "|---|---|---|---|"]
    for name, sc in json.loads(path.read_text()).items():
        rows = {(r["workers"], r["method"]): r for g in sc["goodput"] for r in g["rows"]}
        for m in sorted({w for w, _ in rows}):
            cells = [f"{rows[m, k]['all_or_nothing']['goodput']:.3f} / {rows[m, k]['quorum_exchange']['goodput']:.3f}"
                     if (m, k) in rows else "" for k in ("diloco", "eager")]
            lines.append(f"| {name}: {sc['about']} | {m} | {cells[0]} | {cells[1]} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="diloco,eager")
    ap.add_argument("--without", default="", help="fault kinds left out of both modes' schedule (comma list): "
                    "a kill and restart under quorum needs quorum exchanges that compose with --elastic")
    ap.add_argument("--modes", default="all-or-nothing,quorum")
    ap.add_argument("--grace", default=GRACE_S, help="the quorum runs' --grace (the report pairs those with "
                    f"{GRACE_S!r} only)")
    ap.add_argument("--clean", action="store_true", help="no faults: the machine's ceiling for each mode")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quorum.json"))
    ap.add_argument("--report", action="store_true", help="only write the Markdown beside --out from its runs")
    args = ap.parse_args()
    skip = {k for k in args.without.split(",") if k}
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else []
    if args.report:
        out_path.with_suffix(".md").write_text(report(results))
        return
    for seed in [int(x) for x in args.seeds.split(",")]:
        for method in args.methods.split(","):
            for quorum in [m == "quorum" for m in args.modes.split(",")]:
                schedule = () if args.clean else tuple(f for f in SCHEDULE if f.kind not in skip)
                with tempfile.TemporaryDirectory() as tmp:
                    t = time.time()
                    r = run(method, quorum, seed, schedule, Path(tmp), args.grace)
                r["run_s"], r["schedule"] = round(time.time() - t, 1), [f.kind for f in schedule]
                r["load"] = os.getloadavg()
                r["goodput"] = goodput(r)
                r["loss"] = losses(r)
                print(json.dumps({k: r[k] for k in ("method", "quorum", "seed", "exit", "goodput", "run_s")}
                                 | {"final": r["loss"]["final_eval_loss"]}), flush=True)
                key = (method, quorum, seed, r["schedule"], grace_of(r))
                results = [x for x in results
                           if (x["method"], x["quorum"], x["seed"], x.get("schedule"), grace_of(x)) != key]
                results.append(r)
                out_path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
