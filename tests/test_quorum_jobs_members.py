"""Who is a member of each quorum exchange across separate jobs at a coordinator (docs/algorithms.md, 12.10):
Q = M is today's run; under --elastic a killed worker leaves after the timeout (the others going on meanwhile)
and rejoins, while a stopped one stays a member (12.6); an auto grace window follows the spreads. A file of
its own, so that pytest-xdist's two workers run it beside tests/test_quorum_jobs.py."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_hooks_jobs import assert_exited_0, coordinators, wait_all
from test_quorum_jobs import GRACE, H, client, counters, end_all, job, outer, stopped_before, summary, wait_for

from eagerloco.comm.quorum_jobs import QUORUM_PREFIX
from eagerloco.config.outer import GRACE_MAX, GRACE_MIN, GRACE_WINDOW

pytestmark = pytest.mark.processes


@pytest.mark.parametrize("method", ["diloco", "eager"])
def test_q_equal_m_across_jobs_is_today_s_run(tmp_path: Path, method: str) -> None:
    ports, steps = coordinators(2), 4 * H  # a few exchanges tell today's run apart; both runs at once
    short = ["--steps", str(steps), "--checkpoint-every", str(steps)]
    setups = {"plain": (ports[0], ["--method", method]),
              "quorum": (ports[1], ["--method", method, "--quorum", "2", "--grace", "0.5"])}
    jobs = {(name, w): job(port, w, 2, tmp_path / name / f"w{w}", *extra, *short)
            for name, (port, extra) in setups.items() for w in range(2)}
    for (name, w), d in zip(jobs, wait_all(list(jobs.values()), 300), strict=True):
        assert d.returncode == 0, f"{name} worker {w}:\n{d.stdout[-3000:]}"
    runs = {name: [(outer(tmp_path / name / f"w{w}", w, steps), summary(tmp_path / name / f"w{w}"))
                   for w in range(2)] for name in setups}
    store = dist.TCPStore("127.0.0.1", ports[1], is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    assert not store.check([f"{QUORUM_PREFIX}0/{H}/arrived/0"])  # no exchange went through the coordinator
    for (a, sa), (b, sb) in zip(runs["plain"], runs["quorum"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert sa["final_eval_loss"] == sb["final_eval_loss"]


@pytest.mark.slow
def test_under_elastic_a_killed_worker_leaves_after_the_timeout_and_rejoins_a_stopped_one_stays_a_member(
        tmp_path: Path) -> None:
    port, steps = coordinators(1)[0], 192
    store = client(port)
    # 48 rounds of at least 0.1 s (the emulated link's latency): the run outlasts the timeout and a slow restart.
    args = ["--method", "diloco", "--quorum", "2", "--grace", str(GRACE), "--max-late-rounds", "16", "--steps",
            str(steps), "--checkpoint-every", str(steps), "--elastic", "--dist-timeout", "5", "--latency-ms", "100"]
    jobs = [job(port, w, 3, tmp_path / f"w{w}", *args) for w in range(3)]
    members = "eagerloco/elastic/members"
    try:
        # Worker 1 killed inside an exchange: arrived, so a member of its all-reduce, which fails; its members decide
        # again without it, and the exchanges after it bypass it until the timeout removes it.
        # Past its first metrics line (step 16), before its first checkpoint: what --resume must come back from.
        killed_at = 5 * H
        while True:  # stopped once arrived, before the decision (which then holds it), then killed
            wait_for(store, f"{QUORUM_PREFIX}0/{killed_at}/arrived/1", None, jobs)
            os.kill(jobs[1].pid, signal.SIGSTOP)
            if not store.check([f"{QUORUM_PREFIX}0/{killed_at}/decided"]):
                break
            os.kill(jobs[1].pid, signal.SIGCONT)
            killed_at += H
        jobs[1].kill()
        assert wait_all([jobs[1]], 60)[0].returncode == -9 and (tmp_path / "w1" / "metrics.jsonl").exists()
        wait_for(store, members, b"0,2", [jobs[0], jobs[2]])
        left_at = time.time()
        jobs[1] = job(port, 1, 3, tmp_path / "w1", *args, "--resume")  # the same command, to continue its --out
        wait_for(store, members, b"0,1,2", jobs)
        # Worker 2 stopped past the grace window, for less than the timeout, once worker 1 is back in the exchanges:
        # between two exchanges (the others arrived at the next one, it not yet), not inside one's all-reduce.
        s = next(s for s in range(steps, 0, -H) if store.check([f"{QUORUM_PREFIX}0/{s}/decided"]))
        while True:
            wait_for(store, f"{QUORUM_PREFIX}0/{s}/decided", None, jobs)
            back = json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided"))["members"] == [0, 1, 2]
            s += H
            if back and stopped_before(store, jobs, s):
                break
        stopped = time.time()
        time.sleep(2.5)
        os.kill(jobs[2].pid, signal.SIGCONT)
        done = wait_all(jobs, 300)
    finally:
        end_all(jobs)
    assert_exited_0(done)
    decisions = {s: json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided")) for s in range(H, steps + 1, H)}
    assert 1 in decisions[killed_at]["members"]  # it had arrived: its all-reduce failed and was decided again
    decisions[killed_at] = json.loads(store.get(f"{QUORUM_PREFIX}0/{killed_at}/1/decided"))
    assert decisions[killed_at]["members"] == [0, 2] and not decisions[killed_at]["left"]

    def bypassed(w: int, since: float, until: float) -> list[int]:
        return [s for s, d in decisions.items() if since < d["decided_at"] < until and w not in d["members"]]

    # While worker 1 was dead and still a member, and while worker 2 was stopped, the others closed their exchanges
    # without it after the grace window.
    dead, stalled = bypassed(1, 0, left_at), bypassed(2, stopped, stopped + 2.5)
    assert killed_at in dead
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
    assert "--resume: no checkpoint under" in done[1].stdout and "worker 1 starts afresh" in done[1].stdout
    assert all("lost 2" not in d.stdout for d in done)
    merged = [tuple(c) for d in decisions.values() for c in d["merged"]]
    assert len(merged) == len(set(merged)), merged
    missed, late, dropped = counters(summary(tmp_path / "w2"))
    assert missed >= len(stalled) and late == missed and dropped == 0, (missed, late, dropped)
    assert decisions[steps]["members"] == [0, 1, 2]
    outers = [outer(tmp_path / f"w{w}", w, steps) for w in range(3)]
    assert all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0], o, strict=True))



@pytest.mark.slow
def test_an_auto_grace_window_across_jobs_follows_the_spreads_its_decisions_carry(tmp_path: Path) -> None:
    port, steps = coordinators(1)[0], 96
    store = client(port)
    args = ["--method", "diloco", "--quorum", "2", "--grace", "auto", "--max-late-rounds", "16", "--steps", str(steps),
            "--checkpoint-every", str(steps)]
    jobs = [job(port, w, 3, tmp_path / f"w{w}", *args) for w in range(3)]
    measured = (GRACE_WINDOW + 1) * H  # the first exchange with a grace window: 8 measured before it
    try:
        # Worker 2 stopped in its inner steps once the others arrived at the next exchange (not inside an all-reduce,
        # which would hold them): that exchange closes without it after the grace window.
        s = measured + H
        while not stopped_before(store, jobs, s):
            s += H
        time.sleep(2.0)
        os.kill(jobs[2].pid, signal.SIGCONT)
        done = wait_all(jobs, 300)
    finally:
        end_all(jobs)
    assert_exited_0(done)
    decisions = [json.loads(store.get(f"{QUORUM_PREFIX}0/{s}/decided")) for s in range(H, steps + 1, H)]
    # The first 8 exchanges measure and wait for every worker (12.2); each later one closes g after its Q-th arrival,
    # g = clamp(2 median(the last 8 spreads, its own among them), T / 100, T / 4), the spreads carried from decision to
    # decision whichever worker took it.
    assert all(d["grace"] is None and d["members"] == [0, 1, 2] for d in decisions[:GRACE_WINDOW])
    # The run's last exchange closes on every worker (12.4), its spread measured over all three: left out here.
    assert decisions[-1]["members"] == [0, 1, 2]
    for before, d in zip(decisions[GRACE_WINDOW - 1:-1], decisions[GRACE_WINDOW:-1], strict=False):
        assert d["spreads"][:-1] == before["spreads"][-GRACE_WINDOW + 1:] and len(d["spreads"]) == GRACE_WINDOW
        order = sorted(d["arrivals_at"].values())
        assert d["spreads"][-1] == order[1] - order[0]
        t = d["round_compute"]
        assert t > 0 and d["grace"] == min(max(2 * statistics.median(d["spreads"]), GRACE_MIN * t), GRACE_MAX * t)
    bypassed = [d for d in decisions if 2 not in d["members"]]
    assert decisions[s // H - 1]["members"] == [0, 1], [(d["members"], d["grace"]) for d in decisions[s // H - 3:]]
    for d in bypassed:  # the others waited g past the quorum's last arrival (plus the coordinator's round trips)
        assert d["decided_at"] - sorted(d["arrivals_at"].values())[1] < d["grace"] + 1.0, d
    merged = [tuple(c) for d in decisions for c in d["merged"]]
    assert len(merged) == len(set(merged)), merged
    outers = [outer(tmp_path / f"w{w}", w, steps) for w in range(3)]
    assert all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0], o, strict=True))
