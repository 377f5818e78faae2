"""Running the jobs of one scenario and measuring each: exit, crash marks, hang, wait, files kept.

A :class:`Job` is one ``eagerloco train --outer-addr`` process (one worker, its own ``--out``). A
:class:`Plan` is the jobs of one try of a scenario, what each is expected to do, and the fault that
hits them. :func:`run_plan` starts the jobs, watches them every 50 ms (the moment each takes its run
directory's lock, the moment it exits), injects the fault, kills a job that hangs, and records
everything :func:`measure` then judges.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.chaoslib import crash_marks, reap, tagged_env
from eagerloco import checkpoint as ckpt
from eagerloco.comm.rendezvous import parameter_digest
from testing import faults

ROOT = Path(__file__).resolve().parents[2]
LOCK = ".eagerloco.lock"
#: Files planted in every --out before a fresh start: each must be there, unchanged, afterwards. (A fresh
#: run refuses a --out that holds files at its own paths, such as checkpoints/mine: those are planted
#: only before a --resume, by :func:`plant`'s ``extra``.)
PLANTED = ("notes.txt", "mine/best.pth")
TICK_S = 0.05

# What a job is expected to do.
FINISH = "finish"      # exit 0 (and, where `match`, with the numbers of the clean run)
FAIL = "fail"          # stop with an error (one line naming the cause), within the timeout plus 10 s of the fault
STOPPED = "stopped"    # stopped by the signal sent to it: exit 128 + the signal, at once
VICTIM = "victim"      # killed (SIGKILL) by the fault


@dataclass
class Job:
    """One worker's process and what is expected of it."""

    worker: int
    out: Path
    argv: list[str]
    expect: str
    env: dict[str, str] = field(default_factory=dict)
    match: bool = False          # a FINISH job must end with the clean run's numbers
    needle: str = ""             # what a FAIL or STOPPED job's last line must name
    rcs: tuple[int, ...] = ()    # the exit statuses expected (empty: any non-zero for FAIL)
    extra_s: float = 0.0         # seconds a FINISH job may take beyond the clean run (injected delays)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    t_start: float = 0.0
    t_lock: float | None = None
    t_exit: float | None = None
    fault_t: float | None = None  # when the fault it must react to happened (its wait began)
    rc: int | None = None
    hung: bool = False

    def alive(self) -> bool:
        return self.proc is not None and self.t_exit is None


@dataclass
class Plan:
    """One try of a scenario: its jobs, and the fault, called every tick with the plan and the time."""

    scenario: str
    workers: int
    seed: int
    port: int
    jobs: list[Job]
    fault: Callable[[Plan, float], None] = lambda plan, now: None
    finish_s: float = 60.0        # how long a clean run of these jobs takes (measured)
    timeout_s: float = 8.0        # --dist-timeout
    injected: str = ""            # what the fault did, once it did
    listener: socket.socket | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def job(self, worker: int) -> Job:
        return next(j for j in self.jobs if j.worker == worker)


def plant(out: Path, names: tuple[str, ...] = PLANTED) -> dict[str, str]:
    """Put files a user might keep in ``out`` (a ``.txt`` of notes, a ``.pth`` model of their own) before
    a run; returns their SHA-256s by relative path."""
    out.mkdir(parents=True, exist_ok=True)
    for rel in names:
        f = out / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if f.suffix == ".pth":
            torch.save({"weight": torch.arange(12.0).reshape(3, 4)}, f)
        else:
            f.write_text(f"my notes about {out.name}\n")
    return {p: hashlib.sha256((out / p).read_bytes()).hexdigest() for p in names}


def files_lost(out: Path, planted: dict[str, str]) -> list[str]:
    """What of ``out`` did not survive: planted files missing or changed, published checkpoints that no
    longer verify (:func:`eagerloco.checkpoint.verify`)."""
    lost = []
    for rel, digest in planted.items():
        f = out / rel
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            lost.append(rel)
    for path in ckpt.list_checkpoints(ckpt.checkpoint_root(out)):
        try:
            ckpt.verify(path)
        except ckpt.CheckpointError as e:
            lost.append(f"{path.name}: {e}")
    return lost


