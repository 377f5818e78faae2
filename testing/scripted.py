"""A scripted Communicator for tests: preset results, simulated durations, failures on cue, a record of calls,
so :class:`~eagerloco.outer.OuterSync` can be unit-tested in one process without peers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from eagerloco.codecs import Codec
from eagerloco.comm.base import (
    Communicator,
    Handle,
    QuorumResult,
    Window,
    WorkerStats,
    encode,
    flatten,
    hand_over,
    unflatten,
    wire_bytes,
)
from eagerloco.comm.errors import PeerError
from eagerloco.comm.quorum import LateWindows

#: Gives, for exchange i, the other workers' contributions (each a list shaped like the caller's tensors).
PeersFn = Callable[[int], Sequence[Sequence[torch.Tensor]]]


@dataclass
class ScriptedCall:
    """One :meth:`ScriptedCommunicator.allreduce_mean` call, as recorded for assertions."""

    index: int  # 0, 1, 2, ... in launch order
    tensors: list[torch.Tensor]  # FP32 copies of what was passed
    codec: Codec
    numel: int
    payload_bytes: int  # the encoded payload's size
    keep_own: bool
    agreed: bool
    num_workers: int  # the communicator's num_workers at launch
    launched_at: float  # simulated clock at launch
    ready_at: float  # simulated clock at which wait() returns
    mean: list[torch.Tensor] = field(default_factory=list)  # what wait() hands out (empty if it fails)
    waited: bool = False
    #: The transport asked for (recorded only: the scripted mean is the all-gathered one).
    transport: str = "allgather"
    #: A quorum exchange's window (fragment, launch step, steps, rule); None: an exchange of every worker.
    window: Window | None = None


class ScriptedHandle(Handle):
    """The handle of one scripted exchange."""

    def __init__(self, comm: ScriptedCommunicator, call: ScriptedCall, own: list[torch.Tensor],
                 error: BaseException | None) -> None:
        self._comm, self.call, self._error = comm, call, error
        self.own = own
        self.payload_bytes = call.payload_bytes

    def done(self) -> bool:
        return self.call.ready_at <= self._comm.clock()

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Move the simulated clock to the exchange's ready time, then return its mean or raise its error."""
        if self.call.waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        self.call.waited = True
        self._comm.waits.append(self.call.index)
        self._comm.wait_until(self.call.ready_at)
        if self._error is not None:
            raise self._error
        return hand_over(self.call.mean, out)

    def checkpoint_result(self) -> tuple[list[torch.Tensor], float | None]:
        if self._error is not None:
            raise self._error
        return self.call.mean, self.call.ready_at


