"""The Communicator interface: what the outer algorithm sees of the other workers.

The algorithm never knows whether its peers are objects in the same process, processes on one
machine or machines across an ocean. It calls :meth:`Communicator.allreduce_mean` and later
waits on the returned :class:`Handle`. Every implementation encodes the tensors once with the
codec, moves the packed bytes, dequantizes every worker's payload and sums in FP32 in worker
order, so results do not depend on the transport.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from eagerloco.codecs import Codec, Fp32Codec


@dataclass
class WorkerStats:
    """Accounting of one worker's link use and time (seconds on the worker's clock)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    peak_sync_bytes: int = 0  # largest single payload this worker put on the link
    num_syncs: int = 0  # outer syncs launched (eagerloco.metrics.OuterMetrics.outer_syncs)
    compute_s: float = 0.0  # inner forward/backward/optimizer time
    overhead_s: float = 0.0  # outer machinery (encode, decode, outer optimizer) outside the link
    blocked_s: float = 0.0  # waiting for an exchange to land
    drain_s: float = 0.0  # waiting, after the last step, for exchanges still in flight (not training time)
    slow_steps: int = 0  # real clock with a fixed step time: steps whose real compute took longer than it
    quorum_missed: int = 0  # --quorum: its outer windows that missed the exchange they were launched for
    late_merged: int = 0  # --quorum: its windows merged into a later exchange of their fragment
    late_dropped: int = 0  # --quorum: its windows dropped as staler than --max-late-rounds (each logged)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True)
class QuorumRule:
    """When an exchange may close without every worker (docs/algorithms.md, 12.1-12.4): once ``quorum``
    contributions have arrived and ``grace`` seconds have passed since the quorum-th did (None: auto), and how
    many of its fragment's exchanges later a window that missed may still be merged (``max_late``)."""

    quorum: int
    grace: float | None
    max_late: int


@dataclass(frozen=True)
class Window:
    """One worker's contribution to a quorum exchange: the fragment's exchange (named by the inner step it is
    launched at), the inner steps it spans and those the schedule expects of every worker in the window (its
    payload is (M * steps / total) times its outer gradient, section 11's token weight), and the rule."""

    fragment: int
    step: int
    steps: int
    total: int
    rule: QuorumRule


@dataclass(frozen=True)
class Contribution:
    """A window a quorum exchange's mean merged or dropped: whose, launched at which step, of how many steps."""

    worker: int
    step: int
    steps: int


@dataclass(frozen=True)
class QuorumResult:
    """What a quorum exchange that did not merge exactly every worker's window on time with its scheduled steps
    holds (sent with the mean, so that every worker knows where its own window landed).

    Attributes:
        step: the step its own windows were launched at.
        merged: every window its mean holds, on time (``step`` equal) or late, in (step, worker) order; the mean
            is their token-weighted mean, sum_c n_c X_c / sum_c n_c.
        dropped: the late windows it dropped as staler than the rule's bound.
    """

    step: int
    merged: list[Contribution]
    dropped: list[Contribution]
    #: When it closed, on the clock its workers share, and the fastest worker's compute seconds per tick, so that
    #: a late worker knows how far behind the others it is now (None: not known on its clock).
    closes_at: float | None = None
    tick_s: float | None = None

    def state(self) -> dict[str, Any]:
        """As plain lists, for a checkpoint."""
        return {"step": self.step, "merged": [[c.worker, c.step, c.steps] for c in self.merged],
                "dropped": [[c.worker, c.step, c.steps] for c in self.dropped], "closes_at": self.closes_at,
                "tick_s": self.tick_s}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> QuorumResult | None:
        """What :meth:`state` saved (None: no result)."""
        if state is None:
            return None
        return cls(int(state["step"]), [Contribution(*map(int, c)) for c in state["merged"]],
                   [Contribution(*map(int, c)) for c in state["dropped"]], state["closes_at"], state["tick_s"])


def wire_bytes(payload_bytes: int, num_workers: int, summable: bool) -> int:
    """Bytes one worker sends for one exchange of a payload of this size.

    Summable (fp32) payloads use a ring all-reduce: 2(M-1)/M of the payload. Quantized payloads
    are all-gathered so that the sum stays in FP32: each worker sends (M-1) payloads' worth on a
    ring. One worker alone sends nothing.
    """
    if num_workers <= 1:
        return 0
    if summable:
        return (2 * (num_workers - 1) * payload_bytes + num_workers - 1) // num_workers
    return (num_workers - 1) * payload_bytes


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One contiguous FP32 vector holding all tensors (the unit a codec encodes); in out if given."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors], out=out)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[i : i + n].view(t.shape))
        i += n
    return out


