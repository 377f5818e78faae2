"""Elastic membership when each worker is its own job: the survivors of a dead worker go on.

The protocol is :class:`~eagerloco.comm.elastic.Membership`'s (flag the change, announce, agree on
the survivors with compare-and-set, settle the exchanges in flight, rerun the rest); what differs is
where the groups live. Jobs have no common WORLD: every epoch's group is a gloo group of its own
(:func:`~eagerloco.comm.groups.gloo_group`) over the TCPStore worker 0 hosts, under
``eagerloco/outer-pg/ep<E>/``, and the few control collectives of a change run on it too (the
communication thread is parked meanwhile). Each job's own WORLD (its DDP, if any) is never touched.

Limits, by design of a store that worker 0 hosts:

- worker 0 must stay: its process holds the store every survivor re-forms the group through. When
  it dies the others stop with a PeerError that says so (resume from a checkpoint);
- one process per job (a job of several ranks would need its ranks told of the change too);
- a worker that died does not come back into the running run (no ``--rejoin`` across jobs):
  the survivors finish with M - 1 (or fewer) workers.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.comm.elastic import Membership
from eagerloco.comm.errors import PeerError, describe_exception
from eagerloco.comm.groups import OUTER_PG_PREFIX, gloo_group


class JobsMembership(Membership):
    """Membership over the outer store of separate jobs (see the module).

    client: the raw TCPStore worker 0 hosts (:attr:`~eagerloco.comm.groups.DistContext.outer_store`);
    group: epoch 0's outer group (the one :func:`~eagerloco.comm.rendezvous.join_outer_group` formed).
    """

    def __init__(self, client: dist.Store, worker: int, workers: int, timeout_s: float,
                 group: dist.ProcessGroup | None, **kwargs: Any) -> None:
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
        return self.group

    def gather_progress(self, done: int, step: int) -> list[tuple[int, int]]:
        rows = torch.zeros(len(self.members) * 2, dtype=torch.int64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(rows, torch.tensor([done, step], dtype=torch.int64), group=self.group)
        return [(int(a), int(b)) for a, b in rows.view(-1, 2).tolist()]

    def share(self, buf: torch.Tensor, src: int) -> None:
        dist.broadcast(buf, group=self.group, group_src=src)

    def on_step(self, step: int) -> None:
        """After each inner step: re-form the group if an exchange failed, or, at a round boundary,
        if another survivor started a change. (No store round trip on the other steps: on a slow
        link every one would cost a latency.)"""
        self.step = step
        comm = self.comm
        assert comm is not None
        comm.step_hint = step + 1
        boundary = self.is_dp or step % self.inner_steps == 0
        try:
            changing = boundary and self.kv.check([f"ep{self.epoch + 1}/recovering"])
        except Exception as e:
            gone = self.store_gone(e)
            if gone is None:
                raise
            raise gone from e
        if comm.broken or changing:
            self.recover()

    def recover(self, cause: str = "") -> None:
        """Membership.recover, with a clear error when the store (worker 0's process) is gone."""
        try:
            super().recover(cause)
        except PeerError:
            raise
        except Exception as e:
            gone = self.store_gone(e)
            if gone is None:
                raise
            raise gone from e

    def store_gone(self, e: Exception) -> PeerError | None:
        """The error to stop with when ``e`` says the store (worker 0's process) is unreachable, else None."""
        if self.worker == 0 or not _store_error(e):
            return None
        if self.comm is not None:  # no last heartbeat into a store that is gone
            self.comm.heartbeat.store_lost = True
        return PeerError(
            f"worker 0 is gone (its process hosted the outer rendezvous store, now unreachable: "
            f"{describe_exception(e)}); elastic runs across separate jobs survive the loss of any worker "
            "but worker 0. Restart the workers and resume from the last checkpoint.", [0])

    def finish(self) -> None:
        """Nothing to agree on at the end: the survivors' outer parameters are those of the same
        exchanges (eager's copies differ as they always do)."""


def _store_error(e: BaseException) -> bool:
    """Whether e is the store's client failing to reach the store (its host is gone)."""
    if type(e).__name__ in ("DistNetworkError", "DistStoreError"):
        return True
    text = str(e)
    return any(w in text for w in ("Broken pipe", "Connection reset", "Connection refused", "Failed to recv"))


__all__ = ["JobsMembership"]
