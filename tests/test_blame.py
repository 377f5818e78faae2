"""Naming the rank that failed from the run's store: a rank that stopped for a failed peer is a witness."""

from __future__ import annotations

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