def final_numbers(out: Path, worker: int, steps: int) -> dict[str, Any] | None:
    """A finished job's final eval loss and a digest of its final outer parameters (its step-``steps``
    checkpoint), or None where it has no summary."""
    summary = out / "summary.json"
    if not summary.is_file():
        return None
    s = json.loads(summary.read_text())
    state_file = ckpt.checkpoint_dir(ckpt.checkpoint_root(out), steps) / f"worker_{worker}.pt"
    digest = None
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        digest = parameter_digest(_tensors(state["sync"]["outer"]))
    return {"final_eval_loss": s.get("final_eval_loss"), "outer_digest": digest, "members": s.get("members")}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def job_env(tag: str, kill: str | None = None, eval_delay: float | None = None) -> dict[str, str]:
    """A job's environment: tagged (:mod:`bench.chaoslib`), with fault injection installed."""
    return faults.environment(tagged_env(tag, ROOT), kill=kill, eval_delay=eval_delay)


def train_argv(common: list[str], port: int, worker: int, workers: int, out: Path,
               override: dict[str, str] | None = None, resume: bool = False) -> list[str]:
    """``python -m eagerloco train`` for one job; ``override`` replaces flags' values (a mismatch)."""
    args = list(common)
    for flag, value in (override or {}).items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if "--workers" not in (override or {}):
        args += ["--workers", str(workers)]
    return [sys.executable, "-m", "eagerloco", "train", *args, "--outer-addr", f"127.0.0.1:{port}",
            "--worker-id", str(worker), "--out", str(out), *(["--resume"] if resume else [])]


