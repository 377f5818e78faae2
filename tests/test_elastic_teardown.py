"""A membership change tears the old group down so that members still blocked in one of its collectives fail at
once (comm/elastic.py, Membership.teardown): its last reference dropped, or a collection where reference cycles
keep it."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch.distributed as dist

from eagerloco.comm.elastic import Membership

GROUP_TIMEOUT_S = 120.0  # far above the wait below: a peer that fails did so because the group was torn down


def hold_in_a_cycle(group: Any) -> None:
    """Keep ``group`` alive through a reference cycle only, as a failed collective's frames can."""
    box: dict[str, Any] = {"group": group}
    box["box"] = box


@pytest.mark.parametrize("cycle", [False, True], ids=["last reference", "held by a cycle"])
def test_teardown_fails_a_peer_blocked_in_the_old_group(cycle: bool) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    members = [Membership(dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False), w, 2,
                          GROUP_TIMEOUT_S) for w in range(2)]
    forming = [threading.Thread(target=m.form, args=(0, [0, 1])) for m in members]
    for t in forming:
        t.start()
    for t in forming:
        t.join(60)
    leaving, blocked = members
    outcome: list[str] = []

    def wait_in_barrier() -> None:
        try:
            blocked.barrier()
            outcome.append("passed")
        except RuntimeError:
            outcome.append("failed")

    gc.disable()  # only teardown's own collection may free a group held by a cycle
    try:
        if cycle:
            hold_in_a_cycle(leaving.group)
        waiter = threading.Thread(target=wait_in_barrier, daemon=True)
        waiter.start()
        leaving.teardown()
        waiter.join(GROUP_TIMEOUT_S / 4)
    finally:
        gc.enable()
        blocked.teardown()
    assert leaving.group is None
    assert outcome == ["failed"]
