"""The torch.distributed transport: one worker per process, exchanges in a background thread.

Process layout. M workers of R ranks each (``WORLD_SIZE = M * R``, global rank ``w * R + r``). The
R ranks of worker w form its *inner group* (ordinary data parallelism, fast interconnect); the first
rank of every worker forms the *outer group*, the slow link the outer algorithm crosses. Only the
outer ranks own a :class:`TorchDistCommunicator`; they share the outer result with their inner group.
With sharded workers (FSDP, ``sharded_outer``) there are R outer groups instead, the i-th of the
i-th rank of every worker, and every rank exchanges its own shard.

Exchange. ``allreduce_mean`` encodes once on the caller's thread, then a single communication thread
per worker runs the exchanges in launch order: a 40-byte header all-gather (launch time, sequence
number, size, codec) that checks every worker launched the same exchange, then the payload moves,
then a sleep until the emulated slow link could have carried it (:mod:`emulated_link`). Quantized
payloads are all-gathered packed and each worker dequantizes and sums them in FP32 in worker order
(:func:`base.mean_of_payloads`, bit for bit the in-process runtime's result). FP32 payloads are
summed by one all-reduce: for M = 2 that is bit for bit the same sum, beyond that it differs only
in the ring's summation order (last-bit rounding), and it moves 2(M-1)/M payloads per worker
instead of M-1. So the byte accounting of :func:`base.wire_bytes` (a ring all-reduce for fp32, a
ring all-gather otherwise) is what the transport moves. The header is bookkeeping of this
emulation and is not counted. On a real (not emulated) link it is also a round trip before every
payload, so a caller whose exchanges follow a fixed schedule (OuterSync) agrees on that schedule
once (:meth:`TorchDistCommunicator.agree`: a digest of method, fragment sizes, codec and step) and
launches its exchanges with ``agreed=True``, which skip the header; elastic mode and an emulated
link keep it (reruns are matched by sequence number; the link schedule starts from launch times).

Why a thread and not ``async_op=True``: the emulated link delay must also run in the background,
and one FIFO thread gives the one-transfer-at-a-time link for free. gloo collectives and sleeps
release the GIL, so compute on the main thread continues.

Failures. A peer that dies closes its sockets and gloo fails the collective at once; a peer that
hangs makes it fail at the process-group timeout. Either becomes :class:`PeerError` on every
waiting handle and on every later call (the group is unusable afterwards: restart from a
checkpoint). ``wait()`` has its own backstop (timeout + slack of no progress) in case the backend
never returns. To name the culprit, every outer rank's heartbeat thread writes ``hb/<worker>`` =
(wall time, last exchange entered, state) to the rendezvous TCPStore; on failure the survivors
report the workers whose heartbeat went stale, that closed their communicator, or (failing that)
that never reached the failed exchange.

Elastic mode (``elastic=True``, driven by :mod:`eagerloco.comm.elastic`). A failed collective
does not fail the handles: the communication thread parks with the failed exchange kept, the
caller's thread notices (at its next wait, or at a step boundary through ``broken``) and runs the
membership protocol, which re-forms the group among the survivors and hands the unfinished
exchanges back (:meth:`TorchDistCommunicator.take_jobs`, :meth:`~TorchDistCommunicator.resume`) to
be run again on the new group. ``rank`` stays the worker id (it names seeds, shards and files);
the position in the current group is separate.

Threads. With several processes on few cores, each process should use
``cores // processes_on_this_host`` intra-op threads (1 on a 2-core machine with 2+ processes),
else they oversubscribe the cores; :func:`set_worker_threads` does that.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.codecs import CODEC_NAMES, Codec
from eagerloco.comm.base import (
    Communicator,
    Handle,
    WorkerStats,
    encode,
    flatten,
    hand_over,
    mean_of_payloads,
    unflatten,
    wire_bytes,
)
from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.config import ConfigError, LinkConfig

DEFAULT_TIMEOUT_S = 300.0
#: How often each outer rank refreshes its heartbeat in the store.
HEARTBEAT_S = 1.0
#: Extra time the waiting thread grants beyond the collective timeout before it gives up on its own
#: (gloo normally raises at the timeout; this is the backstop if it does not).
_WAIT_SLACK_S = 10.0
_POLL_S = 0.25
_HEADER_FIELDS = 5  # launch wall time, sequence number, numel, payload bytes, codec id
_BARRIER = -1  # numel marking a barrier in the header
_AGREE = -2  # numel marking a schedule agreement (its payload: the schedule's digest)
_PAUSE = object()  # queue marker: park the communication thread (elastic membership change)
_RECENT = 8  # completed results kept for survivors that did not see them complete


class PeerError(RuntimeError):
    """Another worker died, hung or left: the exchange cannot complete.

    ``workers`` lists the outer-group indices of the workers held responsible (may be empty when
    no heartbeat information is available).
    """

    def __init__(self, message: str, workers: list[int] | None = None) -> None:
        super().__init__(message)
        self.workers = list(workers or [])


class ScheduleMismatchError(RuntimeError):
    """Workers launched different exchanges at the same position (a bug in the caller's schedule)."""


def _short(e: BaseException) -> str:
    """The gist of a backend error: first sentence, without the source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:200]


class _TransportError(Exception):
    """A collective failed (peer gone, timeout); wraps the backend's exception."""


# all_gather_single is the current name; older releases only have all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------------
# Process groups


@dataclass
class DistContext:
    """Where this process sits: its worker, its rank in that worker, and the groups it uses."""

    rank: int  # global rank
    world_size: int
    worker: int  # index of this process's worker (= its rank in the outer group, if a member)
    rank_in_worker: int
    workers: int
    ranks_per_worker: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float
    #: The R ranks of this worker; None when R == 1 (nothing to average inside the worker).
    inner_group: dist.ProcessGroup | None = None
    #: The group this rank exchanges outer gradients in: one rank per worker (each worker's first),
    #: None on the other ranks; with ``sharded_outer`` every rank has one (the i-th rank of every worker).
    outer_group: dist.ProcessGroup | None = None
    #: Client of the rendezvous store for heartbeats (None if it could not be reached).
    store: dist.Store | None = field(default=None, repr=False)
    #: Every rank exchanges its own shard of the outer gradient (FSDP inside the worker): R outer
    #: groups side by side, each carrying 1/R of the payload.
    sharded_outer: bool = False

    @property
    def is_outer_rank(self) -> bool:
        """Whether this rank talks to the other workers (the first rank of its worker, or every rank
        when the exchange is sharded)."""
        return self.sharded_outer or self.rank_in_worker == 0

    @property
    def outer_ranks(self) -> list[int]:
        """The global ranks of this rank's outer group."""
        i = self.rank_in_worker if self.sharded_outer else 0
        return [w * self.ranks_per_worker + i for w in range(self.workers)]

    @property
    def inner_ranks(self) -> list[int]:
        first = self.worker * self.ranks_per_worker
        return list(range(first, first + self.ranks_per_worker))

    def worker_names(self) -> dict[int, str]:
        """How errors name each worker (with the global rank whose log to read)."""
        r = self.ranks_per_worker
        if r == 1:
            return {w: f"worker {w}" for w in range(self.workers)}
        return {w: f"worker {w} (global rank {g})" for w, g in enumerate(self.outer_ranks)}


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"environment variable {name} must be an integer, got {value!r}") from e


