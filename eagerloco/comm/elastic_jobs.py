"""Elastic membership when each worker is its own job: workers leave, come back and arrive while the others go on.

The protocol is :class:`~eagerloco.comm.elastic.Membership`'s (flag the change, announce, agree on
the survivors with compare-and-set, settle the exchanges in flight, rerun the rest; admit a joiner
at a round boundary with a live member's state); what differs is where the groups live. Jobs have no
common WORLD: every epoch's group is a gloo group of its own (:func:`~eagerloco.comm.groups.gloo_group`)
over the coordinator's store (``eagerloco coordinator``, which no worker hosts), under
``eagerloco/outer-pg/ep<E>/``, and the few control collectives of a change run on it too (the
communication thread is parked meanwhile). Each job's own WORLD (its DDP, if any) is never touched.
One process per job (a job of several ranks would need its ranks told of the change too).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.comm.elastic import Membership
from eagerloco.comm.groups import OUTER_PG_PREFIX, gloo_group

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class JobsMembership(Membership):
    """Membership over the coordinator's store (see the module).

    client: the coordinator's store (:attr:`~eagerloco.comm.groups.DistContext.outer_store`);
    group: epoch 0's outer group (the one :func:`~eagerloco.comm.rendezvous.join_outer_group` formed;
    None for a joiner, whose group :meth:`join` forms).
    """

    def __init__(self, client: dist.Store, worker: int, workers: int, timeout_s: float,
                 group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(client, worker, workers, timeout_s, **kwargs)
        self.group: dist.ProcessGroup | None = group

    def teardown(self) -> None:  # type: ignore[override]
        """Shut the current group down now: its sockets close, so survivors still blocked in one of
        its collectives fail at once instead of at the timeout."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # already broken: nothing more to release
                pass
        gc.collect()

    def form(self, epoch: int, members: list[int]) -> dist.ProcessGroup:
        self.teardown()
        store = dist.PrefixStore(f"{OUTER_PG_PREFIX}ep{epoch}/", self.client)
        self.group = gloo_group(store, members.index(self.worker), len(members), self.timeout_s)
        self.epoch, self.members = epoch, list(members)
        self.kv.set("members", ",".join(map(str, members)))
        return self.group

    def gather_progress(self, done: int, step: int) -> list[tuple[int, int]]:
        rows = torch.zeros(len(self.members) * 2, dtype=torch.int64)
        _gather(rows, torch.tensor([done, step], dtype=torch.int64), group=self.group)
        return [(int(a), int(b)) for a, b in rows.view(-1, 2).tolist()]

    def gather_digests(self, mine: str) -> list[str]:
        rows = torch.zeros(len(self.members) * 32, dtype=torch.uint8)
        _gather(rows, torch.frombuffer(bytearray.fromhex(mine), dtype=torch.uint8),
                                    group=self.group)
        return [bytes(r).hex() for r in rows.view(-1, 32).tolist()]

    def share(self, buf: torch.Tensor, src: int) -> None:
        dist.broadcast(buf, group=self.group, group_src=src)

    # The group is not WORLD's subgroup, so torch.distributed's point-to-point calls refuse it: its own methods.
    def send(self, t: torch.Tensor, dst: int) -> None:
        assert self.group is not None
        self.group.send([t], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        assert self.group is not None
        self.group.recv([t], src, 0).wait()

    def barrier(self) -> None:
        assert self.group is not None
        self.group.barrier().wait()

    def on_step(self, step: int) -> None:
        """After each inner step: re-form the group if an exchange failed; at a round boundary, if another
        survivor started a change, and admit joiners. (No store round trip on the other steps: on a slow
        link every one would cost a latency.)"""
        self.step = step
        comm = self.comm
        assert comm is not None
        comm.step_hint = step + 1
        boundary = self.is_dp or step % self.inner_steps == 0
        if comm.broken or (boundary and self.kv.check([f"ep{self.epoch + 1}/recovering"])):
            self.recover()
        if boundary:
            self.boundary(step)

    def finish(self) -> None:
        """Tell joiners still waiting that the run is over (nothing to agree on: the members' outer parameters
        are those of the same exchanges, eager's copies differing as they always do)."""
        if self.is_leader():
            self.kv.set("done", "1")


__all__ = ["JobsMembership"]
