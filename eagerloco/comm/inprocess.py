"""M workers in one process, exact math, and a simulated link with its own clock.

Workers run in lockstep: in one phase every worker launches before any waits. Each worker's clock advances by
its compute time; an exchange finishes when the last worker launched it and the link (one transfer at a time)
has moved its bytes, so blocked time and utilization are reported as on the configured link.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from eagerloco.codecs import Codec, Fp32Codec
from eagerloco.comm.base import (
    Communicator,
    Handle,
    QuorumResult,
    Window,
    WorkerStats,
    decoder,
    encode,
    flatten,
    hand_over,
    mean_of_payloads,
    unflatten,
    wire_bytes,
)
from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.comm.quorum import GraceWindow, LateWindows
from eagerloco.comm.reduce_scatter import Shards, uses_reduce_scatter
from eagerloco.config import LinkConfig


class _Exchange:
    """One collective: every worker's payload, and when the link delivers it."""

    def __init__(self, num_workers: int, codec: Codec, like: list[torch.Tensor], transport: str) -> None:
        self.codec, self.transport = codec, transport
        self.like = [torch.empty(t.shape) for t in like]
        self.numel = sum(t.numel() for t in like)
        self.payloads: list[torch.Tensor | None] = [None] * num_workers
        self.launch_times: list[float] = [0.0] * num_workers
        self.finish_time: float | None = None
        self.mean: list[torch.Tensor] | None = None
        self.mean_flat: torch.Tensor | None = None
        self.waits = 0
        self.reusable: list[torch.Tensor] = []  # payloads launched with keep_own=False (fp32)
        #: A quorum exchange: its window (any worker's), each worker's steps and compute seconds at launch, its
        #: handles (they learn what it merged once it closes) and what it merged.
        self.window: Window | None = None
        self.steps: list[int] = [0] * num_workers
        self.computed: list[float] = [0.0] * num_workers
        self.handles: list[InProcessHandle] = []
        self.quorum: QuorumResult | None = None
        #: The reduce-scatter's layout, when the exchange goes through one.
        self.shards = Shards(codec, self.numel, num_workers) if uses_reduce_scatter(codec, transport, num_workers) \
            else None

    def complete(self) -> bool:
        return all(p is not None for p in self.payloads)


class InProcessHandle(Handle):
    def __init__(
        self, group: InProcessGroup, comm: InProcessCommunicator, ex: _Exchange, own: list[torch.Tensor], nbytes: int
    ) -> None:
        self._group, self._comm, self._ex = group, comm, ex
        self.own = own
        self.payload_bytes = nbytes
        self._waited = False

    def done(self) -> bool:
        ex = self._ex
        return ex.complete() and ex.finish_time is not None and ex.finish_time <= self._comm.clock()

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if self._waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        ex = self._ex
        mean = self._mean()
        self._waited = True
        assert ex.finish_time is not None
        self._comm.wait_until(ex.finish_time)
        result = hand_over(mean, out)
        ex.waits += 1
        if ex.waits == len(ex.payloads):
            # Every worker has its copy and nothing else sees the mean: its memory serves the next exchange of
            # this size (no page-faulting allocation every step under dp).
            group = self._group
            assert ex.mean_flat is not None  # set by _mean()
            group._spare[ex.numel] = ex.mean_flat
            ex.mean = ex.mean_flat = None
            group._spare_payloads.setdefault(ex.numel, []).extend(ex.reusable)
            del group._spare_payloads[ex.numel][: -len(ex.payloads)]  # keep at most M
            ex.reusable = []
        return result

    def checkpoint_result(self) -> tuple[list[torch.Tensor], float | None]:
        return [t.clone() for t in self._mean()], self._ex.finish_time

    def _mean(self) -> list[torch.Tensor]:
        ex = self._ex
        if not ex.complete():
            missing = [m for m, p in enumerate(ex.payloads) if p is None]
            raise RuntimeError(
                f"in-process worker {self._comm.rank} waits on an exchange that worker(s) {missing} have not "
                "launched yet; launch every worker's exchange before any worker waits "
                "(drive the workers with eagerloco.outer.lockstep)"
            )
        if ex.mean is None:
            if ex.shards is not None:
                flat = ex.shards.mean_of_payloads(ex.payloads)  # type: ignore[arg-type]
            else:
                spare = self._group._spare.pop(ex.numel, None)
                flat = mean_of_payloads(ex.codec, ex.payloads, ex.numel, out=spare)  # type: ignore[arg-type]
            ex.mean_flat, ex.mean = flat, unflatten(flat, ex.like)
        return ex.mean