def workers_from_env() -> tuple[int, int] | None:
    """(workers, ranks_per_worker) as set by ``eagerloco launch``, or None under plain torchrun."""
    m, r = _env_int("EAGERLOCO_WORKERS"), _env_int("EAGERLOCO_RANKS_PER_WORKER")
    return None if m is None else (m, r or 1)


def set_worker_threads() -> int:
    """Give this process its share of the cores as intra-op threads; returns the count.

    Several processes on one host each defaulting to all cores oversubscribe them (on a 2-core
    machine 4 processes x 2 threads run slower than 4 x 1). Call before building the model.
    """
    local = _env_int("LOCAL_WORLD_SIZE") or 1
    n = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(n)
    return n


def init_process_groups(
    workers: int,
    ranks_per_worker: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    outer_backend: str | None = "gloo",
    sharded_outer: bool = False,
) -> DistContext:
    """Join the run started by torchrun or ``eagerloco launch`` and build the inner and outer groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. backend: "nccl" when CUDA is
    available, else "gloo". The outer group uses gloo by default even on GPUs: the outer payload is
    decoded and summed on the CPU anyway, it is small and rare next to inner traffic, and gloo
    reports a dead peer as an exception where NCCL's watchdog would abort the process; pass
    ``outer_backend=None`` to use the main backend.

    sharded_outer: instead of one outer group of the workers' first ranks, R outer groups, the i-th
    of the i-th rank of every worker, so that every rank exchanges its own shard (FSDP).

    Every rank creates every group, in the same order (torch.distributed requires it).
    """
    for name, value in (("workers", workers), ("ranks_per_worker", ranks_per_worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if not (timeout_s > 0):
        raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None:
        raise ConfigError(
            "RANK and WORLD_SIZE are not set: start the processes with `eagerloco launch --workers M "
            "[--ranks-per-worker R] -- <train args>` or "
            "`torchrun --nproc-per-node M*R -m eagerloco train ...`"
        )
    expected = workers * ranks_per_worker
    if world != expected:
        raise ConfigError(
            f"--workers {workers} x --ranks-per-worker {ranks_per_worker} needs {expected} processes, but "
            f"WORLD_SIZE is {world}: start {expected} processes (torchrun --nproc-per-node {expected}) or "
            f"set --workers/--ranks-per-worker so that their product is {world}"
        )
    local_rank = _env_int("LOCAL_RANK") or 0
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA, which is not available here; use --backend gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError("torch.distributed is already initialized with a different rank or world size")

    r = ranks_per_worker
    worker, rank_in_worker = divmod(rank, r)
    inner = None
    if r > 1:
        for w in range(workers):  # every rank creates every inner group, in order
            g = dist.new_group(list(range(w * r, w * r + r)), timeout=timeout)
            if w == worker:
                inner = g
    outer = None
    for i in range(r if sharded_outer else 1):  # every rank creates every outer group, in order
        g = dist.new_group([w * r + i for w in range(workers)], timeout=timeout, backend=outer_backend or backend)
        if i == rank_in_worker:
            outer = g
    ctx = DistContext(
        rank=rank, world_size=world, worker=worker, rank_in_worker=rank_in_worker, workers=workers,
        ranks_per_worker=r, local_rank=local_rank, device=device, backend=backend, timeout_s=timeout_s,
        inner_group=inner, outer_group=outer, sharded_outer=sharded_outer,
    )
    ctx.store = _heartbeat_store(timeout_s) if ctx.is_outer_rank else None
    return ctx


def _heartbeat_store(timeout_s: float) -> dist.Store | None:
    """A client connection of our own to the rendezvous store, with a short timeout for diagnosis."""
    host, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if not host or port is None:
        return None
    try:
        client = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=min(timeout_s, 30.0)),
            wait_for_workers=False,
        )
    except Exception as e:  # heartbeats only improve error messages; the run works without them
        warnings.warn(f"no heartbeat store at {host}:{port} ({e}); peer errors will not name the worker",
                      stacklevel=2)
        return None
    return dist.PrefixStore("eagerloco/outer/", client)