class ScriptedCommunicator(Communicator):
    """One worker's communicator whose peers are a script.

    Results, by priority: ``means[i]`` as given; else the FP32 mean of this worker's contribution and
    ``peers(i)``'s; else this worker's own contribution as decoded. ``durations``: simulated link seconds;
    ``fail``: exchange indices whose wait() raises (a mapping gives the exception); ``contributors``: by index,
    the worker ids a rerun's mean holds (elastic); ``late``: by index, the workers whose quorum windows miss it
    and by how many of their fragment's exchanges.
    """

    simulated_clock = True
    closes_on_quorum = True

    def __init__(
        self,
        num_workers: int = 1,
        rank: int = 0,
        *,
        means: Mapping[int, Sequence[torch.Tensor]] | None = None,
        peers: PeersFn | None = None,
        durations: float | Mapping[int, float] = 0.0,
        fail: Iterable[int] | Mapping[int, BaseException] = (),
        agree_result: bool = False,
        elastic: bool = False,
        contributors: Mapping[int, Sequence[int]] | None = None,
        late: Mapping[int, Mapping[int, int]] | None = None,
    ) -> None:
        self.num_workers, self.rank, self.elastic = num_workers, rank, elastic
        self.present: list[int] | None = None  # the worker ids present, once regroup() has set them
        self.contributors = dict(contributors or {})
        self.late = dict(late or {})
        #: The party forming the quorum means, and each fragment's exchanges closed (its clock: exchange n closes
        #: at n, or with a quorum of every worker at the last arrival; a window late by L arrives at n + L - 1/2).
        self.late_windows = LateWindows()
        self.closed: dict[int, int] = {}
        self.stats = WorkerStats()
        self.means = dict(means or {})
        self.peers = peers
        self.durations = durations
        self.fail: dict[int, BaseException] = (
            dict(fail) if isinstance(fail, Mapping)
            else {i: PeerError(f"scripted failure of exchange #{i}", []) for i in fail}
        )
        self.agree_result = agree_result
        #: Every allreduce_mean call, in launch order.
        self.calls: list[ScriptedCall] = []
        #: The exchange index of every wait() call, in the order they were made.
        self.waits: list[int] = []
        #: (schedule, describe) of every agree() call.
        self.agreements: list[tuple[bytes, str]] = []
        self.barriers = 0
        #: The cancel argument of every close() call.
        self.closes: list[bool] = []

    # -- the Communicator interface ----------------------------------------------------------------

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False, transport: str = "allgather", window: Window | None = None,
    ) -> ScriptedHandle:
        i = len(self.calls)
        flat = flatten(tensors)
        payload, own_flat = encode(codec, flat.clone(), generator)
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        own = unflatten(own_flat.clone(), like)
        duration = self.durations.get(i, 0.0) if isinstance(self.durations, Mapping) else self.durations
        call = ScriptedCall(
            index=i, tensors=[t.detach().to(torch.float32).clone() for t in tensors], codec=codec,
            numel=flat.numel(), payload_bytes=payload.numel(), keep_own=keep_own, agreed=agreed,
            num_workers=self.num_workers, launched_at=self.now, ready_at=self.now + float(duration),
            transport=transport, window=window,
        )
        error = self.fail.get(i)
        quorum = None
        if error is None:
            call.mean = self._mean(i, own_flat, like)
            if window is not None:
                quorum = self._close(i, window, own_flat, like, call)
        self.calls.append(call)
        wire = wire_bytes(call.payload_bytes, self.num_workers, codec.summable)
        self.stats.exchanged(wire, call.payload_bytes)
        handle = ScriptedHandle(self, call, own if keep_own else [], error)
        if i in self.contributors:
            handle.contributors = list(self.contributors[i])
        handle.quorum = quorum
        return handle

    def _close(self, i: int, window: Window, own_flat: torch.Tensor, like: list[torch.Tensor], call: ScriptedCall
               ) -> QuorumResult | None:
        """Close quorum exchange i as scripted by ``late``; its mean replaces the plain one where it differs."""
        others = [flatten(list(c)) for c in (self.peers(i) if self.peers is not None else [])]
        values = [*others[:self.rank], own_flat, *others[self.rank:]]
        n = self.closed.get(window.fragment, 0)
        self.closed[window.fragment] = n + 1
        lateness = self.late.get(i, {})
        arrivals = [n + lateness[m] - 0.5 if lateness.get(m) else float(n) for m in range(len(values))]
        if window.rule.quorum >= len(values):  # a quorum of every worker waits for all, the windows held too
            held = [w.arrival for w in self.late_windows.held.get(window.fragment, [])]
            close = max(n, *arrivals, *held)
        else:
            close = n
        mean, result = self.late_windows.close(window, float(close), values, arrivals, [window.steps] * len(values))
        if mean is not None:
            call.mean = [t.clone() for t in unflatten(mean, like)]
        return None if result is None else replace(result, closes_at=None, tick_s=None)  # on the script's clock

    @property
    def members(self) -> list[int]:
        return list(range(self.num_workers)) if self.present is None else list(self.present)

    def regroup(self, members: Sequence[int]) -> None:
        """An elastic membership change: these worker ids are present from now on."""
        self.present, self.num_workers = list(members), len(members)

    def _mean(self, i: int, own_flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        if i in self.means:
            return [torch.as_tensor(t, dtype=torch.float32).reshape(s.shape).clone()
                    for t, s in zip(self.means[i], like, strict=True)]
        others = list(self.peers(i)) if self.peers is not None else []
        total = own_flat.clone()
        for contribution in others:
            total += flatten(list(contribution))
        return [t.clone() for t in unflatten(total / (1 + len(others)), like)]

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        self.agreements.append((schedule, describe))
        return self.agree_result

    def barrier(self) -> None:
        self.barriers += 1

    def close(self, cancel: bool = False) -> None:
        self.closes.append(cancel)


__all__ = ["PeersFn", "ScriptedCall", "ScriptedCommunicator", "ScriptedHandle"]
