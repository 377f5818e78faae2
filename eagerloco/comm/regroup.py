"""The communicator's side of an elastic membership change: park, hand the exchanges back, rerun them.

A failed collective does not fail the handles: the exchange thread parks with it, the caller's thread
notices and runs :mod:`eagerloco.comm.elastic`'s protocol, which re-forms the group and hands the unfinished
exchanges back (:meth:`Regroup.take_ops`, :meth:`Regroup.resume`) to run again. ``rank`` stays the worker id.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from eagerloco.comm.base import WorkerStats, wire_bytes
from eagerloco.comm.errors import PeerError
from eagerloco.comm.exchange_queue import ExchangeQueue, Result
from eagerloco.comm.ops import Op
from eagerloco.comm.peers import Peers


class Regroup:
    """A membership change on one worker's exchange queue and view of the group, on the caller's thread."""

    def __init__(self, exchanges: ExchangeQueue, peers: Peers, stats: WorkerStats) -> None:
        self.exchanges, self.peers, self.stats = exchanges, peers, stats

    def pause(self, timeout_s: float) -> None:
        """Park the exchange thread between exchanges; PeerError past timeout_s."""
        if not self.exchanges.pause(timeout_s):
            raise PeerError(f"{self.peers.name(self.peers.rank)}: the outer communication thread did not stop "
                            f"within {timeout_s:g} s for a membership change. Restart the run from the last "
                            "checkpoint.")

    def detach_group(self) -> None:
        """Drop the reference to the current group, so destroying it closes its sockets and survivors blocked in it
        fail at once instead of at the timeout."""
        assert self.exchanges.parked
        self.peers.group = None

    def take_ops(self) -> list[Op]:
        """The exchanges not completed here, in launch order (the thread must be parked)."""
        return self.exchanges.take_ops()

    def recent_result(self, seq: int) -> Result:
        """(numel, flat mean, launch step) of a recently completed exchange, for survivors that did not complete it."""
        result = self.exchanges.recent(seq)
        if result is None:
            raise PeerError(f"{self.peers.name(self.peers.rank)} no longer holds the result of exchange #{seq}; "
                            "restart the run from the last checkpoint")
        return result

    def complete_from_peer(self, op: Op, mean: torch.Tensor | None) -> None:
        """Finish an exchange with the result another survivor saw complete (elastic recovery): its mean
        holds every worker of the group it ran in, the one not re-formed yet."""
        op.handle.contributors = list(self.peers.members)
        self.exchanges.land_from_peer(op, mean)

    def resume(self, group: dist.ProcessGroup | None, members: list[int], ops: list[Op], epoch: int,
               names: Mapping[int, str] | None = None) -> None:
        """Continue on a new group: rerun the given exchanges there, in order, then the later ones (counted again; the
        emulated link restarts with the same seed and epoch on every member)."""
        assert self.exchanges.parked, "pause() first"
        self.peers.regroup(group, members, names)
        self.peers.reset_link(epoch)
        for op in ops:
            if op.codec is not None and op.payload is not None:
                op.wire = wire_bytes(op.payload.numel(), self.peers.size, op.codec.summable)
                self.stats.bytes_sent += op.wire
                self.stats.bytes_received += op.wire
        self.exchanges.resume(ops)

    def adopt_sequence(self, launched: int) -> None:
        """A worker that joins continues the members' exchange numbering."""
        self.exchanges.adopt_sequence(launched)
