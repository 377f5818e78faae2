"""Goodput under failures and stalls (``eagerloco simulate --goodput``): the rounds' arithmetic against closed
forms on small scripted cases, and the command's report."""

from __future__ import annotations

import json
import math
from collections import deque

import pytest

from eagerloco import cli
from eagerloco.config.outer import GRACE_WINDOW, auto_grace
from eagerloco.sim.goodput import (
    Faults,
    Timing,
    draw_events,
    method_timing,
    play_rounds,
)

P, M = 10.0, 8  # a round's wall time, workers


def test_no_faults_goodput_is_compute_utilization() -> None:
    t = Timing(period=P, compute=0.8 * P)
    for quorum in (M, M - 2):
        assert play_rounds({}, M, 50, t, 0.0, quorum, 1.0, 1).goodput == pytest.approx(0.8, rel=1e-12)


@pytest.mark.parametrize(("stall", "slack"), [(3.0, 0.0), (3.0, 1.0), (3.0, 5.0)])
def test_all_or_nothing_one_stall_per_round(stall: float, slack: float) -> None:
    """Each round one worker stalls s: every round ends s - slack late (never early), all of it merged."""
    t = Timing(period=P, compute=0.9 * P, slack=slack)
    events = {r: {r % M: (stall, None)} for r in range(40)}
    out = play_rounds(events, M, 40, t, 0.0, M, None, 1)
    assert out.goodput == pytest.approx(0.9 * P / (P + max(0.0, stall - slack)), rel=1e-12)
    assert out.late_merged == out.dropped == 0


def test_all_or_nothing_failure_redoes_the_round() -> None:
    """A worker failing halfway through every round: everyone waits for the restart and the redone half."""
    restart = 4.0
    events = {r: {0: (0.0, 0.5 * P)} for r in range(20)}
    out = play_rounds(events, M, 20, Timing(P, P), restart, M, None, 1)
    assert out.goodput == pytest.approx(P / (P + 0.5 * P + restart), rel=1e-12)


def test_quorum_bypasses_a_stall_and_merges_it_one_round_late() -> None:
    """Q = M - 1, grace g < s: the round closes g after the others; the straggler's round joins the next
    exchange, and it catches up with a round s - g shorter. Per pair of rounds: wall 2P + g, merged 2MP - (s - g)."""
    stall, grace, pairs = 3.0, 1.0, 10
    events = {2 * i: {0: (stall, None)} for i in range(pairs)}
    out = play_rounds(events, M, 2 * pairs, Timing(P, P), 0.0, M - 1, grace, 1)
    assert out.goodput == pytest.approx((2 * M * P - (stall - grace)) / (M * (2 * P + grace)), rel=1e-12)
    assert (out.late_merged, out.dropped) == (pairs, 0)
    assert out.wall == pytest.approx(pairs * (2 * P + grace), rel=1e-12)


@pytest.mark.parametrize(("max_late", "good", "merged", "dropped"), [(1, 37.5, 0, 1), (2, 38.5, 1, 0)])
def test_staleness_bound_drops_a_contribution_two_rounds_late(max_late: int, good: float, merged: int,
                                                              dropped: int) -> None:
    """A stall of 1.5 rounds on one of 4 workers (Q = 3, no grace): its round ends 2.5 rounds in, missing two
    exchanges: dropped with S = 1, merged with S = 2; it then runs half a round and rejoins. Ten rounds of 3
    other workers."""
    out = play_rounds({0: {0: (1.5 * P, None)}}, 4, 10, Timing(P, P), 0.0, 3, 0.0, max_late)
    assert out.good == pytest.approx(good * P, rel=1e-12)
    assert out.goodput == pytest.approx(good / 40, rel=1e-12)
    assert (out.late_merged, out.dropped) == (merged, dropped)


def test_streaming_counts_staleness_in_outer_rounds() -> None:
    """The same stall against Streaming's barriers (P = 4 per outer round): within one outer round, merged."""
    out = play_rounds({0: {0: (1.5 * P, None)}}, 4, 10, Timing(P, P, span=4), 0.0, 3, 0.0, 1)
    assert (out.late_merged, out.dropped) == (1, 0)


