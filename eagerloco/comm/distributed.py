"""The torch.distributed transport: one outer communicator per process, exchanges in a background thread.

Only the outer ranks (:mod:`eagerloco.comm.groups`) own a :class:`TorchDistCommunicator`; the others share
its results through :class:`~eagerloco.comm.worker.WorkerCommunicator`. It composes the queue
(:mod:`~eagerloco.comm.exchange_queue`), the header checks (:mod:`~eagerloco.comm.ops`) and the heartbeat
(:mod:`~eagerloco.comm.heartbeat`), and parks for an elastic membership change (:mod:`~eagerloco.comm.elastic`),
which alone changes its group, members and link.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.codecs import Codec
from eagerloco.comm.base import (
    Communicator,
    Handle,
    Window,
    WorkerStats,
    encode,
    flatten,
    hand_over,
    mean_of_payloads,
    unflatten,
    wire_bytes,
)
from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.comm.errors import PeerError, TransportError, describe_exception
from eagerloco.comm.exchange_queue import ExchangeQueue, Result
from eagerloco.comm.groups import DEFAULT_TIMEOUT_S
from eagerloco.comm.heartbeat import HEARTBEAT_S, Heartbeat
from eagerloco.comm.ops import AGREE, BARRIER, Op, check_headers, check_schedules, header
from eagerloco.comm.quorum_jobs import QuorumJobs
from eagerloco.comm.reduce_scatter import Shards, uses_reduce_scatter
from eagerloco.comm.staging import Staging
from eagerloco.config import LinkConfig

#: Extra time the waiting thread grants beyond the collective timeout before it gives up on its own
#: (gloo normally raises at the timeout; this is the backstop if it does not).
_WAIT_SLACK_S = 10.0
_POLL_S = 0.25

# all_gather_single is the current name; older releases only have all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistHandle(Handle):
    """An exchange in flight in the communication thread."""

    def __init__(self, comm: TorchDistCommunicator, seq: int, own: list[torch.Tensor], payload_bytes: int,
                 like: list[torch.Tensor], device: torch.device) -> None:
        self._comm, self.seq = comm, seq
        self.own = own
        self.payload_bytes = payload_bytes
        self._like, self._device = like, device
        self._event = threading.Event()
        self._mean: torch.Tensor | None = None
        self._done_event: Any = None  # NCCL: the CUDA event the mean is ready after
        self._error: BaseException | None = None
        self._waited = False
        #: (wire, payload) bytes of an exchange its transport ran itself, counted where it lands.
        self.exchanged: tuple[int, int] | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Block until the exchange landed (time added to stats.blocked_s). By default the wait lasts while the
        exchanges ahead make progress, and gives up once one collective is stuck past the timeout (plus slack)."""
        if self._waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        self._waited = True
        self._comm._unwaited.discard(self.seq)
        t0 = time.perf_counter()
        try:
            self._comm._await(self)
        finally:
            self._comm.stats.blocked_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        assert self._mean is not None
        mean, self._mean = self._mean, None
        if self.exchanged is not None:
            self._comm.stats.exchanged(*self.exchanged)
        if self._comm.staging.cuda:
            mean = self._comm.staging.deliver(mean, self._done_event, self._device)
        if out is not None:
            return hand_over(unflatten(mean, self._like), out)
        # The caller owns what it gets (an optimizer may write into it). In elastic mode the
        # communicator also keeps the mean for survivors of a membership change: hand out a copy.
        return unflatten(mean.to(self._device, copy=self._comm.elastic), self._like)

    def finish(self, mean: torch.Tensor | None = None, error: BaseException | None = None, done: Any = None) -> None:
        """Land the exchange (see :class:`~eagerloco.comm.base.OpHandle`); only the first call counts."""
        if not self._event.is_set():
            self._mean, self._error, self._done_event = mean, error, done
            self._event.set()


