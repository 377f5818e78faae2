"""The Communicator interface: what the outer algorithm sees of the other workers.

Every implementation encodes the tensors once with the codec, moves the packed bytes, dequantizes every
worker's payload and sums in FP32 in worker order, so results do not depend on the transport.
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

    def exchanged(self, wire: int, payload: int) -> None:
        """One exchange launched: ``wire`` bytes each way (a ring or a gather carries as many in as out), its
        payload ``payload`` bytes."""
        self.bytes_sent += wire
        self.bytes_received += wire
        self.peak_sync_bytes = max(self.peak_sync_bytes, payload)
        self.num_syncs += 1

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
    """What a quorum exchange that did not merge every worker's window on time holds, sent with the mean so every
    worker knows where its own windows landed: ``merged`` (token-weighted into the mean, in (step, worker) order)
    and ``dropped`` (staler than the rule's bound).
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
    """Bytes one worker sends for one exchange: a ring all-reduce (2(M-1)/M of the payload) for summable fp32
    payloads, an all-gather ((M-1) payloads) for quantized ones so the sum stays FP32; nothing alone."""
    if num_workers <= 1:
        return 0
    if summable:
        return (2 * (num_workers - 1) * payload_bytes + num_workers - 1) // num_workers
    return (num_workers - 1) * payload_bytes


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One contiguous FP32 vector holding all tensors (the unit a codec encodes); in out if given."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors], out=out)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat vector (or its start) shaped like the tensors it was made of (:func:`flatten`'s inverse)."""
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(torch.split(flat[: sum(sizes)], sizes), like, strict=True)]


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
    """Dequantize every worker's payload and sum in FP32 in worker order, then divide by M (into ``out`` if given)."""
    # The FP32 payloads are read in place; the sum starts from the first two payloads instead of zeros
    # (the same bits, 0 + x == x, with one pass less).
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
    """(payload, own): the packed payload of a flat FP32 vector (the caller's private copy) and its values as the
    others decode them; FP32 is its own encoding, with no copies."""
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
        """Block until the exchange has landed; return the FP32 mean, shaped like the input (into ``out`` if given).

        The tensors are fresh memory the caller may write into. Wait exactly once. Raises PeerError when another
        worker died, hung or left (the group must be re-formed), ScheduleMismatchError when the workers launched
        different exchanges at this position.
        """

    @abstractmethod
    def done(self) -> bool:
        """Whether :meth:`wait` would return without blocking; advisory (workers may see different answers)."""

    def checkpoint_result(self) -> tuple[list[torch.Tensor], float | None]:
        """The mean for a checkpoint and the clock time it lands at (None: landed); a simulated clock is not moved."""
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
        """Start averaging tensors over the workers (background); returns at once with a :class:`Handle`.

        The tensors are encoded before this returns. Every worker must launch the same exchanges (same sizes and
        codec) in the same order. ``keep_own=False``: the caller will not read ``handle.own``, so the runtime may
        reuse the payload's memory. ``agreed``: :meth:`agree` returned True for this schedule, so the runtime may
        skip its per-exchange check. ``transport``: how a quantized dense payload moves (``OuterConfig.transport``).
        ``window``: a quorum exchange's window (only where ``closes_on_quorum``; docs/algorithms.md, 12).
        Failures of the exchange itself surface at :meth:`Handle.wait`.
        """

    def quorum_state(self) -> dict[str, Any] | None:
        """What this worker's transport holds of its quorum exchanges, for its checkpoint (across jobs, 12.10: the
        windows it holds); None where the party that forms the means holds it all."""
        return None

    def load_quorum_state(self, state: dict[str, Any] | None) -> None:  # noqa: B027 - nothing held by default
        """Continue from :meth:`quorum_state`."""

    #: The time of a simulated clock, which compute, overhead (where the runtime counts it) and waits advance.
    now: float = 0.0

    def clock(self) -> float:
        """Seconds on this worker's clock: real wall time, or the simulated time (in-process)."""
        return self.now if self.simulated_clock else time.perf_counter()

    def add_compute(self, seconds: float) -> None:
        """Record inner-loop compute time (advances a simulated clock)."""
        self.stats.compute_s += seconds
        if self.simulated_clock:
            self.now += seconds

    def add_overhead(self, seconds: float) -> None:
        """Record outer-machinery time spent outside the link (a simulated clock counts it where it says)."""
        self.stats.overhead_s += seconds

    def set_clock(self, t: float) -> None:
        """Set a simulated clock (restoring a checkpoint, rewinding the end-of-run drain); a real one ignores it."""
        self.now = t

    def wait_until(self, t: float) -> None:
        """Block (on a simulated clock) until time t, counting the wait as blocked time."""
        if self.simulated_clock and t > self.now:
            self.stats.blocked_s += t - self.now
            self.now = t

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """Check once that every worker runs the same exchange ``schedule`` (a digest; ``describe`` in words for the
        error) and say whether exchanges of it may be launched with ``agreed=True``. Every worker calls it at the
        same point of its exchange sequence; raises ScheduleMismatchError when the digests differ.
        """
        return False

    def barrier(self) -> None:  # noqa: B027 - optional for implementations without peers
        """Wait for every worker (start and end of a run), in order with the exchanges launched before it."""

    def close(self, cancel: bool = False) -> None:  # noqa: B027 - nothing to release by default
        """Release resources; closing twice is harmless. ``cancel`` drops exchanges still queued (after a failure)."""