def shutdown() -> None:
    """Tear down torch.distributed at the end of a run (avoids the at-exit warning)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Communicator


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
        self._error: BaseException | None = None
        self._waited = False

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, out: list[torch.Tensor] | None = None, timeout: float | None = None) -> list[torch.Tensor]:
        """Block until the exchange landed; the time spent here is added to stats.blocked_s.

        timeout: seconds to wait at most (then :class:`PeerError`). By default the wait lasts as long
        as the exchanges ahead make progress, and gives up once one collective has been stuck for
        the communicator's timeout (plus slack).
        """
        if self._waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        self._waited = True
        self._comm._unwaited.discard(self.seq)
        t0 = time.perf_counter()
        try:
            self._comm._await(self, timeout)
        finally:
            self._comm.stats.blocked_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        assert self._mean is not None
        mean, self._mean = self._mean, None
        if out is not None:
            return hand_over(unflatten(mean, self._like), out)
        # The caller owns what it gets (an optimizer may write into it). In elastic mode the
        # communicator also keeps the mean for survivors of a membership change: hand out a copy.
        return unflatten(mean.to(self._device, copy=self._comm._elastic), self._like)

    def _finish(self, mean: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._mean, self._error = mean, error
            self._event.set()


@dataclass
class _Job:
    seq: int
    numel: int  # _BARRIER for a barrier
    launch_wall: float
    handle: TorchDistHandle
    codec: Codec | None = None
    payload: torch.Tensor | None = None
    wire: int = 0
    step: int = 0  # training step at launch (what a lost worker's progress is measured from)
    inplace: bool = False  # the FP32 sum may overwrite the payload (nothing reads it afterwards)
    #: Agree on the header first. False for the exchanges of a schedule every worker agreed on
    #: (:meth:`TorchDistCommunicator.agree`): their sizes are known to match, so the payload moves at once.
    checked: bool = True
    note: str = ""  # _AGREE: this worker's schedule in words, for the error


class TorchDistCommunicator(Communicator):
    """One worker's view of the outer group over torch.distributed (one worker per process).

    group: the outer ProcessGroup (None: the default group). link: the slow link to emulate
    (default: none beyond the real one). timeout_s: how long one collective may wait for peers.
    names: how error messages call each worker (outer-group rank -> name). store: where heartbeats
    go (None: no heartbeats, errors cannot name the dead worker). seed: jitter RNG, the same on all
    workers so that they agree on the link schedule. elastic: park on a failed collective instead
    of failing (see the module docstring). members: the worker id of each group rank (default:
    rank r is worker r); ``rank`` is this process's worker id. channel: which of its worker's outer
    exchanges this is when each rank exchanges a shard (its rank in the worker); heartbeats are kept
    per channel, and errors name the same worker whichever channel fails.
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
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_groups first")
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not in the outer group: only the first rank of each worker "
                             "exchanges with the other workers")
        self.group = group
        pos, size = dist.get_rank(group), dist.get_world_size(group)
        self._members = list(members) if members is not None else list(range(size))
        if len(self._members) != size:
            raise ValueError(f"members {self._members} do not match the group's size {size}")
        self._pos = pos  # this worker's rank in the current group
        self.rank = self._members[pos]  # worker id: stable across membership changes
        self.num_workers = size
        self.stats = WorkerStats()
        self._link_cfg, self._seed = link, seed
        self.link = EmulatedLink(link, seed)
        self._elastic = elastic
        #: Called on the caller's thread when it finds the group broken (elastic); re-forms it.
        self.recover_hook: Any = None
        #: Training step, published with the heartbeat (what a lost worker had done).
        self.step_hint = 0
        self._broken: tuple[int, str] | None = None  # (exchange, what failed): text, no traceback
        self._parked = threading.Event()
        self._resume_ev = threading.Event()
        self._parked_job: _Job | None = None
        self._done_upto = 0  # last exchange completed here (they complete in order)
        self._recent: dict[int, tuple[int, torch.Tensor | None, int]] = {}  # seq -> (numel, flat mean, step)
        self.timeout_s = float(timeout_s)
        self._names = dict(names or {})
        self._store = store
        self._heartbeat_s = heartbeat_s
        self._channel = channel
        self._stale_s = max(3 * heartbeat_s, 2.0)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._agreed = False  # agree() succeeded: exchanges launched with agreed=True skip the header
        self._pending: dict[int, TorchDistHandle] = {}  # not finished yet
        self._unwaited: set[int] = set()  # launched exchanges nobody waited on (yet)
        self._pending_lock = threading.Lock()
        self._launched = 0  # operations launched (caller's thread)
        self._entered = 0  # last operation the communication thread entered (published)
        self._in_collective_since: float | None = None  # monotonic time, while inside a collective
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._closed = False
        self._hb_lock = threading.Lock()
        self._state = "up"
        self._thread = threading.Thread(target=self._run, name=f"eagerloco-outer-w{self.rank}", daemon=True)
        self._thread.start()
        self._hb_stop = threading.Event()
        self._hb_wake = threading.Event()
        self._hb_thread: threading.Thread | None = None
        if store is not None:
            self._publish()
            self._hb_thread = threading.Thread(target=self._heartbeat, name="eagerloco-hb", daemon=True)
            self._hb_thread.start()

    @classmethod
    def from_context(
        cls, ctx: DistContext, link: LinkConfig | None = None, **kwargs: Any
    ) -> TorchDistCommunicator:
        """The communicator of an outer rank, with the context's timeout, worker names and store."""
        if not ctx.is_outer_rank:
            raise ValueError(
                f"global rank {ctx.rank} is not its worker's first rank and has no outer communicator"
            )
        kwargs.setdefault("timeout_s", ctx.timeout_s)
        kwargs.setdefault("names", ctx.worker_names())
        kwargs.setdefault("store", ctx.store)
        return cls(ctx.outer_group, link, **kwargs)

    def __enter__(self) -> TorchDistCommunicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc is not None)

    # -- the Communicator interface ----------------------------------------------------------------

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False,
    ) -> TorchDistHandle:
        self._check_open()
        flat = flatten(tensors)
        numel = flat.numel()
        packed, own_flat = encode(codec, flat, generator)
        nbytes = packed.numel()
        packed = packed.cpu()  # gloo and mean_of_payloads work on the CPU
        wire = wire_bytes(nbytes, self.num_workers, codec.summable)
        st = self.stats
        st.bytes_sent += wire  # ring all-reduce / all-gather: as many bytes in as out
        st.bytes_received += wire
        st.peak_sync_bytes = max(st.peak_sync_bytes, nbytes)
        st.num_syncs += 1
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        handle = self._enqueue(numel, like, device, own=unflatten(own_flat, like) if keep_own else [], nbytes=nbytes)
        self._unwaited.add(handle.seq)
        # Without keep_own the payload is the communicator's alone; outside elastic mode a failed
        # collective ends the run, so no rerun needs it intact either.
        job = _Job(handle.seq, numel, time.time(), handle, codec, packed, wire, self.step_hint,
                   inplace=not keep_own and not self._elastic, checked=not (agreed and self._agreed))
        self._jobs.put(job)
        return handle

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """Check with the other workers that they all run the schedule digested in ``schedule``.

        Every exchange normally starts with a header round trip (sizes, codec and sequence agreed
        before the payload moves: gloo aborts or corrupts on mismatched sizes). On a real link that
        is one more latency per exchange, on the critical path of every blocking sync. A caller whose
        exchanges follow from a schedule (OuterSync: method, fragment sizes, codec, step) agrees on
        it once here; its exchanges launched with ``agreed=True`` then skip the header.

        Returns False, without talking to anyone, where the header is needed anyway: in elastic
        mode (membership changes rerun exchanges by their sequence) and on an emulated link (the
        header carries the launch times the link schedule starts from).
        """
        self._check_open()
        if self._elastic or not self.link.trivial:
            return False
        digest = torch.frombuffer(bytearray(hashlib.sha256(schedule).digest()), dtype=torch.uint8)
        self._control(_AGREE, digest, describe)
        self._agreed = True
        return True

    def barrier(self) -> None:
        """Wait until every worker reached this point (in order with the exchanges launched before)."""
        self._check_open()
        self._control(_BARRIER)

    def _control(self, kind: int, payload: torch.Tensor | None = None, note: str = "") -> None:
        """Run a barrier or an agreement in order with the exchanges launched before, and wait for it."""
        handle = self._enqueue(kind, [], torch.device("cpu"), own=[], nbytes=0 if payload is None else payload.numel())
        self._jobs.put(_Job(handle.seq, kind, time.time(), handle, payload=payload, step=self.step_hint, note=note))
        self._await(handle, None)
        handle._waited = True
        if handle._error is not None:
            raise handle._error

    def close(self, cancel: bool = False) -> None:
        """Stop the communication thread.

        By default exchanges still queued run first (the peers expect them); cancel=True (or after
        an error) drops them and interrupts the link emulation. Waits at most the timeout.
        """
        if self._closed:
            return
        self._closed = True
        if cancel or self._error is not None:
            self._cancel.set()
        self._jobs.put(None)
        self._resume_ev.set()  # a parked thread (elastic) leaves as well
        self._thread.join(timeout=1.0 if self._cancel.is_set() else self.timeout_s + _WAIT_SLACK_S)
        if self._thread.is_alive():
            warnings.warn("the outer communication thread is still inside a collective; abandoning it",
                          stacklevel=2)
        if self._unwaited and self._error is None and not cancel:
            warnings.warn(
                f"{len(self._unwaited)} exchange(s) were never waited on; wait on every handle", stacklevel=2
            )
        if self._hb_thread is not None:
            self._hb_stop.set()
            self._hb_wake.set()
            self._hb_thread.join(timeout=2.0)
            # "failed": gave up because of a peer (others must not blame it); "closed": left on its own.
            self._publish("failed" if isinstance(self._error, PeerError) else "closed")

    # -- caller's side ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this communicator is closed")
        if self._error is not None:
            raise self._error

    def _enqueue(self, numel: int, like: list[torch.Tensor], device: torch.device, own: list[torch.Tensor],
                 nbytes: int) -> TorchDistHandle:
        self._launched += 1
        handle = TorchDistHandle(self, self._launched, own, nbytes, like, device)
        with self._pending_lock:
            self._pending[handle.seq] = handle
        return handle

    def _await(self, handle: TorchDistHandle, timeout: float | None) -> None:
        """Wait for the handle; give up when the transport stopped making progress."""
        start = time.monotonic()
        limit = self.timeout_s + _WAIT_SLACK_S
        while not handle._event.wait(_POLL_S if timeout is None else min(_POLL_S, max(timeout, 0.0))):
            if self._broken is not None and self.recover_hook is not None:
                self.recover_hook()  # re-forms the group; this exchange then lands or runs again
                start = time.monotonic()
                continue
            waited = time.monotonic() - start
            since = self._in_collective_since
            stuck = 0.0 if since is None else time.monotonic() - since
            if timeout is not None and waited >= timeout:
                self._fail(handle.seq, f"no result after waiting {waited:.1f} s (wait timeout)", None)
            elif stuck >= limit:
                self._fail(handle.seq, f"a collective made no progress for {stuck:.1f} s", None)
            elif not self._thread.is_alive():
                self._fail(handle.seq, "the communication thread stopped", None)

    # -- communication thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job is _PAUSE:
                self._park(None)
                continue
            broken = False
            try:
                if self._error is not None:
                    raise self._error
                if self._cancel.is_set():
                    raise RuntimeError("the communicator was closed before this exchange ran")
                mean = self._execute(job)
            except _TransportError as e:  # a peer is gone or hung
                self._in_collective_since = None
                if self._elastic and not self._cancel.is_set():
                    # Keep text only: the exception's traceback would keep the broken group (and its
                    # sockets, which the other survivors wait on) alive.
                    self._broken = (job.seq, _short(e.__cause__ or e))
                    broken = True
                else:
                    self._fail(job.seq, "the collective failed", e.__cause__)
            except Exception as e:  # a schedule mismatch or a local bug: report it as is
                if self._error is None:
                    self._error = e
                self._fail_pending(self._error)
            else:
                self._done_upto = job.seq
                # Elastic mode keeps recent means for survivors that missed them; they are then
                # shared, so wait() hands out copies. Otherwise the mean is the handle's alone.
                self._recent[job.seq] = (job.numel, mean if self._elastic else None, job.step)
                self._recent.pop(job.seq - _RECENT, None)
                job.handle._finish(mean=mean)
            if broken:
                self._park(job)  # the caller re-forms the group and hands the job back
                continue
            self._in_collective_since = None
            with self._pending_lock:
                self._pending.pop(job.seq, None)

    def _park(self, job: _Job | None) -> None:
        """Stop between exchanges until the caller's thread has re-formed the group (elastic)."""
        self._parked_job = job
        self._parked.set()
        self._resume_ev.wait()
        self._resume_ev.clear()

    # -- elastic membership (called on the caller's thread) ------------------------------------------

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
            self._jobs.put(_PAUSE)
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

    def take_jobs(self) -> list[_Job]:
        """The exchanges not completed here, in launch order (the thread must be parked)."""
        assert self._parked.is_set()
        jobs = [] if self._parked_job is None else [self._parked_job]
        self._parked_job = None
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Job):
                jobs.append(job)
        return sorted(jobs, key=lambda j: j.seq)

    def recent_result(self, seq: int) -> tuple[int, torch.Tensor | None, int]:
        """(numel, flat mean, launch step) of a recently completed exchange, for survivors that did not complete it."""
        if seq not in self._recent:
            raise PeerError(f"{self._name(self.rank)} no longer holds the result of exchange #{seq}; "
                            "restart the run from the last checkpoint")
        return self._recent[seq]

    def complete_from_peer(self, job: _Job, mean: torch.Tensor | None) -> None:
        """Finish an exchange with the result another survivor saw complete (elastic recovery)."""
        self._done_upto = max(self._done_upto, job.seq)
        self._recent[job.seq] = (job.numel, mean, job.step)
        job.handle._finish(mean=mean)
        with self._pending_lock:
            self._pending.pop(job.seq, None)

    def resume(self, group: dist.ProcessGroup | None, members: list[int], jobs: list[_Job], epoch: int,
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
            if job is not _PAUSE:
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

    def _gather(self, buf: torch.Tensor) -> torch.Tensor:
        """All-gather equal-size uint8 buffers; rows in worker order."""
        out = torch.empty(self.num_workers * buf.numel(), dtype=torch.uint8)
        self._in_collective_since = time.monotonic()
        try:
            _all_gather(out, buf, group=self.group)
        except Exception as e:
            raise _TransportError(str(e)) from e
        self._in_collective_since = None
        return out.view(self.num_workers, buf.numel())

    def _sum(self, buf: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) an FP32 buffer in place: half the bytes of an all-gather beyond M = 2."""
        self._in_collective_since = time.monotonic()
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        except Exception as e:
            raise _TransportError(str(e)) from e
        self._in_collective_since = None
        return buf

    def _execute(self, job: _Job) -> torch.Tensor | None:
        self._entered = job.seq
        self._announce()
        codec = job.codec
        start = job.launch_wall
        if job.checked:
            nbytes = 0 if job.payload is None else job.payload.numel()
            codec_id = CODEC_NAMES.index(codec.name) if codec is not None and codec.name in CODEC_NAMES else -1
            header = torch.tensor([job.launch_wall, job.seq, job.numel, nbytes, codec_id], dtype=torch.float64)
            # The header goes first, alone: gloo aborts the process (or silently corrupts) when ranks
            # all-gather buffers of different sizes, so sizes are agreed before the payload moves.
            rows = self._gather(header.view(torch.uint8)).view(torch.float64)
            self._check_headers(job, rows)
            start = float(rows[:, 0].max())
        if job.numel == _BARRIER:
            return None
        if job.numel == _AGREE:
            assert job.payload is not None
            self._check_schedules(job, self._gather(job.payload))
            return None
        assert codec is not None and job.payload is not None
        if codec.summable and self.num_workers > 1:
            # FP32: one all-reduce; on a copy where the payload must stay intact (the caller's own
            # share, or a rerun among the survivors of a failed collective in elastic mode).
            buf = job.payload if job.inplace else job.payload.clone()
            mean = self._sum(buf.view(torch.float32)).div_(self.num_workers)
        else:
            payloads = list(self._gather(job.payload).unbind(0))
            mean = mean_of_payloads(codec, payloads, job.numel)
        finish = self.link.schedule(start, job.wire)
        if not EmulatedLink.sleep_until(finish, self._cancel):
            raise RuntimeError("the communicator was closed while this exchange was on the link")
        return mean

    def _check_headers(self, job: _Job, rows: torch.Tensor) -> None:
        mine = rows[self._pos, 1:]
        if bool((rows[:, 1:] == mine).all()):
            return

        def describe(r: torch.Tensor) -> str:
            seq, numel, nbytes, cid = (int(v) for v in r[1:])
            if numel == _BARRIER:
                return f"exchange #{seq}: barrier"
            if numel == _AGREE:
                return f"exchange #{seq}: schedule agreement"
            name = CODEC_NAMES[cid] if 0 <= cid < len(CODEC_NAMES) else "?"
            return f"exchange #{seq}: {numel} values as {name} ({nbytes} bytes)"

        lines = "; ".join(f"{self._name(w)} {describe(rows[i])}" for i, w in enumerate(self._members))
        raise ScheduleMismatchError(
            f"workers launched different exchanges at the same point: {lines}. Every worker must launch "
            "the same exchanges (same sizes, codec and order); check the fragment schedule and settings"
        )

    def _check_schedules(self, job: _Job, rows: torch.Tensor) -> None:
        mine = rows[self._pos]
        differ = [w for i, w in enumerate(self._members) if not torch.equal(rows[i], mine)]
        if differ:
            names = ", ".join(self._name(w) for w in differ)
            raise ScheduleMismatchError(
                f"{names} run(s) a different exchange schedule from {self._name(self.rank)}'s "
                f"({job.note or 'see its settings'}). Every worker must run the same method, fragments, "
                "codec and model and start from the same step: start them all with the same settings "
                "(and --resume from the same checkpoint)"
            )

    # -- failures and heartbeats --------------------------------------------------------------------

    def _name(self, w: int) -> str:
        return self._names.get(w, f"worker {w}")

    def _fail(self, seq: int, what: str, cause: BaseException | None) -> None:
        """Turn a transport failure into one PeerError for this and every later operation."""
        if self._error is not None:
            self._fail_pending(self._error)
            return
        suspects, notes = self._diagnose(seq)
        if suspects:
            who = ", ".join(self._name(w) for w in suspects)
            advice = f"Check the log of {who} for the cause"
        else:
            advice = "Could not tell which worker failed; check every worker's log for the cause"
        msg = f"outer exchange #{seq} on {self._name(self.rank)} failed: {what}"
        if notes:
            msg += ": " + "; ".join(notes)
        msg += (f". {advice}, then restart all workers and resume from the last checkpoint."
                f" (timeout {self.timeout_s:g} s")
        if cause is not None:
            msg += f"; transport error: {_short(cause)}"
        msg += ")"
        err = PeerError(msg, suspects)
        if cause is not None:
            err.__cause__ = cause
        if self._error is None:
            self._error = err
        self._fail_pending(self._error)
        self._announce("failed")  # so that the other survivors do not blame this worker

    def _fail_pending(self, err: BaseException) -> None:
        with self._pending_lock:
            handles = list(self._pending.values())
        for h in handles:
            h._finish(error=err)

    def _diagnose(self, seq: int) -> tuple[list[int], list[str]]:
        """Which workers look responsible, from their heartbeats.

        Strong evidence (a stale heartbeat, a closed or never started communicator) wins over weak
        (alive but not at this exchange yet: it may just be slower). A worker that died a moment
        ago still has a fresh heartbeat, so weak evidence is only reported after waiting long
        enough for a death to show.
        """
        if self._store is None:
            return [], ["no heartbeat store, so the failed worker is unknown"]
        deadline = time.monotonic() + self._stale_s + self._heartbeat_s
        while True:
            found = self._read_peers(seq)
            if isinstance(found, str):
                return [], [found]
            strong, weak = found
            final = time.monotonic() >= deadline or self._cancel.is_set()
            if strong or final:
                chosen = strong or weak
                return [w for w, _ in chosen], [note for _, note in chosen]
            time.sleep(min(0.2, self._heartbeat_s))

    def _read_peers(self, seq: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]] | str:
        """(strong, weak) suspects with a note each, or why the store could not be read."""
        assert self._store is not None
        strong: list[tuple[int, str]] = []
        weak: list[tuple[int, str]] = []
        now = time.time()
        for w in self._members:
            if w == self.rank:
                continue
            name, key = self._name(w), self._hb_key(w)
            try:
                if not self._store.check([key]):
                    strong.append((w, f"{name} never started its outer communicator"))
                    continue
                stamp, entered, state = self._store.get(key).decode().split()[:3]
            except Exception as e:
                return f"the rendezvous store is unreachable ({str(e).splitlines()[0][:120]})"
            age, last = now - float(stamp), int(entered)
            if state == "failed":  # a fellow survivor that already gave up: not a cause
                continue
            exit_note = self._exit_note(w)
            if exit_note:  # the launcher saw its process end: no need to wait for a stale heartbeat
                strong.append((w, f"{name} is gone: its process {exit_note} (after exchange #{last})"))
            elif state == "closed":
                strong.append((w, f"{name} closed its communicator after exchange #{last} (done or quit)"))
            elif age > self._stale_s:
                note = f"{name} is gone or frozen (last heartbeat {age:.1f} s ago, at exchange #{last})"
                strong.append((w, note))
            elif last < seq:
                weak.append((w, f"{name} has not reached exchange #{seq} (alive, last entered #{last})"))
        return strong, weak

    def _exit_note(self, w: int) -> str:
        """How worker w's process ended, if ``eagerloco launch`` recorded it ('' if not)."""
        assert self._store is not None
        try:
            if not self._store.check([f"exited/{w}"]):
                return ""
            rc = int(self._store.get(f"exited/{w}").decode())
        except Exception:
            return ""
        return f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"

    def _announce(self, state: str | None = None) -> None:
        """Have the heartbeat thread publish now (a new exchange entered, or a new state).

        The communication thread never talks to the store itself: a slow or unreachable store
        must not delay exchanges.
        """
        if state is not None:
            self._state = state
        self._hb_wake.set()

    def _publish(self, state: str | None = None) -> None:
        """Write this worker's heartbeat: time, last exchange entered, state (up, failed, closed)."""
        if self._store is None:
            return
        with self._hb_lock:
            if state is not None:
                self._state = state
            try:
                self._store.set(self._hb_key(self.rank),
                                f"{time.time():.3f} {self._entered} {self._state} {self.step_hint}")
            except Exception:  # the store host may be gone; a diagnosis will say so
                pass

    def _hb_key(self, w: int) -> str:
        return f"hb/{w}" if self._channel == 0 else f"hb/{w}/{self._channel}"

    def _heartbeat(self) -> None:
        while not self._hb_stop.is_set():
            self._hb_wake.wait(self._heartbeat_s)
            self._hb_wake.clear()
            if not self._hb_stop.is_set():
                self._publish()


# --------------------------------------------------------------------------------------------------
# Workers of several ranks


class WorkerCommunicator(Communicator):
    """Every rank of a worker sees the worker's outer exchanges; only the first rank uses the link.

    With R > 1 ranks per worker, all ranks run the same outer algorithm on identical parameters
    (their inner gradients are averaged), so they must apply the same outer means. The first rank
    exchanges with the other workers (its :class:`TorchDistCommunicator`) and, when waited on,
    broadcasts the mean over the inner group; the other ranks receive it. The algorithm must wait
    on handles in the same order on every rank of a worker (the schedule is deterministic; never
    branch on done()). Link bytes are counted on the first rank only.
    """

    def __init__(self, ctx: DistContext, outer: TorchDistCommunicator | None) -> None:
        if ctx.is_outer_rank != (outer is not None):
            raise ValueError("the worker's first rank needs its outer communicator; the other ranks none")
        self.ctx, self.outer = ctx, outer
        self.rank, self.num_workers = ctx.worker, ctx.workers
        self.stats = outer.stats if outer is not None else WorkerStats()
        self._leader = ctx.inner_ranks[0]

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False,
    ) -> _WorkerHandle:
        if self.outer is not None:
            h = self.outer.allreduce_mean(tensors, codec, generator, keep_own=keep_own, agreed=agreed)
            return _WorkerHandle(self, h, h.own, h.payload_bytes, h._like, h._device)
        flat = flatten(tensors)
        packed = codec.pack(flat, generator)  # same generator state as the first rank: same `own`
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        own = unflatten(codec.unpack(packed, flat.numel()), like)
        device = tensors[0].device if tensors else torch.device("cpu")
        return _WorkerHandle(self, None, own, packed.numel(), like, device)

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """The first rank agrees with the other workers; the others have no exchange to check."""
        return self.outer.agree(schedule, describe) if self.outer is not None else False

    def barrier(self) -> None:
        if self.outer is not None:
            self.outer.barrier()
        if self.ctx.inner_group is not None:
            dist.barrier(group=self.ctx.inner_group)

    def close(self) -> None:
        if self.outer is not None:
            self.outer.close()


