"""The communicator's side of an elastic membership change: park, hand the exchanges back, rerun them.

In elastic mode (``elastic=True``, driven by :mod:`eagerloco.comm.elastic`) a failed collective
does not fail the handles: the communication thread parks with the failed exchange kept, the
caller's thread notices (at its next wait, or at a step boundary through ``broken``) and runs the
membership protocol, which re-forms the group among the survivors and hands the unfinished
exchanges back (:meth:`ElasticExchanges.take_jobs`, :meth:`~ElasticExchanges.resume`) to be run
again on the new group. ``rank`` stays the worker id (it names seeds, shards and files); the
position in the current group is separate.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from eagerloco.comm.base import WorkerStats, wire_bytes
from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.comm.errors import PeerError
from eagerloco.comm.jobs import PAUSE, Job
from eagerloco.config import LinkConfig

if TYPE_CHECKING:
    from eagerloco.comm.distributed import TorchDistHandle


class ElasticExchanges:
    """What :class:`~eagerloco.comm.elastic.Membership` calls on a
    :class:`~eagerloco.comm.distributed.TorchDistCommunicator` (a base class of it) to re-form the
    group, on the caller's thread. The state it works on is the communicator's, declared here."""

    group: dist.ProcessGroup | None
    rank: int
    num_workers: int
    stats: WorkerStats
    link: EmulatedLink
    _members: list[int]
    _pos: int
    _names: dict[int, str]
    _link_cfg: LinkConfig | None
    _seed: int
    _broken: tuple[int, str] | None  # (exchange, what failed): text, no traceback
    _parked: threading.Event
    _resume_ev: threading.Event
    _parked_job: Job | None
    _jobs: queue.Queue[Job | object | None]
    _done_upto: int
    _recent: dict[int, tuple[int, torch.Tensor | None, int]]  # seq -> (numel, flat mean, launch step)
    _pending: dict[int, TorchDistHandle]
    _pending_lock: threading.Lock
    _launched: int
    _entered: int

    if TYPE_CHECKING:
        def _check_open(self) -> None: ...
        def _name(self, w: int) -> str: ...

    @property
    def launched(self) -> int:
        """How many operations this worker launched (the exchange numbering a joiner continues)."""
        return self._launched

    def done_upto_step(self) -> int:
        """The training step at which the last exchange completed here was launched (0 if unknown)."""
        seq = self._done_upto
        return self._recent[seq][2] if seq in self._recent else 0

    @property
    def broken(self) -> bool:
        """Whether a collective failed and the group must be re-formed (elastic mode)."""
        return self._broken is not None

    @property
    def done_upto(self) -> int:
        """The last exchange completed here (exchanges complete in launch order)."""
        return self._done_upto

    @property
    def members(self) -> list[int]:
        """The worker id of each rank of the current group."""
        return list(self._members)

    def pause(self, timeout_s: float) -> None:
        """Park the communication thread between exchanges; returns once it is parked.

        An exchange under way finishes first (or fails, when a member is gone: then the thread
        parks with it). Raises PeerError if that takes longer than timeout_s.
        """
        self._check_open()
        if not self._parked.is_set():
            self._jobs.put(PAUSE)
        if not self._parked.wait(timeout_s):
            raise PeerError(f"{self._name(self.rank)}: the outer communication thread did not stop within "
                            f"{timeout_s:g} s for a membership change. Restart the run from the last checkpoint.")

    def detach_group(self) -> None:
        """Drop the reference to the current group (parked thread), so that destroying it closes its
        sockets: survivors still blocked in a collective of that group then fail at once instead
        of at the timeout."""
        assert self._parked.is_set()
        self.group = None

    @property
    def failure(self) -> str:
        """What failed, when broken (elastic mode)."""
        return f"exchange #{self._broken[0]}: {self._broken[1]}" if self._broken else ""

    def take_jobs(self) -> list[Job]:
        """The exchanges not completed here, in launch order (the thread must be parked)."""
        assert self._parked.is_set()
        jobs = [] if self._parked_job is None else [self._parked_job]
        self._parked_job = None
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job):
                jobs.append(job)
        return sorted(jobs, key=lambda j: j.seq)

    def recent_result(self, seq: int) -> tuple[int, torch.Tensor | None, int]:
        """(numel, flat mean, launch step) of a recently completed exchange, for survivors that did not complete it."""
        if seq not in self._recent:
            raise PeerError(f"{self._name(self.rank)} no longer holds the result of exchange #{seq}; "
                            "restart the run from the last checkpoint")
        return self._recent[seq]

    def complete_from_peer(self, job: Job, mean: torch.Tensor | None) -> None:
        """Finish an exchange with the result another survivor saw complete (elastic recovery)."""
        self._done_upto = max(self._done_upto, job.seq)
        self._recent[job.seq] = (job.numel, mean, job.step)
        job.handle._finish(mean=mean)
        with self._pending_lock:
            self._pending.pop(job.seq, None)

    def resume(self, group: dist.ProcessGroup | None, members: list[int], jobs: list[Job], epoch: int,
               names: Mapping[int, str] | None = None) -> None:
        """Continue on a new group: rerun the given exchanges there, in order, then the later ones.

        The emulated link restarts (same seed and epoch on every member, so they agree on it);
        an exchange that runs again is counted again in the byte accounting, at the new size.
        """
        assert self._parked.is_set(), "pause() first"
        self.group = group
        self._members = list(members)
        self._pos = self._members.index(self.rank)
        self.num_workers = len(self._members)
        if names is not None:
            self._names.update(names)
        self.reset_link(epoch)
        pending = []
        while True:  # launches made while parked queue up behind the reruns
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job.codec is not None and job.payload is not None:
                job.wire = wire_bytes(job.payload.numel(), self.num_workers, job.codec.summable)
                self.stats.bytes_sent += job.wire
                self.stats.bytes_received += job.wire
            self._jobs.put(job)
        for job in pending:
            if job is not PAUSE:
                self._jobs.put(job)
        self._broken = None
        self._parked.clear()
        self._resume_ev.set()

    def reset_link(self, epoch: int) -> None:
        """A fresh emulated link for a membership epoch (same seed and epoch on every member)."""
        self.link = EmulatedLink(self._link_cfg, self._seed + 7919 * epoch)

    def adopt_sequence(self, launched: int) -> None:
        """A worker that joins continues the members' exchange numbering."""
        assert not self._pending, "adopt_sequence() before any exchange"
        self._launched = self._entered = self._done_upto = launched
