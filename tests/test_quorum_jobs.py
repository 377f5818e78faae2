"""Quorum exchanges across separate `eagerloco train --outer-addr` jobs at a coordinator (docs/algorithms.md,
12.10): a worker stopped by SIGSTOP does not hold the others beyond the grace window, and after SIGCONT it
catches up and its late window is merged once; Q = M is today's run; under --elastic a killed worker leaves
after the timeout (the others going on meanwhile) and rejoins, while a stopped one stays a member (12.6)."""

from __future__ import annotations

import json
import os
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
from test_hooks_jobs import coordinators, job_env, wait_all

from eagerloco.comm.quorum_jobs import QUORUM_PREFIX

pytestmark = pytest.mark.processes
ROOT = Path(__file__).resolve().parents[1]
STEPS, H, GRACE = 64, 4, 0.3
ARGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
        "--log-every", "16", "--inner-steps", str(H), "--steps", str(STEPS),
        "--checkpoint-every", str(STEPS), "--dist-timeout", "60"]


def _job(port: int, w: int, workers: int, out: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    return popen([sys.executable, "-m", "eagerloco", "train", *ARGS, *extra, "--outer-addr", f"127.0.0.1:{port}",
                  "--worker-id", str(w), "--workers", str(workers), "--out", str(out)],
                 env={**job_env(), **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True)


def _client(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def _outer(out: Path, w: int, steps: int = STEPS) -> list[torch.Tensor]:
    state = torch.load(out / "checkpoints" / f"step_{steps:08d}" / f"worker_{w}.pt", weights_only=False)
    return list(state["sync"]["outer"][0])


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _counters(summary: dict[str, Any]) -> tuple[int, int, int]:
    w = summary["per_worker"][0]
    return w["quorum_missed"], w["late_merged"], w["late_dropped"]


@pytest.mark.parametrize(("method", "max_late"), [("diloco", 16), ("eager", 16), ("diloco", 1)])
def test_a_stalled_worker_is_bypassed_after_the_grace_window_then_catches_up_and_its_window_is_merged_once(
        tmp_path: Path, method: str, max_late: int) -> None:
    port = coordinators(1)[0]
    store = _client(port)
    quorum = ["--method", method, "--quorum", "2", "--grace", str(GRACE), "--max-late-rounds", str(max_late)]
    jobs = [_job(port, w, 3, tmp_path / f"w{w}", *quorum) for w in range(3)]
    try:
        deadline = time.monotonic() + 240
        while not store.check([f"{QUORUM_PREFIX}0/{4 * H}/decided"]) and time.monotonic() < deadline:
            if any(j.poll() is not None for j in jobs):  # one ended early: its output says why
                out = wait_all(jobs, 60)
                raise AssertionError("\n".join(o.stdout[-2000:] for o in out))
            time.sleep(0.005)
        # Stopped in its next window's inner steps, past the exchange's all-reduce (a worker stopped inside the
        # collective of an exchange it is a member of holds its members, as any collective's member does).
        time.sleep(0.05)
        os.kill(jobs[2].pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(4.0)
        os.kill(jobs[2].pid, signal.SIGCONT)
        resumed = time.time()
        done = wait_all(jobs, 300)
    finally:
        for j in jobs:
            if j.poll() is None:
                os.kill(j.pid, signal.SIGCONT)
                j.kill()
    for w, d in enumerate(done):
        assert d.returncode == 0, f"worker {w}:\n{d.stdout[-3000:]}"
    decisions = {s: json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided")) for s in range(H, STEPS + 1, H)}
    bypassed = [s for s, d in decisions.items() if 2 not in d["members"]]
    # Worker 2 was stopped for 4 s: the others closed exchanges without it, each within the grace window of its
    # quorum's last arrival (plus the coordinator's round trips), and none waited for its SIGCONT.
    assert bypassed, [(s, d["members"], round(d["decided_at"] - stopped, 2)) for s, d in decisions.items()]
    for s in bypassed:
        d = decisions[s]
        quorum_at = sorted(d["arrivals_at"][str(m)] for m in d["members"])[1]
        assert d["decided_at"] - quorum_at < GRACE + 1.0, (s, d)
    # Every window of worker 2's is in exactly one mean: the ones that missed are merged late, once each.
    merged = [tuple(c) for d in decisions.values() for c in d["merged"]]
    assert len(merged) == len(set(merged)), merged
    missed, late, dropped = _counters(_summary(tmp_path / "w2"))
    assert all(_counters(_summary(tmp_path / f"w{w}")) == (0, 0, 0) for w in range(2))
    landed = sorted(s for s in decisions if any(c[0] == 2 and c[1] == s for c in merged))
    if max_late == 16:  # held while it caught up, every one merged
        assert missed >= 1 and late == missed and dropped == 0, (missed, late, dropped)
        assert landed == list(decisions)
    else:  # more than one exchange late: dropped, each with its line, and in no mean
        assert dropped >= 1 and late + dropped == missed, (missed, late, dropped)
        assert len(decisions) - len(landed) == dropped
        lines = [line for line in done[2].stdout.splitlines() if "quorum: dropped worker 2's window" in line]
        assert len(lines) == dropped, done[2].stdout[-3000:]
    # DiLoCo: every worker applies every mean, the late one too: the outer parameters stay identical (under eager
    # each worker's own share in flight is in its own only).
    outers = [_outer(tmp_path / f"w{w}", w) for w in range(3)]
    assert method == "eager" or all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0], o, strict=True))
    waits = [decisions[s]["decided_at"] - min(decisions[s]["arrivals_at"].values()) for s in bypassed]
    print(f"bypassed {len(bypassed)} of {len(decisions)} exchanges; the others waited at most {max(waits):.2f} s "
          f"per bypassed exchange (grace {GRACE} s) while worker 2 was stopped {resumed - stopped:.1f} s; worker 2 "
          f"missed {missed}, merged late {late}, dropped {dropped}")


@pytest.mark.parametrize("method", ["diloco", "eager"])
def test_q_equal_m_across_jobs_is_today_s_run(tmp_path: Path, method: str) -> None:
    ports = coordinators(2)
    runs = {}
    for name, port, extra in [("plain", ports[0], ["--method", method]),
                              ("quorum", ports[1], ["--method", method, "--quorum", "2", "--grace", "0.5"])]:
        for w, d in enumerate(wait_all([_job(port, w, 2, tmp_path / name / f"w{w}", *extra) for w in range(2)], 300)):
            assert d.returncode == 0, f"{name} worker {w}:\n{d.stdout[-3000:]}"
        runs[name] = [(_outer(tmp_path / name / f"w{w}", w), _summary(tmp_path / name / f"w{w}")) for w in range(2)]
    store = dist.TCPStore("127.0.0.1", ports[1], is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    assert not store.check([f"{QUORUM_PREFIX}0/{H}/arrived/0"])  # no exchange went through the coordinator
    for (a, sa), (b, sb) in zip(runs["plain"], runs["quorum"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert sa["final_eval_loss"] == sb["final_eval_loss"]


def _wait_for(store: dist.Store, key: str, value: bytes, jobs: list[Any], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (store.check([key]) and store.get(key) == value):
        assert time.monotonic() < deadline and all(j.poll() is None for j in jobs), f"no {key} = {value!r}"
        time.sleep(0.02)


@pytest.mark.slow
def test_under_elastic_a_killed_worker_leaves_after_the_timeout_and_rejoins_a_stopped_one_stays_a_member(
        tmp_path: Path) -> None:
    port, steps = coordinators(1)[0], 144
    store = _client(port)
    # Rounds of at least 0.1 s (the emulated link's latency), so that the run outlasts the timeout and the restart.
    args = ["--method", "diloco", "--quorum", "2", "--grace", str(GRACE), "--max-late-rounds", "16", "--steps",
            str(steps), "--checkpoint-every", str(steps), "--elastic", "--dist-timeout", "5", "--latency-ms", "100"]
    jobs = [_job(port, w, 3, tmp_path / f"w{w}", *args, env={"EAGERLOCO_FAULT_KILL": "1:12"} if w == 1 else None)
            for w in range(3)]
    members = "eagerloco/elastic/members"
    try:
        killed = wait_all([jobs[1]], 240)[0]
        assert killed.returncode == -9, killed.stdout[-3000:]
        _wait_for(store, members, b"0,2", [jobs[0], jobs[2]])
        left_at = time.time()
        jobs[1] = _job(port, 1, 3, tmp_path / "w1", *args)  # the same command again
        _wait_for(store, members, b"0,1,2", jobs)
        # Worker 2 stopped past the grace window, for less than the timeout, once worker 1 is back in the exchanges:
        # in its next window's inner steps, past the all-reduce of an exchange it is a member of.
        s = next(s for s in range(steps, 0, -H) if store.check([f"{QUORUM_PREFIX}0/{s}/decided"]))
        while json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided"))["members"] != [0, 1, 2]:  # 1 is back
            s += H
            while not store.check([f"{QUORUM_PREFIX}0/{s}/decided"]):
                time.sleep(0.005)
        time.sleep(0.05)
        os.kill(jobs[2].pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(2.5)
        os.kill(jobs[2].pid, signal.SIGCONT)
        done = wait_all(jobs, 300)
    finally:
        for j in jobs:
            if j.poll() is None:
                os.kill(j.pid, signal.SIGCONT)
                j.kill()
    for w, d in enumerate(done):
        assert d.returncode == 0, f"worker {w}:\n{d.stdout[-3000:]}"
    decisions = {s: json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided")) for s in range(H, steps + 1, H)}

    def bypassed(w: int, since: float, until: float) -> list[int]:
        return [s for s, d in decisions.items() if since < d["decided_at"] < until and w not in d["members"]]

    # While worker 1 was dead and still a member, and while worker 2 was stopped, the others closed their exchanges
    # without it after the grace window.
    dead, stalled = bypassed(1, 0, left_at), bypassed(2, stopped, stopped + 2.5)
    assert dead and stalled, [(s, d["members"], d["left"], round(d["decided_at"] - stopped, 2))
                              for s, d in decisions.items()]
    for s in dead + stalled:
        d = decisions[s]
        quorum_at = sorted(d["arrivals_at"].values())[1]
        assert d["decided_at"] - quorum_at < GRACE + 1.0, (s, d)
    # Worker 1 left the membership at one exchange, after the timeout, and rejoined at a round boundary; worker 2,
    # bypassed, stayed a member: each of its late windows merged once, and it caught up.
    assert [d["left"] for d in decisions.values() if d["left"]] == [[1]]
    for w in (0, 2):
        assert f"worker {w}: lost 1; continuing with workers [0, 2]" in done[w].stdout, done[w].stdout[-3000:]
        assert f"worker {w}: workers [1] joined at step" in done[w].stdout, done[w].stdout[-3000:]
    assert "worker 1: joined at step" in done[1].stdout and "checked); members [0, 1, 2]" in done[1].stdout, \
        done[1].stdout[-3000:]
    assert all("lost 2" not in d.stdout for d in done)
    merged = [tuple(c) for d in decisions.values() for c in d["merged"]]
    assert len(merged) == len(set(merged)), merged
    missed, late, dropped = _counters(_summary(tmp_path / "w2"))
    assert missed >= len(stalled) and late == missed and dropped == 0, (missed, late, dropped)
    assert decisions[steps]["members"] == [0, 1, 2]
    outers = [_outer(tmp_path / f"w{w}", w, steps) for w in range(3)]
    assert all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0], o, strict=True))
