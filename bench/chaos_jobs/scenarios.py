"""The scenarios of the separate-jobs chaos benchmark: each builds the jobs of one try, the fault that
hits them and what each job must do, runs them (:func:`bench.chaos_jobs.harness.run_plan`) and
returns one record per job (:func:`bench.chaos_jobs.harness.measure`).
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos_jobs.harness import (
    FAIL,
    FINISH,
    STOPPED,
    VICTIM,
    Job,
    Plan,
    final_numbers,
    fresh_out,
    listening,
    measure,
    plant,
    run_plan,
    send,
    silent_listener,
    steps_done,
    train_argv,
)
from eagerloco import checkpoint as ckpt
from eagerloco.comm.errors import PEER_EXIT_CODE
from testing.faults import FAULT_EVAL_DELAY_ENV, FAULT_KILL_ENV

#: The step after which a job is killed (it dies 50 ms into the next), or signalled mid-run.
FAULT_STEP = 7
#: The line of a resumed job that says from which step (``train/resume.py``'s announcement).
RESUMED = re.compile(r"^resuming from .* \(step (\d+) of \d+\)$", re.MULTILINE)
#: Seconds a job waits after taking its run directory's lock before it is taken to be at the rendezvous.
AT_RENDEZVOUS_S = 3.0
Records = list[dict[str, Any]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Bench:
    """The settings every scenario shares, the work directory, and the clean runs' numbers and times."""

    work: Path
    steps: int
    timeout_s: float
    eval_every: int
    references: dict[tuple[int, int], dict[int, dict[str, Any]]] = field(default_factory=dict)
    finish_s: dict[int, float] = field(default_factory=dict)
    tries: int = 0

    def common(self, seed: int) -> list[str]:
        return ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
                "--log-every", "1", "--eval-every", str(self.eval_every), "--seed", str(seed), "--method", "diloco",
                "--inner-steps", "2", "--steps", str(self.steps), "--checkpoint-every", "2", "--keep-checkpoints",
                "3", "--dist-timeout", f"{self.timeout_s:g}"]

    def plan(self, scenario: str, workers: int, seed: int, port: int | None = None) -> Plan:
        self.tries += 1
        return Plan(scenario, workers, seed, port or free_port(), [], finish_s=self.finish_s.get(workers, 60.0),
                    timeout_s=self.timeout_s)

    def outs(self, plan: Plan) -> tuple[list[Path], dict[int, dict[str, str]]]:
        """A fresh --out per worker with the planted files; their digests by worker."""
        base = self.work / f"{plan.scenario.replace(' ', '_')}-{self.tries}"
        outs = [fresh_out(base / f"w{w}") for w in range(plan.workers)]
        return outs, {w: plant(out) for w, out in enumerate(outs)}

    def add(self, plan: Plan, worker: int, out: Path, expect: str, extra: list[str] | None = None,
            override: dict[str, str] | None = None, resume: bool = False, **kw: Any) -> Job:
        argv = train_argv(self.common(plan.seed) + (extra or []), plan.port, worker, plan.workers, out, override,
                          resume)
        job = Job(worker, out, argv, expect, **kw)
        plan.jobs.append(job)
        return job

    def run(self, plan: Plan, planted: dict[int, dict[str, str]], compare: bool = False) -> Records:
        run_plan(plan, self.work)
        ref = self.references.get((plan.workers, plan.seed)) if compare else None
        records = measure(plan, planted, ref, self.steps)
        for r in records:
            r["orphans"] = plan.notes.get("orphans", 0)
        return records


# -- faults: called every tick with the plan and the time ------------------------------------------

def at_arrival(plan: Plan, now: float) -> None:
    """A peer that never comes: each job's wait begins when it reaches the run (takes its lock)."""
    for j in plan.jobs:
        if j.fault_t is None and j.t_lock is not None:
            j.fault_t = j.t_lock


def at_last_arrival(plan: Plan, now: float) -> None:
    """Settings that differ: the fault is there once the last job reached the run."""
    locks = [j.t_lock for j in plan.jobs]
    if all(t is not None for t in locks) and plan.jobs[0].fault_t is None:
        for j in plan.jobs:
            j.fault_t = max(t for t in locks if t is not None)


def when_victim_dies(victim: int) -> Any:
    def fault(plan: Plan, now: float) -> None:
        v = plan.job(victim)
        if v.t_exit is not None and not plan.injected:
            plan.injected = f"worker {victim} killed (SIGKILL) after step {FAULT_STEP}, exit {v.rc}"
            for j in plan.jobs:
                if j is not v:
                    j.fault_t = v.t_exit
    return fault


def signal_at_rendezvous(target: int, sig: int) -> Any:
    """``sig`` to a job waiting at the rendezvous; the others wait for the absent worker, as before."""
    def fault(plan: Plan, now: float) -> None:
        at_arrival(plan, now)
        t = plan.job(target)
        if plan.injected or t.t_lock is None:
            return
        if target == 0:  # the coordinator listens from the start: worker 0 waits for the others
            ready = listening(plan.port) and now - t.t_lock > 1.0
        else:
            ready = now - t.t_lock > AT_RENDEZVOUS_S
        if ready:
            send(plan, t, sig, now)
    return fault


