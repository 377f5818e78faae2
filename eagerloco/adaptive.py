"""Workers of unequal speed (docs/algorithms.md, 11): every worker's inner steps per round, agreed by all of
them, and the token weights of each exchange; the round's arithmetic is :class:`eagerloco.schedule.Rounds`.

Worker m sends (M * w_m) * Delta_m, so the plain mean is sum_m w_m Delta_m on the same bytes. Under
``--elastic`` every vector is indexed by worker id and the factor stays M w_m over every worker's window
(survivors see a change at different steps); the mean that lands is rescaled over its contributors (:meth:`settle`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch

from eagerloco.codecs import get_codec
from eagerloco.comm.base import Communicator, Handle, ReadyHandle
from eagerloco.config import ConfigError, OuterConfig, flag_name
from eagerloco.schedule import Rounds, round_lengths


class SpeedMeter:
    """A worker's inner steps per second: an exponential average of its step times, each clipped to ``clip`` times
    the median of the last ``window`` (one slow step moves it little)."""

    def __init__(self, decay: float = 0.9, window: int = 9, clip: float = 2.0) -> None:
        self.decay, self.window, self.clip = decay, window, clip
        self.recent: list[float] = []
        self.average: float | None = None

    def add(self, seconds: float) -> None:
        """One inner step's time."""
        counted = min(seconds, self.clip * median(self.recent)) if len(self.recent) >= 3 else seconds
        self.recent = [*self.recent, seconds][-self.window:]
        self.average = counted if self.average is None else self.decay * self.average + (1 - self.decay) * counted

    @property
    def steps_per_s(self) -> float:
        """The average speed (0.0 before any step: unknown)."""
        return 1.0 / self.average if self.average else 0.0

    def state(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "average": self.average}

    def load(self, state: dict[str, Any]) -> None:
        self.recent, self.average = [float(x) for x in state["recent"]], state["average"]


@dataclass(frozen=True)
class Weight:
    """How one worker weighs the exchange it launches: the factor M * w_m it is sent with (``scale``), the M its own
    share is applied with (``workers``), the others' weight 1 - w_m, and every worker's steps in the window."""

    scale: float
    workers: float
    others: float
    window: list[int]


