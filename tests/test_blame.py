"""Naming the rank that failed from the run's store: a rank that stopped for a failed peer is a witness."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from eagerloco.comm.errors import PEER_EXIT_CODE
from eagerloco.comm.heartbeat import blame_ranks


def _store(exits: dict[int, int]) -> dist.Store:
    store = dist.HashStore()
    for rank, rc in exits.items():
        store.set(f"rank/exited/{rank}", str(rc))
    return store


def test_a_rank_that_stopped_for_a_failed_peer_is_not_blamed_when_the_cause_is_known() -> None:
    # 2 workers x 2 ranks: rank 1 was killed; rank 0 already stopped (exit 3) because of it.
    err = blame_ranks(_store({0: PEER_EXIT_CODE, 1: -9}), me=3, world=4, ranks_per_worker=2, what="a checkpoint",
                      wait_s=0.0)
    text = str(err)
    assert "global rank 1 (worker 0) was killed by signal 9" in text, text
    assert "global rank 0" not in text, text
    assert err.workers == [0]


def test_only_witnesses_are_named_when_nothing_else_is_known() -> None:
    err = blame_ranks(_store({0: PEER_EXIT_CODE}), me=3, world=4, ranks_per_worker=2, what="a checkpoint", wait_s=0.0)
    assert "global rank 0 (worker 0) stopped for a failed peer" in str(err), str(err)
    assert err.workers == []


def test_nothing_known_says_so() -> None:
    err = blame_ranks(_store({}), me=0, world=2, ranks_per_worker=1, what="a checkpoint", wait_s=0.0)
    assert "no other rank looks dead or frozen" in str(err) and "Check every rank's log" in str(err)


def test_a_recorded_end_outweighs_the_stale_heartbeats_of_ranks_shutting_down() -> None:
    # Rank 1 was killed; ranks 0 and 2 gave up for it and stopped beating 3.5 s ago while they shut down (slowly,
    # on a busy machine), before the launcher saw them end: only rank 1 is the cause.
    store = _store({1: -9})
    for rank in (0, 2):
        store.set(f"rank/hb/{rank}", f"{time.time() - 3.5} 0 up 0 0")
    err = blame_ranks(store, me=3, world=4, ranks_per_worker=2, what="a checkpoint", wait_s=0.0)
    assert str(err).count("global rank") == 2 and "global rank 1 (worker 0) was killed by signal 9" in str(err)
    assert err.workers == [0]
    # a stale heartbeat alone (a frozen rank) is named once the wait for a recorded end is over
    frozen = _store({})
    frozen.set("rank/hb/1", f"{time.time() - 3.5} 0 up 0 0")
    t0 = time.monotonic()
    err = blame_ranks(frozen, me=0, world=2, ranks_per_worker=1, what="a checkpoint", wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    assert "global rank 1 (worker 1) is frozen or gone (last heartbeat 4." in str(err) and err.workers == [1]


def test_a_rank_reads_the_stop_signal_the_launcher_passes_on() -> None:
    """A rank whose collective fails because another rank stopped on the launcher's signal first says it was
    stopped by that signal (the launcher notes it in the run's store before passing it on)."""
    import signal

    from eagerloco.signals import STOPPING_KEY, RunStopped, launcher_stopping, stopped_by

    store = dist.HashStore()
    assert launcher_stopping(store) is None
    store.set(STOPPING_KEY, str(int(signal.SIGHUP)))
    assert launcher_stopping(store) == signal.SIGHUP
    assert launcher_stopping(object()) is None  # a store that cannot be read: nothing known
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        e = stopped_by(signal.SIGHUP)
        assert isinstance(e, RunStopped) and e.signum == signal.SIGHUP and str(e) == "stopped by SIGHUP"
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in before)  # cleanup runs once
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_member_that_publishes_and_closes_while_the_leader_looks_is_collected() -> None:
    """The leader finds worker 1's final summary missing, then (worker 1 having published it and closed its
    heartbeat in between) finds worker 1 gone: collect must still return worker 1's entry, not drop it."""
    from types import SimpleNamespace

    from eagerloco.comm.elastic import Membership

    store = dist.HashStore()

    class PublishesWhileLooked(Membership):
        def _gone(self, w: int) -> bool:  # the interleaving: worker 1 finishes between the two reads
            self.kv.set(f"final/{w}", '{"worker": 1}')
            self.hb.set(f"hb/{w}", f"{time.time()} 0 closed 9 9")
            return super()._gone(w)

    m = PublishesWhileLooked(store, worker=0, workers=2, timeout_s=5.0)
    m.comm = SimpleNamespace(broken=False)  # type: ignore[assignment]
    m.kv.set("final/0", '{"worker": 0}')
    assert m.collect("final") == {0: {"worker": 0}, 1: {"worker": 1}}


def test_a_backend_failure_during_a_membership_change_is_one_line() -> None:
    """A joiner or its source failing mid-handover (gloo's send timing out) ends the worker with one PeerError
    line naming the change and the way on, not gloo's C++ location and frames."""
    from eagerloco.comm import elastic

    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                        "20000ms for send operation to complete\nframe #0 ...")
    admitting = "worker 0: a failure while admitting workers [2] at step 6"
    for e in (gloo, RuntimeError("Connection closed by peer [127.0.0.1]:2989. This is typically caused by ...")):
        with pytest.raises(elastic.PeerError) as caught:
            try:
                raise e
            except RuntimeError as err:
                raise elastic.Membership.change_failed(err, admitting) from None
        text = str(caught.value)
        assert text.startswith(admitting + " (") and text.endswith("; resume from the last checkpoint"), text
        assert "\n" not in text and ".cc:" not in text and "frame" not in text, text
    ours = elastic.PeerError("worker 1: another failure during a membership change")
    assert elastic.Membership.change_failed(ours, admitting) is ours
