"""The names, types and units of a worker's link and time accounting: one set of names for the trainer's
``metrics.jsonl`` lines and the hook API's ``outer.metrics()``."""

from __future__ import annotations

from typing import Protocol, TypedDict


class LinkMetrics(TypedDict):
    """A worker's accounting so far, as every ``metrics.jsonl`` line and ``outer.metrics()`` carry it."""

    bytes_sent: int
    """Bytes this worker put on the link (its share of a ring all-reduce, or the payloads it all-gathered)."""
    blocked_s: float
    """Seconds it waited for an exchange to land (on the emulated link's clock, where one is emulated)."""
    compute_s: float
    """Seconds of inner compute: forward, backward and the inner optimizer's step."""
    compute_utilization: float
    """compute_s over the worker's wall time: 1.0 when the link never held it up."""


class OuterMetrics(LinkMetrics):
    """``outer.metrics()``: the link accounting, and what a loop of one's own cannot see otherwise."""

    bytes_received: int
    """Bytes that reached this worker (as many as it sent: ring and all-gather are symmetric)."""
    outer_syncs: int
    """Exchanges of outer gradients launched (one per fragment per round; dp: one per inner step); the speeds of
    --adaptive-steps and eager's closing mean are not outer syncs."""
    overhead_s: float
    """Seconds in the outer machinery outside the link: encoding, decoding, the outer optimizer."""


class Accounting(Protocol):
    """What the numbers are read from (:class:`eagerloco.comm.base.WorkerStats`)."""

    bytes_sent: int
    bytes_received: int
    num_syncs: int
    compute_s: float
    blocked_s: float
    overhead_s: float


def link_metrics(stats: Accounting, wall_s: float) -> LinkMetrics:
    """The shared accounting of a worker whose wall time is known (the trainer's clock)."""
    return {"bytes_sent": int(stats.bytes_sent), "blocked_s": stats.blocked_s, "compute_s": stats.compute_s,
            "compute_utilization": stats.compute_s / wall_s if wall_s > 0 else 1.0}


def outer_metrics(stats: Accounting) -> OuterMetrics:
    """``outer.metrics()``: the wall time a loop of one's own lets the hooks see is its compute, its waits and
    the outer machinery (data loading and logging between steps are not counted)."""
    wall = stats.compute_s + stats.blocked_s + stats.overhead_s
    return {**link_metrics(stats, wall), "bytes_received": int(stats.bytes_received),
            "outer_syncs": int(stats.num_syncs), "overhead_s": stats.overhead_s}
