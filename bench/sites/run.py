"""Sites that come and go: four `eagerloco train --outer-addr --elastic` jobs at a coordinator, through a scripted
schedule of faults, against the same run uninterrupted.

Run from the repository root: ``nice -n 10 .venv/bin/python bench/sites/run.py``. For DiLoCo and eager, on an
emulated link (0.1 Gbit/s, 50 ms), tiny model: worker 0 killed (SIGKILL) and restarted with ``--resume``, a new
worker (id 4) joining, worker 3 killed for good, the coordinator killed and restarted. The schedule follows
worker 1's logged steps. It records every job's exit status, the time from each fault to the survivors' group
re-formed (and to the next logged step after it), the join and state-transfer times the joiners print, the final
eval loss against the uninterrupted run at equal steps and at equal tokens, whether every checkpoint loads, and
whether any process is left. Tokens under churn are the members' inner steps (at each step, the workers in the
group) times the batch's tokens, counted from worker 1's lines: the steps a killed worker ran after its last
exchange that reached the model count nowhere. The run at equal tokens is the same run uninterrupted (same seed,
four workers) with as many steps as give those tokens, rounded to a round (its learning-rate schedule ends there).

Results: bench/results/sites.json and bench/results/sites.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagerloco import checkpoint as ckpt  # noqa: E402
from eagerloco.train.job import worker_steps  # noqa: E402

PY = sys.executable
STARTED: list[subprocess.Popen] = []  # every process the benchmark started
STEPS, H, WORKERS, BATCH_TOKENS = 192, 4, 4, 2 * 32
COMMON = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "16", "--no-progress",
          "--log-every", "4", "--inner-steps", str(H), "--checkpoint-every", "16",
          "--bandwidth-gbps", "0.1", "--latency-ms", "50", "--dist-timeout", "20", "--elastic", "--workers", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A process whose output lines are kept with the time each arrived."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.lines = name, []
        self.p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        STARTED.append(self.p)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        return next(((t, ln) for t, ln in self.lines if t >= after and re.search(pattern, ln)), None)


def run(method: str, faults: bool, out: Path, steps: int = STEPS) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # A joiner writes the bytecode it compiles once, as `make` lets every run: else each start compiles torch again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    coord = ["-m", "eagerloco", "coordinator", "--host", "127.0.0.1", "--port", str(port)]
    procs: dict[str, Proc] = {"coordinator": Proc("coordinator", [PY, *coord], env)}
    time.sleep(3)

    def job(w: int, *extra: str) -> Proc:
        return Proc(f"worker {w}", [PY, "-m", "eagerloco", "train", *COMMON, "--steps", str(steps), "--method",
                                    method, "--outer-addr",
                                    f"127.0.0.1:{port}", "--worker-id", str(w), "--out", str(out / f"w{w}"),
                                    *extra], env)

    for w in range(4):
        procs[f"worker {w}"] = job(w)
    events: list[dict[str, Any]] = []

    def at_step(step: int) -> None:  # worker 1's metrics.jsonl has logged this step
        log = out / "w1" / "metrics.jsonl"
        while not (log.exists() and f'"step": {step},' in log.read_text()):
            if procs["worker 1"].p.poll() is not None:
                raise RuntimeError("worker 1 ended before the schedule did:\n" + "\n".join(
                    ln for _, ln in procs["worker 1"].lines[-30:]))
            time.sleep(0.1)

    if faults:
        at_step(32)
        t = time.time()
        procs["worker 0"].p.kill()
        procs["worker 0"].p.wait()
        events.append({"fault": "worker 0 killed", "t": t})
        procs["worker 0 (back)"] = job(0, "--resume")
        events.append({"fault": "worker 0 restarted", "t": time.time()})
        at_step(80)
        procs["worker 4"] = job(4)
        events.append({"fault": "worker 4 started", "t": time.time()})
        at_step(120)
        t = time.time()
        procs["worker 3"].p.kill()
        procs["worker 3"].p.wait()
        events.append({"fault": "worker 3 killed for good", "t": t})
        at_step(152)
        t = time.time()
        procs["coordinator"].p.kill()
        procs["coordinator"].p.wait()
        time.sleep(2)
        procs["coordinator (back)"] = Proc("coordinator", [PY, *coord], env)
        events.append({"fault": "coordinator killed, restarted 2 s later", "t": t})
    jobs = {k: v for k, v in procs.items() if k.startswith("worker")}
    for p in jobs.values():
        try:
            p.p.wait(900)
        except subprocess.TimeoutExpired:
            p.p.kill()
    coordinator = procs.get("coordinator (back)", procs["coordinator"])
    coordinator.p.terminate()
    coordinator.p.wait(30)
    w1 = procs["worker 1"]
    for e in events:  # when the survivors' group was re-formed (or a joiner admitted), and the next step logged
        pattern = {"worker 0 killed": r"lost 0; continuing", "worker 0 restarted": r"workers \[0\] joined",
                   "worker 4 started": r"workers \[4\] joined",
                   "worker 3 killed for good": r"lost 3; continuing"}.get(e["fault"])
        hit = w1.first(pattern, e["t"]) if pattern else None
        if hit is not None:
            e["to_regroup_s"] = round(hit[0] - e["t"], 2)
            e["line"] = hit[1].removeprefix("eagerloco: ")
        if e["fault"].startswith("coordinator"):
            e["workers_that_waited"] = sorted(k for k, p in jobs.items() if p.first("waiting for the coordinator"))
        e.pop("t")
    joins = {k: p.first(r"joined at step (\d+) with state from worker \d+ \(([\d.]+) s") for k, p in jobs.items()}
    summaries = {}
    checkpoints, unloadable = 0, []
    for d in sorted(out.glob("w*")):
        s = d / "summary.json"
        if s.exists():
            summaries[d.name] = json.loads(s.read_text())["final_eval_loss"]
        for c in ckpt.list_checkpoints(ckpt.checkpoint_root(d)):
            checkpoints += 1
            try:
                for f in ckpt.verify(c)["files"]:
                    ckpt.load_worker_state(c, int(f["file"].split("_")[1].split(".")[0]))
            except Exception as e:  # recorded, not raised: the table says which
                unloadable.append(f"{c}: {e}")
    # Any process of this run: a worker (its --outer-addr) or a coordinator (its --port).
    left = subprocess.run(["pgrep", "-f", f"(127\\.0\\.0\\.1:|--port ){port}( |$)"], capture_output=True,
                          text=True).stdout.split()
    return {"method": method, "faults": faults, "steps": steps, "exit": {k: p.p.returncode for k, p in jobs.items()},
            "events": events, "joins": {k: v[1] for k, v in joins.items() if v},
            "worker_steps": worker_steps(membership(w1.lines), WORKERS, 0, steps),
            "final_eval_loss": summaries, "checkpoints": checkpoints, "unloadable": unloadable,
            "processes_left": left}


def membership(lines: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """Worker 1's membership changes as (step, time, members) events, from its "lost" and "joined" lines."""
    changes = []
    for t, ln in lines:
        lost = re.search(r"continuing with workers \[([\d, ]*)\] \(epoch \d+, step (\d+)", ln)
        joined = re.search(r"joined at step (\d+); members \[([\d, ]*)\]", ln)
        if lost:
            changes.append({"step": int(lost[2]), "time": t, "members": lost[1].split(", ")})
        elif joined and "with state from" not in ln:
            changes.append({"step": int(joined[1]), "time": t, "members": joined[2].split(", ")})
    return changes