def signal_mid_run(target: int, sig: int) -> Any:
    """``sig`` to a job once it logged step FAULT_STEP - 1; the others must name it and stop."""
    def fault(plan: Plan, now: float) -> None:
        t = plan.job(target)
        if not plan.injected and steps_done(t.out) >= FAULT_STEP - 1:
            send(plan, t, sig, now)
            for j in plan.jobs:
                j.fault_t = now
    return fault


# -- scenarios ------------------------------------------------------------------------------------

def clean(b: Bench, workers: int, seed: int) -> Records:
    """An uninterrupted run: the numbers the other scenarios must end with, and how long a run takes."""
    plan = b.plan("clean run", workers, seed)
    outs, planted = b.outs(plan)
    for w in range(workers):
        b.add(plan, w, outs[w], FINISH)
    records = b.run(plan, planted)
    b.references[(workers, seed)] = {w: final_numbers(outs[w], w, b.steps) or {} for w in range(workers)}
    b.finish_s[workers] = max(b.finish_s.get(workers, 0.0), *(r["seconds"] for r in records))
    return records


def mismatch(b: Bench, workers: int, seed: int, flag: str, value: str, odd: int) -> Records:
    """One job started with a different value of ``flag``: every job stops with one line naming it."""
    plan = b.plan(f"mismatched {flag}", workers, seed)
    plan.fault = at_last_arrival
    outs, planted = b.outs(plan)
    for w in range(workers):
        b.add(plan, w, outs[w], FAIL, override={flag: value} if w == odd else None, needle=flag)
    plan.injected = f"worker {odd}: {flag} {value}"
    return b.run(plan, planted)


def missing(b: Bench, workers: int, seed: int, absent: int) -> Records:
    """Worker ``absent`` never starts: the others stop within the timeout, naming it."""
    plan = b.plan(f"missing worker {'0' if absent == 0 else 'other than 0'}", workers, seed)
    plan.fault, plan.injected = at_arrival, f"worker {absent} never started"
    outs, planted = b.outs(plan)
    for w in range(workers):
        if w != absent:
            b.add(plan, w, outs[w], FAIL, needle=f"worker {absent}", rcs=(PEER_EXIT_CODE,))
    return b.run(plan, planted)


def silent(b: Bench, workers: int, seed: int) -> Records:
    """A listener on the coordinator's port that accepts and never answers: every worker stops within the timeout."""
    plan = b.plan("silent coordinator", workers, seed)
    plan.listener = silent_listener(plan.port)
    plan.fault, plan.injected = at_arrival, "a silent listener in the coordinator's place"
    outs, planted = b.outs(plan)
    for w in range(1, workers):
        b.add(plan, w, outs[w], FAIL, needle="the coordinator", rcs=(PEER_EXIT_CODE,))
    return b.run(plan, planted)


def kill(b: Bench, workers: int, seed: int, victim: int, elastic: bool) -> Records:
    """Worker ``victim`` SIGKILLed mid-run: the others name it and stop; with --elastic they go on, worker 0's
    death included (the coordinator holds the store)."""
    name = "SIGKILL mid-run" + (" (--elastic, worker 0)" if elastic and victim == 0 else
                                " (--elastic)" if elastic else "")
    plan = b.plan(name, workers, seed)
    plan.fault = when_victim_dies(victim)
    outs, planted = b.outs(plan)
    extra = ["--elastic"] if elastic else []
    for w in range(workers):
        if w == victim:
            b.add(plan, w, outs[w], VICTIM, extra, env={FAULT_KILL_ENV: f"{victim}:{FAULT_STEP}:0.05"})
        elif elastic:
            b.add(plan, w, outs[w], FINISH, extra)
        else:
            b.add(plan, w, outs[w], FAIL, extra, needle=f"worker {victim}", rcs=(PEER_EXIT_CODE,))
    records = b.run(plan, planted)
    for r in records:
        if elastic and r["expect"] == FINISH and r["rc"] == 0:
            members = (r.get("numbers") or {}).get("members")
            r["survivors_went_on"] = members == [w for w in range(workers) if w != victim]
    return records


def signal_rendezvous(b: Bench, workers: int, seed: int, sig: int) -> Records:
    """``sig`` to a job waiting at the rendezvous (M = 2: worker 0, waiting for worker 1; M >= 3: worker 1,
    waiting for worker 0): it stops at once with one line; the others stop at the timeout."""
    absent, target = (1, 0) if workers == 2 else (0, 1)
    plan = b.plan(f"{signal.Signals(sig).name} at the rendezvous", workers, seed)
    plan.fault = signal_at_rendezvous(target, sig)
    outs, planted = b.outs(plan)
    for w in range(workers):
        if w == target:
            b.add(plan, w, outs[w], STOPPED, needle=signal.Signals(sig).name, rcs=(128 + sig,))
        elif w != absent:
            b.add(plan, w, outs[w], FAIL, needle=f"worker {absent}", rcs=(PEER_EXIT_CODE,))
    return b.run(plan, planted)


