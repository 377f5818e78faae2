"""Quorum exchanges across separate `eagerloco train --outer-addr` jobs at a coordinator (docs/algorithms.md,
12.10): a worker stopped by SIGSTOP does not hold the others beyond the grace window, and after SIGCONT it
catches up and its late window is merged once (or dropped past --max-late-rounds); a resume mid-schedule
ends as the run that never stopped. Who is a member of each exchange: tests/test_quorum_jobs_members.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from jobs import popen
from test_hooks_jobs import assert_exited_0, coordinators, job_env, wait_all

from eagerloco.comm.quorum_jobs import QUORUM_PREFIX
from testing.faults import FAULT_SLOW_ENV

pytestmark = pytest.mark.processes
ROOT = Path(__file__).resolve().parents[1]
STEPS, H, GRACE = 64, 4, 0.3
ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "16", "--inner-steps", str(H), "--steps", str(STEPS),
        "--checkpoint-every", str(STEPS), "--dist-timeout", "60"]


def job(port: int, w: int, workers: int, out: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    return popen([sys.executable, "-m", "eagerloco", "train", *ARGS, *extra, "--outer-addr", f"127.0.0.1:{port}",
                  "--worker-id", str(w), "--workers", str(workers), "--out", str(out)],
                 env={**job_env(), **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True)


def client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def outer(out: Path, w: int, steps: int = STEPS) -> list[torch.Tensor]:
    state = torch.load(out / "checkpoints" / f"step_{steps:08d}" / f"worker_{w}.pt", weights_only=False)
    return list(state["sync"]["outer"][0])


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def counters(summary: dict[str, Any]) -> tuple[int, int, int]:
    w = summary["per_worker"][0]
    return w["quorum_missed"], w["late_merged"], w["late_dropped"]


def wait_for(store: dist.Store, key: str, value: bytes | None, jobs: list[Any], timeout: float = 120) -> None:
    """Until ``key`` holds ``value`` (None: any) while every job in ``jobs`` runs."""
    deadline = time.monotonic() + timeout
    while not (store.check([key]) and value in (None, store.get(key))):
        ended = [j for j in jobs if j.poll() is not None]
        assert not ended, (f"no {key} = {value!r}: a job exited {ended[0].returncode}:\n"
                           f"{ended[0].communicate(timeout=10)[0][-4000:]}")
        assert time.monotonic() < deadline, f"no {key} = {value!r} after {timeout} s"
        time.sleep(0.02)


def stopped_before(store: dist.Store, jobs: list[Any], s: int) -> bool:
    """Once workers 0 and 1 arrived at exchange s, stop worker 2; whether it had not arrived (else it goes on)."""
    for w in (0, 1):
        wait_for(store, f"{QUORUM_PREFIX}0/{s}/arrived/{w}", None, jobs)
    os.kill(jobs[2].pid, signal.SIGSTOP)
    time.sleep(0.1)  # an arrival it wrote just before the stop reaches the store
    if not store.check([f"{QUORUM_PREFIX}0/{s}/arrived/2"]):
        return True
    os.kill(jobs[2].pid, signal.SIGCONT)
    return False


def end_all(jobs: list[Any]) -> None:
    """Kill the jobs a failed test left running, a stopped one woken first."""
    for j in jobs:
        if j.poll() is None:
            os.kill(j.pid, signal.SIGCONT)
            j.kill()


@pytest.mark.parametrize(("method", "max_late"), [("diloco", 16), ("eager", 16), ("delayed", 16), ("diloco", 1),
                                                  ("diloco", 0), pytest.param("streaming", 16, marks=pytest.mark.slow)])
def test_a_stalled_worker_is_bypassed_after_the_grace_window_then_catches_up_and_its_window_is_merged_once(
        tmp_path: Path, method: str, max_late: int) -> None:
    port = coordinators(1)[0]
    store = client(port)
    # Rounds of at least 0.2 s (the emulated link's latency): the stop ends before the others' run does.
    # Evaluation points inside the stop (every 2H + 1 steps): under a quorum nobody waits there for worker 2 (12.10).
    quorum = ["--method", method, "--quorum", "2", "--grace", str(GRACE), "--max-late-rounds", str(max_late),
              "--latency-ms", "200", "--eval-every", str(2 * H + 1),
              *(["--fragments", "2", "--overlap-steps", "1"] if method == "streaming" else [])]
    resume_too = method == "diloco" and max_late == 16  # then resumed mid-schedule too: a checkpoint every exchange
    if resume_too:
        quorum += ["--checkpoint-every", str(H), "--keep-checkpoints", str(STEPS // H)]
    # Worker 2 a little slower (0.05 s more a step, a round's within the grace window): the last to send, by a margin.
    (tmp_path / "slow").write_text("0.05")
    jobs = [job(port, w, 3, tmp_path / f"w{w}", *quorum,
                env={FAULT_SLOW_ENV: str(tmp_path / "slow")} if w == 2 else None) for w in range(3)]
    try:
        # Stopped in the inner steps of a window the others have sent and it has not, so past every all-reduce it
        # is a member of (one stopped inside such a collective holds its members, as any collective's member does).
        stop_at = 3 * H
        while not stopped_before(store, jobs, stop_at):
            stop_at += H
            assert stop_at < STEPS - H, "worker 2 sent its window first at every exchange"
        stopped = time.time()
        time.sleep(2.0)
        os.kill(jobs[2].pid, signal.SIGCONT)
        resumed = time.time()
        done = wait_all(jobs, 300)
    finally:
        end_all(jobs)
    assert_exited_0(done)
    decisions = {s: json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided")) for s in range(H, STEPS + 1, H)}
    bypassed = [s for s, d in decisions.items() if 2 not in d["members"]]
    # Worker 2 was stopped for 2 s: the others passed the evaluation points without it (had they waited there, as
    # all-or-nothing rounds do, it would have caught them up and nothing would be bypassed) and closed exchanges
    # without it, exchange stop_at first, each within the grace window of its quorum's last arrival (plus the
    # coordinator's round trips).
    assert stop_at in bypassed, [(e, d["members"], round(d["decided_at"] - stopped, 2)) for e, d in decisions.items()]
    assert decisions[STEPS]["members"] == [0, 1, 2], decisions[STEPS]  # the run's last exchange waits for all (12.4)
    for s in bypassed:
        d = decisions[s]
        quorum_at = sorted(d["arrivals_at"][str(m)] for m in d["members"])[1]
        assert d["decided_at"] - quorum_at < GRACE + 1.0, (s, d)
    # Every window of worker 2's is in exactly one mean: the ones that missed are merged late, once each.
    merged = [tuple(c) for d in decisions.values() for c in d["merged"]]
    assert len(merged) == len(set(merged)), merged
    missed, late, dropped = counters(summary(tmp_path / "w2"))
    assert all(counters(summary(tmp_path / f"w{w}")) == (0, 0, 0) for w in range(2))
    landed = sorted(s for s in decisions if any(c[0] == 2 and c[1] == s for c in merged))
    if max_late == 16:  # held while it caught up, every one merged
        assert missed >= 1 and late == missed and dropped == 0, (missed, late, dropped)
        assert landed == list(decisions)
    else:  # more than one exchange late: dropped, each with its line, and in no mean
        assert dropped >= 1 and late + dropped == missed, (missed, late, dropped)
        assert len(decisions) - len(landed) == dropped
        lines = [line for line in done[2].stdout.splitlines() if "quorum: dropped worker 2's window" in line]
        assert len(lines) == dropped, done[2].stdout[-3000:]
    # DiLoCo, Streaming (fragment 0's exchanges above; fragment 1's alike, its own windows held for its own) and
    # delayed (each mean one round after its launch): every worker applies every mean, the late one too, so the
    # outer parameters stay identical (under eager each worker's own share in flight is in its own only).
    outers = [outer(tmp_path / f"w{w}", w) for w in range(3)]
    assert method == "eager" or all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0], o, strict=True))
    if resume_too:
        _resumed_mid_schedule_ends_as_the_uninterrupted_run(tmp_path, decisions, quorum)
    waits = [decisions[s]["decided_at"] - min(decisions[s]["arrivals_at"].values()) for s in bypassed]
    print(f"bypassed {len(bypassed)} of {len(decisions)} exchanges; the others waited at most {max(waits):.2f} s "
          f"per bypassed exchange (grace {GRACE} s) while worker 2 was stopped {resumed - stopped:.1f} s; worker 2 "
          f"missed {missed}, merged late {late}, dropped {dropped}")


def _resumed_mid_schedule_ends_as_the_uninterrupted_run(tmp_path: Path, decisions: dict[int, Any],
                                                        args: list[str]) -> None:
    """Every job resumed from its checkpoint of the last exchange that left a worker out (which holds its window
    there, to merge it at the next one), at a fresh coordinator that replays the run's decisions from there on:
    the outer parameters of the run that never stopped, bit for bit."""
    c = max(s for s, d in decisions.items() if len(d["members"]) < 3)
    assert c < STEPS, "no exchange left after the last one that left a worker out"
    out = [w for w in range(3) if w not in decisions[c]["members"]]
    ckpt = f"checkpoints/step_{c:08d}"
    for w in out:  # its checkpoint holds the window it holds
        state = torch.load(tmp_path / f"w{w}" / ckpt / f"worker_{w}.pt", weights_only=False)
        assert [h[:2] for h in state["sync"]["quorum_held"]["held"]["0"]][-1] == [w, c], state["sync"]
    port = coordinators(1)[0]
    store = client(port)
    for s, d in decisions.items():
        if s > c:
            store.set(f"{QUORUM_PREFIX}0/{s}/decided", json.dumps(d))
    for w in range(3):
        shutil.copytree(tmp_path / f"w{w}", tmp_path / "resumed" / f"w{w}")
        for later in (tmp_path / "resumed" / f"w{w}" / "checkpoints").glob("step_*"):
            if int(later.name.removeprefix("step_")) > c:
                shutil.rmtree(later)
    jobs = [job(port, w, 3, tmp_path / "resumed" / f"w{w}", *args, "--resume") for w in range(3)]
    for w, d in enumerate(wait_all(jobs, 300)):
        assert d.returncode == 0, f"resumed worker {w}:\n{d.stdout[-3000:]}"
        again, first = outer(tmp_path / "resumed" / f"w{w}", w), outer(tmp_path / f"w{w}", w)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True)), w


def test_eager_hides_a_quorum_exchange_behind_the_next_round(tmp_path: Path) -> None:
    """Across jobs a quorum exchange runs on the communication thread, as every exchange does: DiLoCo waits out
    each round's (the emulated link's 100 ms and the decision), eager launches it a round (4 inner steps paced to
    0.1 s) before it must land. Both runs at once, each at its own coordinator."""
    ports = coordinators(2)
    args = ["--quorum", "2", "--grace", str(GRACE), "--latency-ms", "100", "--sim-step-time", "0.1"]
    jobs = {m: [job(p, w, 3, tmp_path / m / f"w{w}", "--method", m, *args) for w in range(3)]
            for m, p in zip(("diloco", "eager"), ports, strict=True)}
    try:
        done = [d for m in jobs for d in wait_all(jobs[m], 300)]
    finally:
        end_all([j for js in jobs.values() for j in js])
    assert_exited_0(done)
    blocked = {m: [summary(tmp_path / m / f"w{w}")["per_worker"][0]["blocked_s"] for w in range(3)] for m in jobs}
    rounds = STEPS // H
    assert min(blocked["diloco"]) >= 0.9 * rounds * 0.1, blocked
    # Summed over the workers: on loaded cores a worker's thread may come late to a decision now and then.
    assert sum(blocked["eager"]) < sum(blocked["diloco"]) / 3, blocked