def timed(method: str, faults: bool, steps: int = STEPS) -> dict[str, Any]:
    """One run in a directory of its own, its wall time added; a run that failed leaves no process behind."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        try:
            r = run(method, faults, Path(tmp), steps)
        finally:
            for p in STARTED:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        r["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    results = []
    for method in ("diloco", "eager"):
        results += [timed(method, False), faulted := timed(method, True)]
        # The same run uninterrupted with the tokens the faulted one trained on (whole rounds).
        results.append(timed(method, False, H * round(faulted["worker_steps"] / WORKERS / H)))
    (ROOT / "bench" / "results" / "sites.json").write_text(json.dumps(results, indent=1) + "\n")
    (ROOT / "bench" / "results" / "sites.md").write_text(report(results))


def report(results: list[dict[str, Any]]) -> str:
    """sites.md: the final losses at equal steps and at equal tokens, then one block per run."""
    def loss(r: dict[str, Any]) -> float:  # worker 1's: a member from start to end
        return float(r["final_eval_loss"]["w1"])

    lines = ["# Sites that come and go", "",
             "`bench/sites/run.py`: 4 jobs (`train --outer-addr --elastic`), tiny model, "
             f"{STEPS} steps, H = {H}, emulated link 0.1 Gbit/s and 50 ms, a coordinator (`eagerloco coordinator`), "
             "final eval loss of worker 1's outer parameters on 16 batches. Tokens: the members' inner steps (the "
             "workers in the group at each step) times 64 tokens; a killed worker's steps after its last exchange "
             "that reached the model count nowhere.", "",
             "| method | uninterrupted, 192 steps | scheduled faults, 192 steps | uninterrupted at equal tokens | "
             "faults - equal steps | faults - equal tokens |", "|---|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in results):
        full, faulted, equal = (r for r in results if r["method"] == method)
        cell = [f"{loss(r):.4f} ({r['worker_steps'] * BATCH_TOKENS:,} tokens, {r['steps']} steps)"
                for r in (full, faulted, equal)]
        lines.append(f"| {method} | {' | '.join(cell)} | {loss(faulted) - loss(full):+.4f} | "
                     f"{loss(faulted) - loss(equal):+.4f} |")
    lines += ["", "Times are wall seconds from the fault (the kill, the joiner's start) to worker 1's line saying the "
              "group was re-formed or the joiner admitted: the next round runs on that group.", ""]
    for r in results:
        kind = "scheduled faults" if r["faults"] else "uninterrupted"
        lines += [f"## {r['method']}, {kind}, {r['steps']} steps ({r['wall_s']} s)", "",
                  f"- exit status: {r['exit']}",
                  f"- final eval loss: {r['final_eval_loss']}",
                  f"- tokens: {r['worker_steps'] * BATCH_TOKENS:,} ({r['worker_steps']} worker-steps)",
                  f"- joins (step, state transfer s): {r['joins'] or 'none'}",
                  f"- checkpoints: {r['checkpoints']}, every one verified and loaded: "
                  f"{'yes' if not r['unloadable'] else r['unloadable']}; processes left: "
                  f"{r['processes_left'] or 'none'}",
                  ""]
        if r["events"]:
            lines += ["| fault | to regroup s | worker 1's line |", "|---|---|---|"]
            for e in r["events"]:
                note = e.get("line", "")
                if "workers_that_waited" in e:
                    note = f"exchanges went on; workers that waited over 10 s: {e['workers_that_waited'] or 'none'}"
                lines.append(f"| {e['fault']} | {e.get('to_regroup_s', '')} | {note} |")
            lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