def test_method_timing() -> None:
    assert method_timing("dp", 0.5, 0.5, 100, 4, 1, 2) == Timing(1.0, 0.5)
    assert method_timing("diloco", 0.5, 1.0, 100, 4, 1, 2) == Timing(50.0, 50.0)
    assert method_timing("streaming", 0.5, 1.0, 100, 4, 1, 2) == Timing(12.5, 12.5, 0.5, 4)
    assert method_timing("eager", 0.5, 1.0, 100, 4, 1, 2) == Timing(50.0, 50.0, 100.0)


def test_auto_grace_bounds() -> None:
    assert auto_grace(deque([0.0] * GRACE_WINDOW), 100.0) == pytest.approx(1.0)
    assert auto_grace(deque([4.0] * GRACE_WINDOW), 100.0) == pytest.approx(8.0)
    assert auto_grace(deque([0.0] * 3 + [90.0] * 5), 100.0) == pytest.approx(25.0)


def test_draws_are_seeded_and_poisson() -> None:
    faults = Faults(mtbf_s=1e4, restart_s=5.0, stall_rate=1e-3, stall_s=2.0)
    a, b = (draw_events(faults, 100, 1000, 10.0, seed=3) for _ in range(2))
    assert a == b
    stalls = sum(round(d / 2.0) for ev in a.values() for d, _ in ev.values())
    assert abs(stalls - 1000) < 5 * math.sqrt(1000)  # mean 100 workers * 1e4 s * 1e-3


def test_command_without_faults_reports_the_utilization(tmp_path) -> None:
    path = tmp_path / "g.json"
    rc = cli.main(["simulate", "--goodput", "--model", "1b", "--goodput-workers", "8,64", "--mtbf-hours", "inf",
                   "--stalls-per-hour", "0", "--bandwidth-gbps", "1", "--run-hours", "1", "--json", str(path)])
    assert rc == 0
    rows = json.loads(path.read_text())["goodput"][0]["rows"]
    assert {r["method"] for r in rows} == {"dp", "diloco", "streaming", "delayed", "eager"}
    for r in rows:
        assert r["all_or_nothing"]["goodput"] == pytest.approx(r["cu"], rel=1e-9)
        assert r["quorum_exchange"]["goodput"] == pytest.approx(r["cu"], rel=1e-9)
    assert min(r["cu"] for r in rows) < 0.9  # 1 Gbit/s costs data-parallel something


@pytest.mark.parametrize(("flags", "message"), [
    (["--grace", "soon"], "--grace takes seconds from 0 to 3600 or auto"),
    (["--quorum-share", "0"], "--quorum-share must be in (0, 1]"),
    (["--goodput-workers", "8,0"], "--goodput-workers values must be integers >= 1"),
    (["--plan", "--bandwidth-gbps", "1", "--target-cu", "0.9"], "--goodput is a report of its own"),
])
def test_command_rejects_bad_flags(capsys, flags: list[str], message: str) -> None:
    assert cli.main(["simulate", "--goodput", "--model", "1b", *flags]) == 2
    assert message in capsys.readouterr().err


def test_auto_grace_waits_for_everyone_until_it_has_measured() -> None:
    """With --grace auto the first exchanges are all-or-nothing; a later one closes at the floor, 1% of a round."""
    stall = 3.0
    early = play_rounds({0: {0: (stall, None)}}, M, 20, Timing(P, P), 0.0, M - 1, None, 1)
    assert early.wall == pytest.approx(20 * P + stall, rel=1e-12)
    late = play_rounds({GRACE_WINDOW: {0: (stall, None)}}, M, 20, Timing(P, P), 0.0, M - 1, None, 1)
    assert late.wall == pytest.approx(20 * P + 0.01 * P, rel=1e-12)
    assert late.late_merged == 1
    assert late.graces and all(g == pytest.approx(0.01 * P) for g in late.graces)