class InProcessGroup:
    """The shared state of M in-process workers: the exchanges in flight and the link."""

    def __init__(
        self, num_workers: int, link: LinkConfig | None = None, seed: int = 0, count_overhead: bool = True
    ) -> None:
        """count_overhead: advance the clocks by the measured outer-machinery time; turn it off when
        compute time is simulated too, so the clocks are a pure function of the schedule."""
        if num_workers < 1:
            raise ValueError(f"--workers must be an integer >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.link = EmulatedLink(link, seed)  # its clock is the simulated one
        self.count_overhead = count_overhead
        # Exchanges by launch sequence number, until every worker has launched; then only the
        # handles hold them, so a finished exchange is freed with its last handle.
        self._by_seq: dict[int, _Exchange] = {}
        self._spare: dict[int, torch.Tensor] = {}  # a finished exchange's mean buffer, by size
        self._spare_payloads: dict[int, list[torch.Tensor]] = {}  # finished keep_own=False payloads
        #: Quorum exchanges (12 of docs/algorithms.md): when they close, the late windows held, and each worker's
        #: compute seconds at its last window (the fastest one's compute between windows sizes the auto grace).
        self._grace = GraceWindow()
        self._late = LateWindows()
        self._computed = [0.0] * num_workers
        self._round_compute = 0.0
        self._step, self._tick_s = 0, 0.0  # the last quorum exchange's launch step; the fastest's seconds per tick
        self.communicators = [InProcessCommunicator(self, m) for m in range(num_workers)]

    def state_dict(self) -> dict[str, object]:
        """The link's state between steps (every exchange launched by then is complete)."""
        if self._by_seq:
            raise RuntimeError("cannot checkpoint while an exchange is only partly launched")
        return {"link_free": self.link.free_at, "rng": self.link.rng.getstate(), "grace": self._grace.state_dict(),
                "late": self._late.state_dict(), "computed": list(self._computed), "round_compute": self._round_compute,
                "step": self._step, "tick_s": self._tick_s}

    def load_state_dict(self, state: object) -> None:
        """Restore :meth:`state_dict`; ValueError naming what is wrong with ``state`` (read from a file)."""
        if not isinstance(state, dict):
            raise ValueError(f"group {_short(state)} is not the simulated link's state (a table with link_free and "
                             "rng)")
        free = state.get("link_free")
        if isinstance(free, bool) or not isinstance(free, (int, float)) or not math.isfinite(free) or free < 0:
            raise ValueError(f"group.link_free {_short(free)} is not a time in seconds")
        rng = random.Random()
        try:
            rng.setstate(_rng_state(state.get("rng")))
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):
            raise ValueError(f"group.rng {_short(state.get('rng'))} is not a random generator's state") from None
        grace, late = GraceWindow(), LateWindows()
        try:
            grace.load_state_dict(state["grace"])
            late.load_state_dict(state["late"])
            computed, round_compute = [float(c) for c in state["computed"]], float(state["round_compute"])
            step, tick_s = int(state["step"]), float(state["tick_s"])
        except (TypeError, ValueError, KeyError, AttributeError):
            raise ValueError(f"group.late {_short(state.get('late'))} is not the quorum exchanges' state") from None
        self.link.free_at, self.link.rng, self._grace, self._late = float(free), rng, grace, late
        self._computed, self._round_compute, self._step, self._tick_s = computed, round_compute, step, tick_s

    @staticmethod
    def state_problem(state: object) -> str:
        """What keeps ``state`` (read from a file) from being a :meth:`state_dict` of a group, or ""."""
        try:
            InProcessGroup(1).load_state_dict(state)
        except ValueError as e:
            return str(e)
        return ""

    def communicator(self, worker: int) -> InProcessCommunicator:
        return self.communicators[worker]

    def _launch(self, comm: InProcessCommunicator, tensors: list[torch.Tensor], codec: Codec,
                generator: torch.Generator | None, keep_own: bool = True, transport: str = "allgather",
                window: Window | None = None) -> InProcessHandle:
        idx = comm._next
        comm._next += 1
        ex = self._by_seq.get(idx)
        if ex is None:
            ex = self._by_seq[idx] = _Exchange(self.num_workers, codec, tensors, transport)
        reuse = not keep_own and isinstance(codec, Fp32Codec)
        spares = self._spare_payloads.get(sum(t.numel() for t in tensors)) if reuse else None
        flat = flatten(tensors, out=spares.pop() if spares else None)
        if reuse:
            ex.reusable.append(flat)  # its memory serves a later payload once everyone has the mean
        if flat.numel() != ex.numel or codec.name != ex.codec.name or transport != ex.transport:
            raise RuntimeError(
                f"worker {comm.rank}'s exchange #{idx} ({flat.numel()} values, {codec.name}, {transport}) does not "
                f"match worker(s) that launched it first ({ex.numel} values, {ex.codec.name}, {ex.transport}): "
                "workers must run the same schedule"
            )
        shards = ex.shards
        buf, own_flat = encode(codec, flat, generator) if shards is None else shards.pack(flat, generator)
        nbytes = buf.numel()
        wire = wire_bytes(nbytes, self.num_workers, codec.summable) if shards is None else shards.wire_bytes
        ex.payloads[comm.rank] = buf
        ex.launch_times[comm.rank] = comm.now
        if window is not None:
            ex.window = window
            ex.steps[comm.rank], ex.computed[comm.rank] = window.steps, comm.stats.compute_s
        comm.stats.exchanged(wire, nbytes if wire else 0)  # a worker alone sends nothing
        if ex.complete():
            del self._by_seq[idx]
            # The collective starts when the last worker joins and the link is free; a ring moves
            # every worker's share at once, so one shared link time serves the group.
            ex.finish_time = self.link.schedule(max(ex.launch_times) if ex.window is None else self._close(ex), wire)
        own = unflatten(own_flat, tensors) if keep_own else []
        handle = InProcessHandle(self, comm, ex, own, nbytes)
        if ex.window is not None:
            ex.handles.append(handle)
            for h in ex.handles if ex.complete() else ():
                h.quorum = ex.quorum
        return handle

    def _close(self, ex: _Exchange) -> float:
        """A quorum exchange every worker has launched: when it closes (its contributions arrive as they are
        launched), and its mean when that is not the plain mean of every payload. Returns the close."""
        window = ex.window
        assert window is not None
        # The fastest worker's compute between two windows, for the longest window (one that skipped ticks to
        # catch up ran fewer steps in it: its compute counts per step).
        most = max(ex.steps)
        spans = [(c - last) * most / n for c, last, n in zip(ex.computed, self._computed, ex.steps, strict=True)
                 if c > last and n > 0]
        self._round_compute = min(spans, default=self._round_compute)
        ticks = window.step - self._step  # ... and per tick, from the workers that ran every tick since the last
        full = [c - last for c, last, n in zip(ex.computed, self._computed, ex.steps, strict=True) if n == most]
        if ticks > 0 and full:
            self._tick_s = min(full) / ticks
        self._computed, self._step = list(ex.computed), window.step
        close = self._grace.closes_at(ex.launch_times, window.rule, self._round_compute)
        decode = decoder(ex.codec)
        values = [decode(p, ex.numel) for p in ex.payloads]  # type: ignore[arg-type]
        mean, ex.quorum = self._late.close(window, close, values, ex.launch_times, ex.steps, self._tick_s or None)
        if mean is not None:
            ex.mean_flat, ex.mean = mean, unflatten(mean, ex.like)
        return close


def _rng_state(rng: Any) -> tuple[Any, ...]:
    """random.Random's state from its JSON form (tuples become lists)."""
    return (rng[0], tuple(rng[1]), rng[2])


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class InProcessCommunicator(Communicator):
    """Worker `rank`'s view of an :class:`InProcessGroup`, with a simulated clock."""

    simulated_clock = True
    closes_on_quorum = True

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.num_workers = group.num_workers
        self.stats = WorkerStats()
        self._next = 0

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False, transport: str = "allgather", window: Window | None = None,
    ) -> InProcessHandle:
        return self.group._launch(self, tensors, codec, generator, keep_own, transport, window)

    def add_overhead(self, seconds: float) -> None:
        super().add_overhead(seconds)
        if self.group.count_overhead:
            self.now += seconds
