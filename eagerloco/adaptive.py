"""Workers of unequal speed (section 11 of docs/algorithms.md): every worker's inner steps per round, agreed
by all of them, and the token weights of each exchange.

:class:`~eagerloco.outer.OuterSync` holds one :class:`AdaptiveSteps` under ``--adaptive-steps``. The round's
arithmetic (ticks, H_m, each worker's steps by tick) is :class:`eagerloco.schedule.Rounds`; here is what needs
the other workers: the speeds, measured and exchanged, and the weight each worker gives its own outer gradient.

The weighted mean needs no change to the exchange: worker m sends (M * w_m) * Delta_m, so that the mean of
the contributions is sum_m w_m Delta_m, with w_m its share of the tokens of the fragment's window (its inner
steps since the fragment's last sync over all workers'; batches are equal). The payload's size, and so the
bytes on the link, do not change; equal windows give the factor 1.0 exactly and the method without the flag.

Under ``--elastic`` (:class:`~eagerloco.comm.elastic.Membership`) the weights are renormalised over the workers
present. Every vector here is indexed by worker id (M counts the run's workers, present or not), and what a
worker sends depends on nothing a membership change moves: survivors see a change at different steps, and an
exchange in flight may run again among them. So the factor stays M w_m over every worker's window, and the mean
that lands is rescaled over the workers whose payloads it holds (``Handle.contributors``, :meth:`settle`); the
next rounds' H_m come from the speeds exchange's contributors (:meth:`round_end`), the same on every survivor.
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
    """A worker's inner steps per second: an exponential average of its step times, each first clipped to at
    most ``clip`` times the median of the last ``window`` (one slow step, a checkpoint or a page fault, moves it
    little).

    Args:
        decay: the average's weight of the past, in [0, 1).
        window: recent step times whose median clips the next.
        clip: how many times that median a step time may count for.
    """

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
    """How one worker weighs the exchange it launches (:meth:`AdaptiveSteps.weigh`).

    Attributes:
        scale: the factor M * w_m its contribution is sent with (1.0 for equal windows).
        workers: the M its own share is applied with (eager applies ``sent / workers`` = w_m Delta_m, w_m its
            share among the workers present; the run's M when every worker is).
        others: the others' weight in the mean, 1 - w_m.
        window: each worker's inner steps in the window, by worker id (what :meth:`AdaptiveSteps.settle` needs).
    """

    scale: float
    workers: float
    others: float
    window: list[int]


class AdaptiveSteps:
    """One worker's side of the adaptive rounds: when it steps, how it weighs what it sends, and the speeds.

    Speeds come from ``--worker-speeds`` (fixed, no exchange) or are measured: at each round's end every
    worker launches its averaged speed (at its own index of an M-vector, times M, so the mean is the vector of
    every worker's speed) after that tick's outer exchanges, and waits on it at the next round's end, after
    that tick's; the vector then sizes the round that starts. The exchange has a whole round to land, so it
    never holds up an overlapped method; the speeds lag one round (an average does not move much in one).
    Rounds before the first vector lands run H on every worker. An elastic communicator exchanges given speeds
    too: the workers whose speeds a vector holds are the ones its round is sized for.

    Args:
        config: the outer settings (``adaptive_steps`` on).
        comm: this worker's communicator.

    Raises:
        ConfigError: ``--worker-speeds`` names another number of workers than the communicator has.
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
        """The landed mean of an exchange launched with this window, renormalised over its contributors (in
        place): their factors M w_m sum to M T_C / T over the |C| of them, T_C their steps and T every worker's,
        so the mean times |C| T / (M T_C) is sum_{m in C} (n_m / T_C) Delta_m. Unchanged when every worker sent."""
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
        """At a round's end (after the tick's outer exchanges): take the speeds launched a round ago for the
        round that starts, and launch this round's (measured, or elastic). Returns the real seconds blocked on
        them (0.0 on a simulated clock, whose wait is the clock's), which the caller leaves out of its overhead."""
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
        """Size the next round from a speeds vector that holds these workers' speeds (None: every worker's):
        once each of them has measured a step, theirs become H_m = max(1, round(H r_m / r_max)) over them (the
        fastest of them runs H); a worker not among them (gone, or just rejoined) keeps its H_m."""
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


def load_rounds(adaptive: AdaptiveSteps | None, saved: dict[str, Any] | None) -> None:
    """Continue the rounds of a checkpoint (``saved``: None when it was made without adaptive steps).

    Raises:
        ValueError: the checkpoint was made with --adaptive-steps and this run has it off, or the reverse.
    """
    if (saved is None) != (adaptive is None):
        was, now = ("off" if x is None else "on" for x in (saved, adaptive))
        raise ValueError(f"state was saved with --adaptive-steps {was} and this run has it {now}: resume with the "
                         "same setting")
    if saved is not None and adaptive is not None:
        adaptive.load_state_dict(saved)


__all__ = ["AdaptiveSteps", "SpeedMeter", "Weight", "load_rounds"]