def silent_listener(port: int) -> socket.socket:
    """A TCP listener on ``port`` that accepts every connection and never says a word."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed: the scenario is over
                for c in held:
                    c.close()
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return srv


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on ``port`` (read from /proc, without connecting)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = [ln.split() for ln in Path(table).read_text().splitlines()[1:]]
        except OSError:
            continue
        if any(len(r) > 3 and r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in rows):
            return True
    return False


def steps_done(out: Path) -> int:
    """The newest step in a job's metrics.jsonl (0 before the first)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for ln in reversed(lines):
        try:
            return int(json.loads(ln)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def send(plan: Plan, job: Job, sig: int, now: float) -> None:
    """Send ``sig`` to a job (its fault time is now)."""
    if job.alive():
        assert job.proc is not None
        os.kill(job.proc.pid, sig)
        plan.injected = f"{signal.Signals(sig).name} to worker {job.worker}"
        job.fault_t = now


def should_end(plan: Plan, job: Job) -> float | None:
    """When a job should have exited, or None while that is not known (its fault has not happened)."""
    if job.expect in (FINISH, VICTIM):
        return job.t_start + 1.5 * plan.finish_s + job.extra_s + (plan.timeout_s if job.expect == FINISH else 0)
    if job.fault_t is None:
        return None
    return job.fault_t + (plan.timeout_s if job.expect == FAIL else 0.0)


def run_plan(plan: Plan, logs: Path) -> None:
    """Start every job of the plan, inject its fault, wait for all (killing the ones that hang)."""
    tag = uuid.uuid4().hex
    grace = plan.timeout_s + 10.0
    # The run's coordinator (as `eagerloco coordinator`), served here; a plan with a silent listener has none.
    coordinator = None if plan.listener is not None else dist.TCPStore("127.0.0.1", plan.port, is_master=True,
                                                                       wait_for_workers=False)
    backstop = 2.0 * plan.finish_s + 2.0 * plan.timeout_s + 60.0  # a fault that never came
    for job in plan.jobs:
        job.log = logs / f"{plan.scenario.replace(' ', '_')}-{plan.port}-w{job.worker}.log"
        env = {**job_env(tag), **job.env}
        with job.log.open("w") as f:
            job.proc = subprocess.Popen(job.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        job.t_start = time.monotonic()
    try:
        while any(j.alive() for j in plan.jobs):
            now = time.monotonic()
            for j in plan.jobs:
                if j.t_lock is None and (j.out / LOCK).exists():
                    j.t_lock = now
                if j.alive() and j.proc is not None and j.proc.poll() is not None:
                    j.t_exit, j.rc = now, j.proc.returncode
            plan.fault(plan, now)
            for j in plan.jobs:
                end = should_end(plan, j)
                limit = end + grace if end is not None else j.t_start + backstop
                if j.alive() and now > limit and j.proc is not None:
                    j.proc.kill()
                    j.hung, j.rc, j.t_exit = True, j.proc.wait(), now
            time.sleep(TICK_S)
    finally:
        for j in plan.jobs:
            if j.alive() and j.proc is not None:
                j.proc.kill()
                j.rc, j.t_exit = j.proc.wait(), time.monotonic()
        if plan.listener is not None:
            plan.listener.close()
        del coordinator
        plan.notes["orphans"] = reap(tag, wait_s=5.0)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def measure(plan: Plan, planted: dict[int, dict[str, str]], reference: dict[int, dict[str, Any]] | None,
            steps: int) -> list[dict[str, Any]]:
    """Judge every job of a finished plan; one record per job."""
    grace = plan.timeout_s + 10.0
    records = []
    for j in plan.jobs:
        assert j.log is not None and j.t_exit is not None
        text = j.log.read_text(errors="replace")
        line = last_line(text)
        rec: dict[str, Any] = {
            "scenario": plan.scenario, "workers": plan.workers, "seed": plan.seed, "port": plan.port,
            "worker": j.worker, "expect": j.expect, "rc": j.rc, "seconds": round(j.t_exit - j.t_start, 2),
            "crash_marks": crash_marks(text), "hang": j.hung, "fault": plan.injected, "last_line": line[:400],
            "files_lost": files_lost(j.out, planted[j.worker]), "log": str(j.log),
        }
        if j.expect in (FAIL, STOPPED) and j.fault_t is not None:
            rec["wait_s"] = round(j.t_exit - j.fault_t, 2)
            rec["wait_ok"] = rec["wait_s"] <= grace and not j.hung
        wrong = ""
        if j.rc == 0 and j.expect in (FAIL, STOPPED):
            wrong = "exited 0 where it must fail"
        if j.expect == FINISH:
            got = final_numbers(j.out, j.worker, steps)
            rec["numbers"] = got
            if j.rc == 0 and j.match and reference is not None:
                want = reference.get(j.worker)
                if got is None or want is None or (got["final_eval_loss"], got["outer_digest"]) != (
                        want["final_eval_loss"], want["outer_digest"]):
                    wrong = f"numbers differ from the clean run: {got} against {want}"
        rec["wrong"] = wrong
        rec["expected_exit"] = _expected_exit(j)
        if j.expect in (FAIL, STOPPED):  # (the run's paths left out: their names hold the scenario's)
            bare = line.replace(str(j.out.parent), "")
            rec["clear_line"] = bare.startswith("eagerloco: ") and j.needle in bare
        records.append(rec)
    return records


def _expected_exit(j: Job) -> bool:
    if j.expect == FINISH:
        return j.rc == 0
    if j.expect == VICTIM:
        return j.rc == -signal.SIGKILL
    if j.rcs:
        return j.rc in j.rcs
    return j.rc not in (0, None) and j.rc > 0


def fresh_out(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


__all__ = ["FAIL", "FINISH", "PLANTED", "STOPPED", "VICTIM", "Job", "Plan", "files_lost", "final_numbers",
           "fresh_out", "job_env", "listening", "measure", "plant", "run_plan", "send", "silent_listener",
           "steps_done", "train_argv"]
