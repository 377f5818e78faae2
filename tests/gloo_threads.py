"""Several workers of a real gloo group in this one process, one thread each.

Each thread builds its own ProcessGroupGloo over one shared store (``eagerloco.comm.groups.gloo_group``);
the collectives really cross loopback TCP between the threads' gloo contexts. What needs no process
of its own (exact results, byte accounting, the emulated link's timing, the hook API's numbers) is
checked this way; kills, signals, WORLD and separate jobs stay with real processes.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from eagerloco.comm.groups import HEARTBEAT_PREFIX, DistContext, gloo_group

T = TypeVar("T")


def run_ranks(fn: Callable[[int, dist.Store], T], size: int, timeout_s: float = 60.0) -> list[T]:
    """fn(rank, store) on `size` threads at once, all given the same store; their results in rank order.

    A rank that raises fails the test with every rank's traceback; one still running after timeout_s
    (a hang) fails it too, instead of stalling the suite.
    """
    store = dist.HashStore()
    results: dict[int, T] = {}
    errors: dict[int, str] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, store)
        except BaseException:  # noqa: BLE001 - reported below, with the rank
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    report = "\n".join(f"--- rank {r}\n{e}" for r, e in sorted(errors.items()))
    assert not hung, f"ranks {hung} still running after {timeout_s} s\n{report}"
    assert not errors, report
    return [results[r] for r in range(size)]


def group(store: dist.Store, name: str, rank: int, size: int, timeout_s: float = 20.0) -> dist.ProcessGroup:
    """This thread's member of the gloo group `name` (its keys under their own prefix in the store)."""
    return gloo_group(dist.PrefixStore(f"{name}/", store), rank, size, timeout_s)


def context(store: dist.Store, rank: int, size: int, timeout_s: float = 20.0) -> DistContext:
    """What init_process_groups(size, 1) gives one rank of a run, over a gloo group of threads: one rank
    per worker, the outer group all workers, heartbeats in the store under their usual prefix."""
    return DistContext(rank=rank, world_size=size, worker=rank, rank_in_worker=0, workers=size, ranks_per_worker=1,
                       local_rank=rank, device=torch.device("cpu"), backend="gloo", timeout_s=timeout_s,
                       outer_group=group(store, "outer", rank, size, timeout_s),
                       store=dist.PrefixStore(HEARTBEAT_PREFIX, store))