class _WorkerHandle(Handle):
    def __init__(self, comm: WorkerCommunicator, outer: TorchDistHandle | None, own: list[torch.Tensor],
                 payload_bytes: int, like: list[torch.Tensor], device: torch.device) -> None:
        self._comm, self._outer, self._like, self._device = comm, outer, like, device
        self.own, self.payload_bytes = own, payload_bytes
        self._waited = False

    def done(self) -> bool:
        """Exact on the first rank; the other ranks only know once they waited."""
        return self._waited or (self._outer is not None and self._outer.done())

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """First rank: wait for the exchange, then broadcast; the others: receive the broadcast.

        One extra value travels with the mean: 1 when the exchange failed on the first rank, so
        that the other ranks raise PeerError instead of waiting for a broadcast that never comes.
        """
        if self._waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        self._waited = True
        ctx = self._comm.ctx
        numel = sum(t.numel() for t in self._like)
        bcast_device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        buf = torch.zeros(numel + 1, dtype=torch.float32, device=bcast_device)
        error: BaseException | None = None
        t0 = time.perf_counter()
        if self._outer is not None:
            try:
                mean = self._outer.wait()
                buf[:numel] = flatten(mean).to(bcast_device)
            except BaseException as e:  # tell the other ranks, then raise here
                error = e
                buf[numel] = 1.0
        try:
            dist.broadcast(buf, src=self._comm._leader, group=ctx.inner_group)
        except Exception as e:
            if error is None:
                raise PeerError(
                    f"worker {ctx.worker}'s first rank (global rank {self._comm._leader}) stopped while "
                    f"sharing the outer result ({_short(e)}). Check its log, then restart all workers "
                    "and resume from the last checkpoint.", [ctx.worker]
                ) from e
        if self._outer is None:
            self._comm.stats.blocked_s += time.perf_counter() - t0
        if error is not None:
            raise error
        if buf[numel].item() != 0.0:
            raise PeerError(
                f"the outer exchange failed on worker {ctx.worker}'s first rank (global rank "
                f"{self._comm._leader}); its log names the cause. Restart all workers and resume from "
                "the last checkpoint.", []
            )
        if out is not None:
            return hand_over(unflatten(buf[:numel], self._like), out)
        return [t.to(self._device) for t in unflatten(buf[:numel], self._like)]