def signal_running(b: Bench, workers: int, seed: int, sig: int, target: int) -> Records:
    """``sig`` to one job mid-run: it stops with one line; the others name it and stop."""
    plan = b.plan(f"{signal.Signals(sig).name} mid-run", workers, seed)
    plan.fault = signal_mid_run(target, sig)
    outs, planted = b.outs(plan)
    for w in range(workers):
        if w == target:
            b.add(plan, w, outs[w], STOPPED, needle=signal.Signals(sig).name, rcs=(128 + sig,))
        else:
            b.add(plan, w, outs[w], FAIL, needle=f"worker {target}", rcs=(PEER_EXIT_CODE,))
    return b.run(plan, planted)


def resume(b: Bench, workers: int, seed: int, victim: int, trimmed: int, drop: int) -> Records:
    """Interrupted (worker ``victim`` killed), then the ``drop`` newest checkpoints of a job deleted (job
    ``trimmed``, or, where it is ahead of another, one of those with the oldest newest checkpoint: the jobs
    then have different newest steps, and one in common), then every job resumed: each must resume from the
    newest step they all have and end with the clean run's numbers, bit for bit."""
    name = "resume from different steps"
    first = b.plan(name, workers, seed)
    first.fault = when_victim_dies(victim)
    outs, planted = b.outs(first)
    for w in range(workers):
        if w == victim:
            b.add(first, w, outs[w], VICTIM, env={FAULT_KILL_ENV: f"{victim}:{FAULT_STEP}:0.05"})
        else:
            b.add(first, w, outs[w], FAIL, needle=f"worker {victim}", rcs=(PEER_EXIT_CODE,))
    records = b.run(first, planted)
    have = {w: _steps(outs[w]) for w in range(workers)}
    newest = {w: max(s, default=0) for w, s in have.items()}
    if newest[trimmed] != min(newest.values()):
        trimmed = min(w for w in range(workers) if newest[w] == min(newest.values()))
    for d in range(drop, 0, -1):  # as many as leave a step in common
        gone = have[trimmed][-d:]
        left = {w: [s for s in steps if w != trimmed or s not in gone] for w, steps in have.items()}
        common = set.intersection(*(set(steps) for steps in left.values()))
        if common:
            break
    for step in gone:
        shutil.rmtree(ckpt.checkpoint_dir(ckpt.checkpoint_root(outs[trimmed]), step))
    expected = max(common, default=0)
    for w in range(workers):  # a model of the user's own beside the run's checkpoints, which --resume accepts
        planted[w].update(plant(outs[w], ("checkpoints/mine/best.pth",)))
    second = b.plan(name, workers, seed)
    for w in range(workers):
        b.add(second, w, outs[w], FINISH, resume=True, match=True)
    second.injected = (f"worker {victim} killed after step {FAULT_STEP}; checkpoints {have}; deleted steps {gone} of "
                       f"worker {trimmed}; the newest step all have: {expected}")
    resumed = b.run(second, planted, compare=True)
    for r in resumed:
        found = RESUMED.search(Path(r["log"]).read_text(errors="replace"))
        r["resumed_from"] = int(found.group(1)) if found else None
        if r["rc"] == 0 and r["resumed_from"] != expected and not r["wrong"]:
            r["wrong"] = f"resumed from step {r['resumed_from']}, not {expected}, the newest step every job has"
    records += resumed
    for r in records:
        r["checkpoints_before"], r["checkpoints_resumed_from"], r["newest_in_common"] = have, left, expected
    return records


def _steps(out: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(ckpt.checkpoint_root(out))]


def slow_eval(b: Bench, workers: int, seed: int, slow: int, delay_s: float) -> Records:
    """Job ``slow``'s evaluations each take ``delay_s`` more (more than --dist-timeout): every job waits for
    it and ends with the clean run's numbers."""
    plan = b.plan("evaluation outlasting --dist-timeout", workers, seed)
    plan.injected = f"worker {slow}: +{delay_s:g} s per evaluation"
    outs, planted = b.outs(plan)
    evals = b.steps // b.eval_every if b.eval_every else 1
    for w in range(workers):
        env = {FAULT_EVAL_DELAY_ENV: f"{delay_s:g}"} if w == slow else {}
        b.add(plan, w, outs[w], FINISH, env=env, match=True, extra_s=evals * delay_s)
    return b.run(plan, planted, compare=True)


__all__ = ["Bench", "clean", "kill", "mismatch", "missing", "resume", "signal_rendezvous", "signal_running",
           "silent", "slow_eval"]