class AdaptiveSteps:
    """One worker's side of the adaptive rounds: when it steps, how it weighs what it sends, and the speeds.

    Speeds are ``--worker-speeds`` or measured and exchanged at each round's end, waited on a round later, so the
    exchange never holds up an overlapped method and rounds before the first vector lands run H everywhere.
    An elastic communicator exchanges given speeds too: a round is sized for the workers its vector holds.
    """

    def __init__(self, config: OuterConfig, comm: Communicator) -> None:
        self.config, self.comm = config, comm
        workers = comm.num_workers
        speeds = config.worker_speeds
        # An elastic worker that rejoins may find fewer workers present than the run has (one per speed).
        if speeds and len(speeds) != workers and not (comm.elastic and len(speeds) > max(comm.members)):
            raise ConfigError(f"{flag_name('worker_speeds')} gives {len(speeds)} speed(s) for {workers} workers: "
                              "give one speed per worker")
        self.measured = not speeds
        #: Whether the speeds are exchanged at each round's end (measured, or who is present under --elastic).
        self.exchanged = self.measured or comm.elastic
        self.rounds = Rounds(config.inner_steps, config.fragments,
                             round_lengths(config.inner_steps, list(speeds) if speeds else [1.0] * workers))
        self.meter = SpeedMeter()
        #: Each worker's inner steps done while it was present (what it trained; ``rounds.done`` keeps counting a
        #: worker that left, since every survivor's windows must agree): the tokens reported, not the weights.
        self.trained = [0] * workers
        self.pending: Handle | None = None  # the speeds launched at the last round's end
        self.compute_mark: float | None = None  # compute seconds counted at the last tick

    def due(self) -> int:
        """This worker's inner steps at the next tick."""
        return self.rounds.due(self.comm.rank)

    def tick(self, ran: int | None = None) -> None:
        """The tick's inner steps are done: count them (and, measuring, their time); ``ran``: this worker's, where a
        quorum's catch-up skipped them (None: the schedule's)."""
        rank = self.comm.rank
        steps = self.rounds.due(rank) if ran is None else ran
        compute = self.comm.stats.compute_s
        if self.measured and steps and self.compute_mark is not None:
            self.meter.add((compute - self.compute_mark) / steps)
        self.compute_mark = compute
        for m in self.comm.members if self.comm.elastic else range(len(self.trained)):
            self.trained[m] += steps if m == rank else self.rounds.due(m)
        self.rounds.advance()

    def weigh(self, fragment: int) -> Weight:
        """For the fragment's exchange launched now: how this worker weighs it (:class:`Weight`), w_m its share
        of the window's steps among the workers present (every worker, unless an elastic one left)."""
        steps = self.rounds.window(fragment)
        total, mine = sum(steps), steps[self.comm.rank]
        present = sum(steps[w] for w in self.comm.members)
        # Ints first: with every worker present, workers is M and others (total - mine) / total, exactly.
        return Weight(len(steps) * mine / total, len(steps) * present / total, (present - mine) / present, steps)

    @staticmethod
    def settle(mean: list[torch.Tensor], window: Sequence[int], contributors: Sequence[int] | None
               ) -> list[torch.Tensor]:
        """The landed mean of an exchange launched with this window, renormalised in place over its contributors: times
        |C| T / (M T_C), giving sum_{m in C} (n_m / T_C) Delta_m; unchanged when every worker sent."""
        workers = len(window)
        if contributors is None or len(contributors) == workers:
            return mean
        factor = len(contributors) * sum(window) / (workers * sum(window[w] for w in contributors))
        return [t.mul_(factor) for t in mean]

    def forget_speed(self) -> None:
        """This worker continues from another worker's state (it rejoins): the speed measured there is not its
        own, so it measures afresh (until it has, the rounds keep its H_m)."""
        self.meter, self.compute_mark = SpeedMeter(), None

    def round_end(self, **agreed: Any) -> float:
        """At a round's end: take the speeds launched a round ago for the round that starts, and launch this round's.
        Returns the real seconds blocked on them (0.0 on a simulated clock), left out of the caller's overhead."""
        if not self.exchanged:
            return 0.0
        waited = 0.0
        if self.pending is not None:
            t0 = time.perf_counter()
            speeds = self.pending.wait()[0].tolist()
            waited = 0.0 if self.comm.simulated_clock else time.perf_counter() - t0
            self.resize(speeds, self.pending.contributors)
            self.pending = None
        workers, rank = len(self.rounds.lengths), self.comm.rank
        mine = torch.zeros(workers, dtype=torch.float64)
        speed = self.meter.steps_per_s if self.measured else self.config.worker_speeds[rank]
        mine[rank] = speed * self.comm.num_workers
        self.pending = self.comm.allreduce_mean([mine.to(torch.float32)], get_codec("fp32"), None, keep_own=False,
                                                **agreed)
        self.comm.stats.num_syncs -= 1  # the speeds are no outer sync (metrics.OuterMetrics)
        return waited

    def resize(self, speeds: list[float], contributors: Sequence[int] | None) -> None:
        """Size the next round from a speeds vector of these workers (None: every worker): H_m = max(1, round(H r_m /
        r_max)) once each has measured a step; a worker not among them keeps its H_m."""
        who = range(len(speeds)) if contributors is None else contributors
        if min(speeds[w] for w in who) <= 0:
            return
        lengths = list(self.rounds.lengths)
        for w, n in zip(who, round_lengths(self.config.inner_steps, [speeds[w] for w in who]), strict=True):
            lengths[w] = n
        self.rounds.set_lengths(lengths)

    def drain(self) -> float:
        """The run's end: wait on the speeds in flight (every handle is waited on once); returns the real seconds
        blocked (as :meth:`round_end`)."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        self.pending.wait()
        self.pending = None
        return 0.0 if self.comm.simulated_clock else time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        """What the next round needs: the rounds so far, the speed average, the speeds in flight (resolved)."""
        pending = None
        if self.pending is not None:
            mean, ready_at = self.pending.checkpoint_result()
            who = self.pending.contributors
            self.pending = ReadyHandle(self.comm, mean, [], 0, ready_at, who)
            pending = {"mean": mean, "ready_at": ready_at, "contributors": who}
        return {"rounds": self.rounds.state(), "meter": self.meter.state(), "pending": pending,
                "compute_mark": self.compute_mark, "trained": list(self.trained)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds.load(state["rounds"])
        self.meter.load(state["meter"])
        p = state["pending"]
        self.pending = None if p is None else ReadyHandle(self.comm, p["mean"], [], 0, p["ready_at"], p["contributors"])
        self.compute_mark = state["compute_mark"]
        self.trained = [int(n) for n in state["trained"]]
