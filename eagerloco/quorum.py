"""A worker's side of quorum exchanges (docs/algorithms.md, 12): the rule its settings give, the window it launches
each outer exchange with, and where its windows landed (merged, late or dropped; a dropped payload goes back
into the error-feedback buffer).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import replace
from typing import Any

import torch

from eagerloco.adaptive import Weight
from eagerloco.comm.base import Communicator, QuorumResult, QuorumRule, Window, WorkerStats
from eagerloco.config import ConfigError, OuterConfig, flag_name
from eagerloco.error_feedback import ErrorFeedback

#: Ticks whose median compute time converts a late worker's lag into ticks to skip (a stall among them moves it little).
TICKS_MEASURED = 9


def quorum_rule(config: OuterConfig, comm: Communicator) -> QuorumRule | None:
    """The rule of this run's exchanges; None where every exchange waits for every worker (no ``--quorum``, or Q = M:
    bit for bit the method without one). ConfigError when Q > M or the communicator cannot close on a quorum."""
    workers = comm.num_workers
    if config.quorum is None or config.quorum == workers:
        return None
    if config.quorum > workers:
        raise ConfigError(f"{flag_name('quorum')} {config.quorum} is more than the {workers} workers: give at most "
                          f"{workers} ({workers}: every exchange waits for every worker)")
    if not comm.closes_on_quorum:
        raise ConfigError(f"{flag_name('quorum')} runs in-process or across jobs at a coordinator (--outer-addr): "
                          "this runtime's exchanges need every worker; drop --quorum")
    return QuorumRule(config.quorum, config.grace_seconds(), config.max_late_rounds)


class OwnWindows:
    """This worker's windows under a quorum: the steps each spans, where each landed (counted in ``stats``), and the
    catch-up after one missed its exchange (12.5: a worker j ticks behind skips its next j ticks). Under error
    feedback each window's payload is kept until a mean merges it, and put back into the buffer if dropped.
    """

    def __init__(self, rank: int, rule: QuorumRule, fragments: int, feedback: ErrorFeedback | None,
                 period: int) -> None:
        self.rank, self.rule, self.feedback, self.period = rank, rule, feedback, period
        #: The run's last inner step (0: unknown): each fragment's exchange after which none is due there closes
        #: on every live worker, so that it merges every window still held (12.4).
        self.end = 0
        self.ran = [0] * fragments  # inner steps since each fragment's last launch
        self.scheduled = [0] * fragments  # those the schedule gave it (more where it skipped ticks)
        self.catch_up = 0  # ticks still to skip
        self.skipped = 0  # ticks skipped so far
        self.recent: list[float] = []  # the compute seconds of its last ticks with steps (their median: a tick's)
        self.compute_mark: float | None = None
        self.ticks = 0  # ticks done
        #: (fragment, launch step) -> (clock at launch, ticks done by then, payload kept under error feedback).
        self.launches: dict[tuple[int, int], tuple[float, int, list[torch.Tensor] | None]] = {}

    def due(self, scheduled: int) -> int:
        """This worker's inner steps at the next tick: the schedule's, or none while it catches up."""
        return 0 if self.catch_up else scheduled

    def tick(self, scheduled: int, compute_s: float) -> int:
        """The tick is done, of ``scheduled`` inner steps, with this worker's compute seconds so far; returns the
        steps it ran (none while it catches up)."""
        ran = self.due(scheduled)
        if self.catch_up:
            self.catch_up -= 1
            self.skipped += 1
        elif ran and self.compute_mark is not None:
            self.recent = [*self.recent, (compute_s - self.compute_mark) / ran][-TICKS_MEASURED:]
        self.compute_mark = compute_s
        self.ran = [n + ran for n in self.ran]
        self.scheduled = [n + scheduled for n in self.scheduled]
        self.ticks += 1
        return ran

    def window(self, fragment: int, step: int, workers: int, weight: Weight | None) -> tuple[Window, float]:
        """The fragment's window launched now at ``step`` as a quorum exchange takes it, and the factor its outer
        gradient is sent with: M n / N (1.0 for equal windows), n the steps it ran."""
        steps, scheduled = self.ran[fragment], self.scheduled[fragment]
        self.ran[fragment] = self.scheduled[fragment] = 0
        scale = 1.0 if weight is None else weight.scale
        if weight is not None:
            workers = len(weight.window)
        total = scheduled * workers if weight is None else sum(weight.window)
        if steps != scheduled:  # fewer after a catch-up (12.5): weighted by the steps it ran
            scale = workers * steps / total
        last = bool(self.end) and step + self.period > self.end  # the fragment's last exchange: a quorum of all
        rule = replace(self.rule, quorum=max(self.rule.quorum, workers)) if last else self.rule
        return Window(fragment, step, steps, total, rule), scale

    def launched(self, fragment: int, step: int, clock: float, payload: list[torch.Tensor] | None) -> None:
        """This worker's window of ``fragment`` left at ``step``, at ``clock``, with this payload."""
        kept = None if self.feedback is None or payload is None else [t.clone() for t in payload]
        self.launches[(fragment, step)] = (clock, self.ticks, kept)

    @torch.no_grad()
    def landed(self, fragment: int, step: int, result: QuorumResult | None, stats: WorkerStats, clock_now: float
               ) -> None:
        """The mean of fragment's exchange launched at ``step`` landed, at ``clock_now``, holding ``result`` (None:
        every worker's window on time, nothing late or dropped)."""
        _, ticks, _ = self.launches.get((fragment, step), (0.0, 0, None))
        mine = [] if result is None else [c for c in result.merged if c.worker == self.rank]
        if result is None or any(c.step == step for c in mine):
            self.launches.pop((fragment, step), None)
        else:
            stats.quorum_missed += 1
            tick_s = statistics.median(self.recent) if self.recent else 0.0
            if result.closes_at is not None and result.tick_s and tick_s > 0:
                # How far behind the others it is now: they went on from the close, a tick at the fastest's pace.
                behind = clock_now - result.closes_at - (self.ticks - ticks) * result.tick_s
                self.catch_up = max(0, math.ceil(behind / tick_s - 1e-9))
        for c in mine:
            if c.step != step:
                stats.late_merged += 1
                self.launches.pop((fragment, c.step), None)
        for c in [] if result is None else result.dropped:
            if c.worker != self.rank:
                continue
            stats.late_dropped += 1
            self._restore(fragment, self.launches.pop((fragment, c.step), (0.0, 0, None))[2])

    @torch.no_grad()
    def drain(self, stats: WorkerStats) -> None:
        """The run's end, every mean landed: a window that missed and that no later exchange merged (the run's end
        was not known, or its worker left) is dropped, with a log line (and, under error feedback, back into the
        buffer)."""
        for (fragment, step), (_, _, payload) in sorted(self.launches.items()):
            stats.late_dropped += 1
            print(f"eagerloco: quorum: worker {self.rank}'s window of fragment {fragment} launched at step {step} "
                  "missed its exchange, and the run ended before a later one merged it: dropped",
                  file=sys.stderr, flush=True)
            self._restore(fragment, payload)
        self.launches.clear()

    @torch.no_grad()
    def _restore(self, fragment: int, payload: list[torch.Tensor] | None) -> None:
        """A dropped window's payload back into the error-feedback buffer: what no mean merged stays there."""
        if payload is not None and self.feedback is not None:
            for e, t in zip(self.feedback.buffers[fragment], payload, strict=True):
                e.add_(t)

    def forget(self) -> None:
        """A worker joining with a peer's state: no window of its own missed yet, its tick times to be measured."""
        self.launches.clear()
        self.catch_up, self.recent, self.compute_mark = 0, [], None

    def state_dict(self) -> dict[str, Any]:
        return {"ran": list(self.ran), "scheduled": list(self.scheduled), "catch_up": self.catch_up,
                "skipped": self.skipped, "ticks": self.ticks, "recent": list(self.recent),
                "compute_mark": self.compute_mark,
                "launches": [[f, s, c, k, p] for (f, s), (c, k, p) in self.launches.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ran, self.scheduled = [int(n) for n in state["ran"]], [int(n) for n in state["scheduled"]]
        self.catch_up, self.skipped, self.ticks = int(state["catch_up"]), int(state["skipped"]), int(state["ticks"])
        self.recent = [float(t) for t in state["recent"]]
        self.compute_mark = state["compute_mark"]
        self.launches = {(int(f), int(s)): (float(c), int(k), p) for f, s, c, k, p in state["launches"]}
