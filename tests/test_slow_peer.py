"""A peer that is alive and stepping is slow, not dead: before a collective a worker waits for it as long as
its inner steps advance (each within --dist-timeout), names a peer alive but without progress as slow with
the fix, and leaves a silent one (no heartbeat) to the collective's failure and its diagnosis."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from runs import launch_here

from eagerloco import events
from eagerloco.comm.errors import PeerError
from eagerloco.comm.heartbeat import Heartbeat

NAMES = {0: "worker 0", 1: "worker 1"}


def _pair(entered: list[int]) -> tuple[Heartbeat, Heartbeat]:
    """Worker 0's heartbeat and worker 1's, on one store, worker 1's last exchange entered read from entered[0]."""
    store = dist.HashStore()
    me = Heartbeat(store, 0, interval_s=0.05)
    peer = Heartbeat(store, 1, interval_s=0.05, progress=lambda: (entered[0], 0))
    return me, peer


def test_a_slow_peer_that_keeps_stepping_is_waited_for_past_the_timeout() -> None:
    entered = [1]
    me, peer = _pair(entered)
    events.inner_step_done(0, 10)  # this worker is at its 10th inner step, worker 1 at its first

    def slow_worker() -> None:  # an inner step every 0.2 s, exchange #2 after 1.2 s: six times the patience
        for step in range(1, 7):
            time.sleep(0.2)
            events.inner_step_done(1, step)
        entered[0] = 2
        peer.announce()

    t = threading.Thread(target=slow_worker)
    t0 = time.monotonic()
    t.start()
    try:
        me.wait_for_peers(2, [0, 1], NAMES, patience_s=0.5, cancel=threading.Event())
        assert time.monotonic() - t0 >= 1.2
    finally:
        t.join()
        me.stop("closed")
        peer.stop("closed")


def test_a_peer_alive_without_progress_is_named_slow_with_the_fix() -> None:
    me, peer = _pair([1])
    events.inner_step_done(0, 10)
    events.inner_step_done(1, 7)
    try:
        with pytest.raises(PeerError, match=r"worker 1 has not reached exchange #2 and is alive but took no inner "
                                            r"step for 0.3 s \(it last entered #1, 7 inner steps done\): it is slow "
                                            r"or stuck, not dead. .*raise --dist-timeout") as e:
            me.wait_for_peers(2, [0, 1], NAMES, patience_s=0.3, cancel=threading.Event())
        assert e.value.workers == [1]
    finally:
        me.stop("closed")
        peer.stop("closed")


def test_a_peer_at_this_workers_step_is_a_moment_behind_not_waited_for() -> None:
    me, peer = _pair([1])
    events.inner_step_done(0, 10)
    events.inner_step_done(1, 10)
    time.sleep(0.2)  # its heartbeat published
    t0 = time.monotonic()
    me.wait_for_peers(2, [0, 1], NAMES, patience_s=30.0, cancel=threading.Event())
    assert time.monotonic() - t0 < 1.0
    me.stop("closed")
    peer.stop("closed")


@pytest.mark.parametrize("how", ["silent", "closed"])
def test_a_silent_or_closed_peer_is_left_to_the_collective(how: str) -> None:
    me, peer = _pair([1])
    events.inner_step_done(0, 10)  # worker 1 is behind: only its silence ends the wait at once
    peer.stop("closed")
    if how == "silent":  # its last heartbeat older than the staleness bound, as "up"
        me.store.set("hb/1", f"{time.time() - 10:.3f} 1 up 0 3")
    t0 = time.monotonic()
    me.wait_for_peers(2, [0, 1], NAMES, patience_s=30.0, cancel=threading.Event())
    assert time.monotonic() - t0 < 5.0  # at once, not after the 30 s of patience
    me.stop("closed")


# Worker 1 takes 0.02 / 0.05 = 0.4 s an inner step, 1.6 s a round of 4: past the 1 s timeout, which a slow
# peer used to be declared dead at.
SLOW = ["--model", "micro", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress",
        "--steps", "8", "--inner-steps", "4", "--sim-step-time", "0.02", "--dist-timeout", "1", "--workers", "2"]


@pytest.mark.processes
@pytest.mark.parametrize("extra", [["--worker-speeds", "1,0.05"], ["--worker-speeds", "1,0.05", "--adaptive-steps"]],
                         ids=["fixed", "adaptive"])
def test_a_launched_run_with_a_slow_worker_trains(tmp_path: Path, extra: list[str]) -> None:
    r = launch_here([*SLOW, *extra, "--out", str(tmp_path)], 2)
    assert r.returncode == 0, r.stdout[-3000:]
    assert (tmp_path / "summary.json").exists()