def hand_over(mean: list[torch.Tensor], out: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """What Handle.wait returns: copies of mean the caller owns, in out when given."""
    if out is None:
        return [t.clone() for t in mean]
    if len(out) != len(mean):
        raise ValueError(f"wait(out=...) needs {len(mean)} tensors, got {len(out)}")
    for o, m in zip(out, mean, strict=True):
        o.copy_(m.view(o.shape))
    return out


def decoder(codec: Codec) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """How a payload of this codec becomes its FP32 values: FP32 payloads are read in place (a view, no copy)."""
    return codec.values if isinstance(codec, Fp32Codec) else codec.unpack


def mean_of_payloads(codec: Codec, payloads: list[torch.Tensor], numel: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize every worker's payload and sum in FP32 in worker order, then divide by M.

    out: an FP32 vector of numel values to write the mean into (reused memory) instead of a new one.
    """
    # The FP32 payloads are the values: they are read in place instead of decoded into copies. The
    # sum starts from the first two payloads (into fresh memory, or out) instead of from zeros: the
    # same bits (0 + x == x) with one pass less; the division happens in place.
    decode = decoder(codec)
    vals = (decode(buf, numel) for buf in payloads)  # decoded one by one, not all at once
    total = next(vals)
    if len(payloads) > 1:
        total = torch.add(total, next(vals), out=out)
    elif out is not None:
        total = out.copy_(total)
    elif isinstance(codec, Fp32Codec):
        total = total.clone()  # a view of the payload: the mean must be fresh memory
    for v in vals:
        total += v
    return total.div_(len(payloads))


def encode(codec: Codec, flat: torch.Tensor, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, own): the packed payload of a flat FP32 vector and its values as the others decode them.

    flat must be the caller's private copy (as :func:`flatten` makes). FP32 is its own encoding: the
    payload is flat's bytes and own is flat itself, with no copies; nothing writes to either.
    """
    if isinstance(codec, Fp32Codec) and flat.dtype == torch.float32 and flat.is_contiguous():
        return flat.view(torch.uint8), flat
    payload = codec.pack(flat, generator)
    return payload, codec.unpack(payload, flat.numel())


class Handle(ABC):
    """An exchange in flight. Wait on every handle exactly once (no fire-and-forget)."""

    #: This worker's contribution as the others receive it (dequantized), same shapes as the input.
    own: list[torch.Tensor]
    #: Size of this worker's encoded payload in bytes.
    payload_bytes: int
    #: The worker ids whose payloads the mean holds, once it has landed, where the runtime knows them (an
    #: elastic group may run an exchange again among the survivors of a change); None: every worker.
    contributors: list[int] | None = None
    #: A quorum exchange (launched with a :class:`Window`) that did not merge exactly every worker's window on
    #: time with its scheduled steps, once it has landed: which windows its mean holds and which it dropped.
    #: None: every worker's, as without a quorum.
    quorum: QuorumResult | None = None

    @abstractmethod
    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Block until the exchange has landed; return the FP32 mean, shaped like the input.

        The tensors are the caller's: fresh memory that nothing else holds, so the caller may write
        into them (an optimizer given them as gradients does). Passing out avoids the allocation,
        which matters for an exchange every step (data-parallel gradients).

        Args:
            out: tensors shaped like the input (any float dtype) to copy the mean into.

        Returns:
            The mean over the workers, one tensor per input tensor: out itself when given.

        Raises:
            PeerError: another worker died, hung or left before the exchange completed (real
                transports); the run cannot go on without re-forming the group.
            ScheduleMismatchError: the workers launched different exchanges at this position.
            RuntimeError: the handle was already waited on (wait exactly once).
            ValueError: out holds a different number of tensors than the input.
        """

    @abstractmethod
    def done(self) -> bool:
        """Whether :meth:`wait` would return without blocking.

        Returns:
            True once the result is there (or the exchange has failed: wait then raises). It is
            advisory: algorithms must not branch on it, since workers may see different answers.
        """

    def checkpoint_result(self) -> tuple[list[torch.Tensor], float | None]:
        """The mean, for a checkpoint, and the clock time it lands at (None: already landed).

        The default waits; a runtime with a simulated clock returns the result without moving
        the clock, so checkpointing does not change the run's accounting.
        """
        return self.wait(), None


class OpHandle(Protocol):
    """What a runtime's queue of operations needs of an operation's handle: its number in launch
    order, and a way to land it (once; later calls are ignored)."""

    seq: int
    #: The worker ids whose payloads the mean holds (:attr:`Handle.contributors`), set before it lands.
    contributors: list[int] | None

    def finish(self, mean: torch.Tensor | None = None, error: BaseException | None = None,
               done: object = None) -> None:
        """Land the operation: its flat FP32 mean (None for one without a result), or the error
        its wait raises; done: what the mean is ready after (a CUDA event), if anything."""


class ReadyHandle(Handle):
    """An exchange whose result is already known: restored from a checkpoint, or snapshotted for one."""

    def __init__(
        self, comm: Communicator, mean: list[torch.Tensor], own: list[torch.Tensor], payload_bytes: int,
        ready_at: float | None, contributors: list[int] | None = None, quorum: QuorumResult | None = None,
    ) -> None:
        self._comm, self._mean, self._ready_at = comm, mean, ready_at
        self.quorum = quorum
        self.own = own
        self.payload_bytes = payload_bytes
        self.contributors = None if contributors is None else [int(w) for w in contributors]

    def done(self) -> bool:
        return self._ready_at is None or self._ready_at <= self._comm.clock()

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if self._ready_at is not None:
            self._comm.wait_until(self._ready_at)
        return hand_over(self._mean, out)

    def checkpoint_result(self) -> tuple[list[torch.Tensor], float | None]:
        return self._mean, self._ready_at


class Communicator(ABC):
    """One worker's view of the outer group."""

    rank: int
    num_workers: int
    stats: WorkerStats
    #: True when clock() is simulated (in-process runtime) rather than real wall time.
    simulated_clock: bool = False
    #: True when workers may leave and rejoin during the run (``--elastic``): ``members`` then names the
    #: workers present, and a handle's ``contributors`` the workers whose payloads its mean holds.
    elastic: bool = False
    #: True when exchanges launched with a ``window`` may close on a quorum (:class:`QuorumRule`).
    closes_on_quorum: bool = False

    @property
    def members(self) -> list[int]:
        """The worker id of each worker of the current group, in group order (0..M-1 unless elastic)."""
        return list(range(self.num_workers))

    @abstractmethod
    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False, transport: str = "allgather", window: Window | None = None,
    ) -> Handle:
        """Start averaging tensors over the workers (background); returns at once.

        The tensors are encoded before this returns, so the caller may change them afterwards.
        Every worker must launch the same exchanges (same sizes and codec) in the same order.

        Args:
            tensors: this worker's contribution (any shapes and float dtypes; summed in FP32).
            codec: how the payload is encoded on the link (its byte size is what is accounted).
            generator: drives stochastic rounding, where the codec uses it.
            keep_own: False when the caller will not read ``handle.own`` (it is then empty), which
                lets a runtime reuse the payload's memory once the exchange is done (data-parallel
                gradients, every step).
            agreed: :meth:`agree` returned True for the schedule this exchange belongs to, so every
                worker launches this same exchange now and a runtime may skip its own per-exchange
                check.
            transport: how a quantized dense payload moves (``OuterConfig.transport``): ``allgather``
                (exact FP32 sums of the payloads) or ``reduce-scatter`` (about two payloads per worker
                whatever M, one more rounding: :mod:`eagerloco.comm.reduce_scatter`). FP32 and sparse
                payloads ignore it; a runtime that cannot shard (elastic) refuses it.
            window: an outer window of a quorum exchange (only where ``closes_on_quorum``): the exchange may
                close without every worker's window by its rule, and a window that missed it is merged into
                the fragment's next one or dropped; ``Handle.quorum`` then says which.

        Returns:
            A :class:`Handle` to wait on exactly once; ``handle.own`` is this worker's contribution
            as the others decode it.

        Raises:
            PeerError: the group already failed (a real transport raises on every call after a
                failure); failures of this exchange itself surface at :meth:`Handle.wait`.
            RuntimeError: the communicator is closed.
        """

    def clock(self) -> float:
        """Seconds on this worker's clock: real wall time here, simulated time in-process."""
        return time.perf_counter()

    def add_compute(self, seconds: float) -> None:
        """Record inner-loop compute time (advances a simulated clock)."""
        self.stats.compute_s += seconds

    def add_overhead(self, seconds: float) -> None:
        """Record outer-machinery time spent outside the link (advances a simulated clock)."""
        self.stats.overhead_s += seconds

    def set_clock(self, t: float) -> None:  # noqa: B027 - a real clock cannot be set
        """Set a simulated clock (restoring a checkpoint, rewinding the end-of-run drain)."""

    def wait_until(self, t: float) -> None:  # noqa: B027 - only simulated clocks need it
        """Block (on a simulated clock) until time t, counting the wait as blocked time."""

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """Check once that every worker runs the same exchange schedule; say whether exchanges of it
        may then be launched with ``agreed=True``.

        Every worker must call it at the same point of its exchange sequence (it is an exchange).

        Args:
            schedule: a digest of everything that decides which exchanges are launched when
                (method, fragment sizes, codec, step, ...).
            describe: the same in words, for the error message.

        Returns:
            True when the workers agreed and this runtime will skip its per-exchange check for
            exchanges launched with ``agreed=True``; False where there is nothing to skip (the
            default, and a runtime that keeps its checks anyway).

        Raises:
            ScheduleMismatchError: the workers' digests differ.
            PeerError: another worker died, hung or left during the agreement.
        """
        return False

    def barrier(self) -> None:  # noqa: B027 - optional for implementations without peers
        """Wait for every worker (used at start and end of a run), in order with the exchanges
        launched before it.

        Raises:
            PeerError: another worker died, hung or left before reaching the barrier.
        """

    def close(self, cancel: bool = False) -> None:  # noqa: B027 - nothing to release by default
        """Release resources (threads, connections); closing twice is harmless.

        Every implementation takes the same arguments: the trainer closes whichever one it has
        with ``close(cancel=True)`` after a peer failure.

        Args:
            cancel: drop exchanges still queued instead of running them first (after a failure,
                when the peers no longer expect them). Implementations without a queue ignore it.
        """