def communicator_for(ctx: DistContext, link: LinkConfig | None = None, **kwargs: Any) -> Communicator:
    """The communicator every rank of a run uses: the outer one (R = 1, or every rank exchanging its
    own shard), or a worker-wide one (R > 1, the first rank exchanging for all).

    With sharded exchanges the worker's link is shared by its R ranks: each rank's emulated link
    gets 1/R of the bandwidth, so a worker still moves its whole payload at the link's rate.
    """
    if ctx.sharded_outer:
        share = link
        if link is not None and ctx.ranks_per_worker > 1:
            share = replace(link, bandwidth_gbps=link.bandwidth_gbps / ctx.ranks_per_worker)
        return TorchDistCommunicator.from_context(ctx, share, channel=ctx.rank_in_worker, **kwargs)
    outer = TorchDistCommunicator.from_context(ctx, link, **kwargs) if ctx.is_outer_rank else None
    if ctx.ranks_per_worker == 1:
        assert outer is not None
        return outer
    return WorkerCommunicator(ctx, outer)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistContext",
    "PeerError",
    "ScheduleMismatchError",
    "TorchDistCommunicator",
    "TorchDistHandle",
    "WorkerCommunicator",
    "communicator_for",
    "init_process_groups",
    "set_worker_threads",
    "shutdown",
    "workers_from_env",
]