class TorchDistCommunicator(Communicator):
    """One worker's view of the outer group over torch.distributed (one worker per process).

    ``store``: where heartbeats go (None: errors cannot name a dead worker). ``seed``: jitter RNG, the same on
    all workers so they agree on the link schedule. ``elastic``: park on a failed collective instead of failing.
    ``members``: the worker id of each group rank. ``channel``: this rank's index in its worker when each rank
    exchanges a shard. ``device``: on a GPU payloads pass through :mod:`~eagerloco.comm.staging`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        link: LinkConfig | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        names: Mapping[int, str] | None = None,
        *,
        store: dist.Store | None = None,
        seed: int = 0,
        heartbeat_s: float = HEARTBEAT_S,
        elastic: bool = False,
        members: list[int] | None = None,
        channel: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if group is None and not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_groups first")
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not in the outer group: only the first rank of each worker "
                             "exchanges with the other workers")
        # A subgroup of WORLD, or a group across jobs (join_outer_group), whose rank dist.get_rank() refuses.
        pos, size = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank(), group.size())
        members = list(members) if members is not None else list(range(size))
        if len(members) != size:
            raise ValueError(f"members {members} do not match the group's size {size}")
        self.rank = members[pos]  # worker id: stable across membership changes
        self.stats = WorkerStats()
        #: How payloads move between the parameters' device and the group's transport.
        # A group's name() is its backend; dist.get_backend() knows only WORLD's groups (see gloo_group).
        backend = (group if group is not None else dist.group.WORLD).name()
        self.staging = Staging(device, on_device=backend == "nccl")
        #: The current group (None: the default group, or detached for a membership change), the worker id of each
        #: of its ranks (this worker's at ``pos``), how errors name each worker, and the emulated link among them.
        self.group, self._members, self.pos, self.names = group, members, pos, dict(names or {})
        self._link_cfg, self._seed = link, seed
        self.link = EmulatedLink(link, seed)
        self.elastic = elastic
        #: Called on the caller's thread when it finds the group broken (elastic); re-forms it.
        self.recover_hook: Any = None
        #: Training step, published with the heartbeat (what a lost worker had done).
        self.step_hint = 0
        self.timeout_s = float(timeout_s)
        #: The operations in launch order, and the thread that runs them (:meth:`_run_op`).
        self.exchanges = ExchangeQueue(self._run_op, keep_means=elastic, on_start=self.staging.enter_thread,
                                       name=f"eagerloco-outer-w{self.rank}")
        self.quorum_jobs: QuorumJobs | None = None  # set by JobRuntime: --quorum below M across jobs
        self._agreed = False  # agree() succeeded: exchanges launched with agreed=True skip the header
        self._unwaited: set[int] = set()  # launched exchanges nobody waited on (yet)
        self._in_collective_since: float | None = None  # monotonic time, while inside a collective
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._closed = False
        #: This worker's heartbeat in the store, read by the others to name a dead worker.
        self.heartbeat = Heartbeat(store, self.rank, channel, heartbeat_s,
                                   progress=lambda: (self.exchanges.entered, self.step_hint))
        self.exchanges.start()

    def __enter__(self) -> TorchDistCommunicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc is not None)

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return len(self._members)

    @property
    def members(self) -> list[int]:
        return list(self._members)

    def name(self, w: int) -> str:
        """How messages call worker w."""
        return self.names.get(w, f"worker {w}")

    # -- the Communicator interface ----------------------------------------------------------------

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False, transport: str = "allgather", window: Window | None = None,
    ) -> Handle:
        self._check_open()
        if window is not None and self.quorum_jobs is not None:  # across jobs at the coordinator (12.10)
            return self._quorum_exchange(tensors, window, keep_own)
        flat = flatten(tensors)
        numel = flat.numel()
        shards = Shards(codec, numel, self.num_workers) if uses_reduce_scatter(codec, transport, self.num_workers) \
            else None
        if shards is not None and self.elastic:
            raise ValueError("transport reduce-scatter shards by the number of workers, which an elastic group "
                             "changes mid-exchange: use transport allgather")
        # On the parameters' device.
        packed, own_flat = encode(codec, flat, generator) if shards is None else shards.pack(flat, generator)
        nbytes = packed.numel()
        packed, ready = self.staging.send(packed)  # gloo: to (pinned) host memory, without waiting
        wire = wire_bytes(nbytes, self.num_workers, codec.summable) if shards is None else shards.wire_bytes
        self.stats.exchanged(wire, nbytes)
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        handle = self._enqueue(numel, like, device, own=unflatten(own_flat, like) if keep_own else [], nbytes=nbytes)
        self._unwaited.add(handle.seq)
        # Without keep_own the payload is the communicator's alone; outside elastic mode a failed
        # collective ends the run, so no rerun needs it intact either.
        op = Op(handle.seq, numel, time.time(), handle, codec, packed, wire, self.step_hint,
                inplace=not keep_own and not self.elastic, checked=not (agreed and self._agreed), ready=ready,
                shards=shards)
        self.exchanges.put(op)
        return handle

    def _quorum_exchange(self, tensors: list[torch.Tensor], window: Window, keep_own: bool) -> Handle:
        """A quorum exchange at the coordinator on the communication thread, overlapping what follows as every
        exchange does; under --elastic on this thread, where the membership changes."""
        quorum = self.quorum_jobs
        assert quorum is not None
        if quorum.membership is not None:
            return quorum.exchange(tensors, window, keep_own)
        flat, compute_s = flatten(tensors).float().cpu(), self.stats.compute_s  # gloo; the compute at launch
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        handle = self._enqueue(flat.numel(), like, device, own=unflatten(flat, like) if keep_own else [],
                               nbytes=flat.numel() * 4)
        self._unwaited.add(handle.seq)

        def run() -> torch.Tensor:
            mean, handle.quorum, wire = quorum.run(flat, window, compute_s)
            handle.exchanged = (wire, flat.numel() * 4)
            return mean

        self.exchanges.put(Op(handle.seq, flat.numel(), time.time(), handle, step=self.step_hint, checked=False,
                              run=run))
        return handle

    def quorum_state(self) -> dict[str, Any] | None:
        return None if self.quorum_jobs is None else self.quorum_jobs.state_dict()

    def load_quorum_state(self, state: dict[str, Any] | None) -> None:
        if self.quorum_jobs is not None and state is not None:
            self.quorum_jobs.load_state_dict(state)

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """Agree once on the schedule, so exchanges launched with ``agreed=True`` skip the per-exchange header round
        trip (one latency each). False, without talking, in elastic mode (changes rerun exchanges by their sequence)
        and on an emulated link (the header carries the launch times).
        """
        self._check_open()
        if self.elastic or not self.link.trivial:
            return False
        digest = torch.frombuffer(bytearray(hashlib.sha256(schedule).digest()), dtype=torch.uint8)
        self._control(AGREE, digest, describe)
        self._agreed = True
        return True

    def barrier(self) -> None:
        """Wait until every worker reached this point (in order with the exchanges launched before)."""
        self._check_open()
        self._control(BARRIER)

    def _control(self, kind: int, payload: torch.Tensor | None = None, note: str = "") -> None:
        """Run a barrier or an agreement in order with the exchanges launched before, and wait for it."""
        handle = self._enqueue(kind, [], torch.device("cpu"), own=[], nbytes=0 if payload is None else payload.numel())
        self.exchanges.put(Op(handle.seq, kind, time.time(), handle, payload=payload, step=self.step_hint, note=note))
        self._await(handle)
        handle._waited = True
        if handle._error is not None:
            raise handle._error

    def close(self, cancel: bool = False) -> None:
        """Stop the communication thread; queued exchanges run first unless ``cancel`` (or after an error). Waits at
        most the timeout."""
        if self._closed:
            return
        self._closed = True
        if cancel or self._error is not None:
            self._cancel.set()
        # A parked thread (elastic) leaves as well.
        if not self.exchanges.stop(1.0 if self._cancel.is_set() else self.timeout_s + _WAIT_SLACK_S):
            warnings.warn("the outer communication thread is still inside a collective; abandoning it",
                          stacklevel=2)
        if self._unwaited and self._error is None and not cancel:
            warnings.warn(
                f"{len(self._unwaited)} exchange(s) were never waited on; wait on every handle", stacklevel=2
            )
        # "failed": gave up because of a peer (others must not blame it); "closed": left on its own.
        self.heartbeat.stop("failed" if isinstance(self._error, PeerError) else "closed")
        if self.quorum_jobs is not None:
            self.quorum_jobs.close()
        # Let go of the group, so that whoever formed it can free it (its gloo threads and sockets) now:
        # see groups.leave_outer_group.
        self.group = None

    # -- caller's side ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this communicator is closed")
        if self._error is not None:
            raise self._error

    def _enqueue(self, numel: int, like: list[torch.Tensor], device: torch.device, own: list[torch.Tensor],
                 nbytes: int) -> TorchDistHandle:
        handle = TorchDistHandle(self, self.exchanges.next_seq(), own, nbytes, like, device)
        self.exchanges.track(handle)
        return handle

    def _await(self, handle: TorchDistHandle) -> None:
        """Wait for the handle; give up when the transport stopped making progress."""
        limit = self.timeout_s + _WAIT_SLACK_S
        while not handle._event.wait(_POLL_S):
            if self.exchanges.broken is not None and self.recover_hook is not None:
                self.recover_hook()  # re-forms the group; this exchange then lands or runs again
                continue
            since = self._in_collective_since
            stuck = 0.0 if since is None else time.monotonic() - since
            if stuck >= limit:
                self._fail(handle.seq, f"a collective made no progress for {stuck:.1f} s", None)
            elif not self.exchanges.alive:
                self._fail(handle.seq, "the communication thread stopped", None)

    # -- communication thread -----------------------------------------------------------------------

    def _run_op(self, op: Op) -> str | None:
        """Run one operation on the exchange thread and land its handle, or fail it; in elastic mode, when
        a peer is gone, return what failed instead: the thread then parks with the op kept."""
        try:
            if self._error is not None:
                raise self._error
            if self._cancel.is_set():
                raise RuntimeError("the communicator was closed before this exchange ran")
            mean, done = self.staging.received(self._execute(op))
        except TransportError as e:  # a peer is gone or hung
            self._in_collective_since = None
            if self.elastic and not self._cancel.is_set():
                # Keep text only: the exception's traceback would keep the broken group (and its
                # sockets, which the other survivors wait on) alive.
                return describe_exception(e.__cause__ or e)
            self._fail(op.seq, "the collective failed", e.__cause__)
        except Exception as e:  # a schedule mismatch or a local bug: report it as is
            if self._error is None:
                self._error = e
            self.exchanges.fail_pending(self._error)
        else:
            # Elastic mode keeps recent means for survivors that missed them; they are then
            # shared, so wait() hands out copies. Otherwise the mean is the handle's alone.
            if op.run is None:  # a transport's own exchange says who is in its mean (Handle.quorum)
                op.handle.contributors = self.members  # the group it ran in
            self.exchanges.land(op, mean, done)
        self._in_collective_since = None
        return None

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        """All-gather equal-size uint8 buffers; rows in worker order, on the buffer's device (a host
        buffer, such as a header, makes a round trip through the device for NCCL)."""
        home = buf.device
        if self.staging.on_device and home.type == "cpu":
            buf = buf.to(self.staging.device)
        out = torch.empty(self.num_workers * buf.numel(), dtype=torch.uint8, device=buf.device)
        return self._collective(_all_gather, out, buf).view(self.num_workers, buf.numel()).to(home)

    def _scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """All-to-all of equal-size uint8 rows: row j goes to group position j; returns the rows received, in group
        order (gloo sends the M-1 others' rows and copies this worker's own)."""
        return self._collective(dist.all_to_all_single, torch.empty_like(rows), rows)

    def _sum(self, buf: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) an FP32 buffer in place: half the bytes of an all-gather beyond M = 2."""
        return self._collective(dist.all_reduce, buf, op=dist.ReduceOp.SUM)

    def _collective(self, fn: Any, out: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One collective into ``out`` on the current group, timed for :meth:`_await`; a failure is a
        TransportError."""
        self._in_collective_since = time.monotonic()
        try:
            fn(out, *args, group=self.group, **kwargs)
        except Exception as e:
            raise TransportError(str(e)) from e
        self._in_collective_since = None
        return out

    def _execute(self, op: Op) -> torch.Tensor | None:
        """Run one operation on this thread; returns the flat FP32 mean (None for a barrier or agreement).

        Header all-gather unless agreed, then the payload, then a sleep until the emulated link could have carried it.
        Quantized payloads are all-gathered and summed in FP32 in worker order (bit for bit the in-process result);
        FP32 payloads by one all-reduce (the same bits for M = 2, else the ring's order), as
        :func:`~eagerloco.comm.base.wire_bytes` accounts.
        """
        self.exchanges.entered = op.seq
        self.heartbeat.announce()
        if op.run is not None:
            return op.run()
        self.heartbeat.wait_for_peers(op.seq, self._members, self.names, self.timeout_s, self._cancel)
        codec = op.codec
        start = op.launch_wall
        if op.checked:
            rows = self._gather(header(op)).view(torch.float64)
            check_headers(rows, self.pos, self._members, self.name)
            start = float(rows[:, 0].max())
        if op.numel == BARRIER:
            return None
        if op.numel == AGREE:
            assert op.payload is not None
            check_schedules(self._gather(op.payload), self.pos, self._members, self.name, op.note)
            return None
        assert codec is not None and op.payload is not None
        self.staging.before_collective(op.ready)
        if codec.summable and self.num_workers > 1:
            # FP32: one all-reduce; on a copy where the payload must stay intact (the caller's own
            # share, or a rerun among the survivors of a failed collective in elastic mode).
            buf = op.payload if op.inplace else op.payload.clone()
            mean = self._sum(buf.view(torch.float32)).div_(self.num_workers)
        elif op.shards is not None:  # :mod:`~eagerloco.comm.reduce_scatter`: an all-to-all, then an all-gather
            mean = op.shards.exchange(op.payload, self._scatter, self._gather)
        else:
            payloads = list(self._gather(op.payload).unbind(0))
            mean = mean_of_payloads(codec, payloads, op.numel)
        finish = self.link.schedule(start, op.wire)
        if not EmulatedLink.sleep_until(finish, self._cancel):
            raise RuntimeError("the communicator was closed while this exchange was on the link")
        return mean

    # -- failures -----------------------------------------------------------------------------------

    def _fail(self, seq: int, what: str, cause: BaseException | None) -> None:
        """Turn a transport failure into one PeerError for this and every later operation, naming the workers the
        heartbeats point at; outside elastic mode the group is unusable afterwards (restart from a checkpoint)."""
        if self._error is not None:
            self.exchanges.fail_pending(self._error)
            return
        suspects, notes = self.heartbeat.diagnose(seq, self._members, self.names, self._cancel)
        if suspects:
            who = ", ".join(self.name(w) for w in suspects)
            advice = f"Check the log of {who} for the cause"
        else:
            advice = "Could not tell which worker failed; check every worker's log for the cause"
        msg = f"outer exchange #{seq} on {self.name(self.rank)} failed: {what}"
        if notes:
            msg += ": " + "; ".join(notes)
        msg += (f". {advice}, then restart all workers and resume from the last checkpoint."
                f" (timeout {self.timeout_s:g} s")
        if cause is not None:
            msg += f"; transport error: {describe_exception(cause)}"
        msg += ")"
        err = PeerError(msg, suspects)
        if cause is not None:
            err.__cause__ = cause
        if self._error is None:
            self._error = err
        self.exchanges.fail_pending(self._error)
        self.heartbeat.announce("failed")  # so that the other survivors do not blame this worker

    # -- the elastic side: a membership change (:mod:`eagerloco.comm.elastic`), on the caller's thread -----
    # A failed collective does not fail the handles: the exchange thread parks with it, and the membership
    # re-forms the group and hands the unfinished exchanges back (``exchanges.take_ops``, :meth:`resume`).

    @property
    def broken(self) -> bool:
        """Whether a collective failed and the group must be re-formed (elastic mode)."""
        return self.exchanges.broken is not None

    @property
    def failure(self) -> str:
        """What failed, when broken (elastic mode)."""
        broken = self.exchanges.broken
        return f"exchange #{broken[0]}: {broken[1]}" if broken else ""

    def pause(self, timeout_s: float) -> None:
        """Park the exchange thread between exchanges and drop the reference to the current group, so destroying it
        closes its sockets and survivors blocked in it fail at once; PeerError past timeout_s."""
        self._check_open()
        if not self.exchanges.pause(timeout_s):
            raise PeerError(f"{self.name(self.rank)}: the outer communication thread did not stop within "
                            f"{timeout_s:g} s for a membership change. Restart the run from the last checkpoint.")
        self.group = None

    def recent_result(self, seq: int) -> Result:
        """(numel, flat mean, launch step) of a recently completed exchange, for survivors that did not complete it."""
        result = self.exchanges.recent(seq)
        if result is None:
            raise PeerError(f"{self.name(self.rank)} no longer holds the result of exchange #{seq}; "
                            "restart the run from the last checkpoint")
        return result

    def resume(self, group: dist.ProcessGroup | None, members: list[int], ops: list[Op], epoch: int) -> None:
        """Continue on a new group: rerun the given exchanges there, in order, then the later ones (counted again; the
        emulated link restarts with the same seed and epoch on every member)."""
        assert self.exchanges.parked, "pause() first"
        self.group, self._members = group, list(members)
        self.pos = self._members.index(self.rank)
        self.reset_link(epoch)
        for op in ops:
            if op.codec is not None and op.payload is not None:
                op.wire = wire_bytes(op.payload.numel(), self.num_workers, op.codec.summable)
                self.stats.bytes_sent += op.wire
                self.stats.bytes_received += op.wire
        self.exchanges.resume(ops)

    def reset_link(self, epoch: int) -> None:
        """A fresh emulated link for a membership epoch (same seed and epoch on every member)."""
        self.link = EmulatedLink(self._link_cfg, self._seed + 7919 * epoch)
