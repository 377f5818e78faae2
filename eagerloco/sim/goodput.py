"""Goodput under failures and stalls, per method, with all-or-nothing rounds and with quorum exchanges.

Goodput = compute merged / the workers' available time (M x the wall clock); the model and its assumptions are
docs/algorithms.md section 12.9. Rounds with no event and no late worker are counted in bulk, so 10,000 workers
and a day of rounds take seconds. Nothing here imports torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eagerloco.config import ConfigError, OuterConfig, setting
from eagerloco.config.checks import check_int_at_least
from eagerloco.config.outer import GRACE_WINDOW, auto_grace
from eagerloco.flags import FromFlags
from eagerloco.sim.config import Settings, number_list
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import Variant, traffic

#: Decoupled DiLoCo's published figures (arXiv 2604.21428), set beside ours.
PUBLISHED = {
    "source": "Decoupled DiLoCo, arXiv 2604.21428",
    "chips": 1.2e6,
    "goodput": {"Decoupled DiLoCo (quorum, grace window, token weighting)": 0.88, "data-parallel": 0.27},
    "assumptions": (
        "not found: the searchable copies of the paper give the headline (88% against 27%, simulated "
        "millions of chips under high failure rates) but not the per-chip failure rate, restart time, "
        "learner count or round length behind it, so the two tables cannot be matched cell for cell"
    ),
}


@dataclass
class GoodputConfig(FromFlags):
    """The flags of ``eagerloco simulate --goodput`` (the model, --inner-steps, --method, --overlap-steps,
    --eager-rounds and --bandwidth-gbps come from the simulate flags)."""

    goodput: bool = setting(False, group="goodput")
    """Report goodput under failures and stalls per method, all-or-nothing rounds against quorum exchanges."""
    goodput_workers: str = setting("8,100,1000,10000", group="goodput")
    """Comma list of worker counts M, one table row each."""
    mtbf_hours: float = setting(720.0, group="goodput")
    """Mean time between failures of one worker, in hours of its compute (inf: none)."""
    restart_seconds: float = setting(600.0, group="goodput")
    """Seconds a failed worker is down before it computes again (it recovers the state from its peers)."""
    stalls_per_hour: float = setting(0.01, group="goodput")
    """Stalls per worker per hour of compute (preemption, a filesystem hiccup, a congested uplink)."""
    stall_seconds: float = setting(60.0, group="goodput")
    """Length of one stall, in seconds."""
    quorum_share: float = setting(0.9, group="goodput")
    """Q = ceil(this * M): contributions that close an exchange once the grace window has passed."""
    grace: str = setting("auto", group="goodput")
    """Grace window in seconds after the Q-th contribution, or auto (docs/algorithms.md section 12.2)."""
    max_late_rounds: int = setting(1, group="goodput")
    """S: a contribution may join at most this many rounds after its own; staler ones are dropped."""
    run_hours: float = setting(24.0, group="goodput")
    """Simulated wall clock of a fault-free run, in hours."""
    seed: int = setting(0, group="goodput")
    """Seed of the failure and stall draws."""

    def check(self) -> tuple[list[int], float | None]:
        """The worker counts and the grace (None: auto); ConfigError naming the first bad flag."""
        counts = number_list("--goodput-workers", self.goodput_workers, int, 1)
        for flag, v in (("--mtbf-hours", self.mtbf_hours), ("--run-hours", self.run_hours)):
            if math.isnan(v) or v <= 0:
                raise ConfigError(f"{flag} must be a positive number of hours, got {v}")
        for flag, v in (("--restart-seconds", self.restart_seconds), ("--stalls-per-hour", self.stalls_per_hour),
                        ("--stall-seconds", self.stall_seconds)):
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"{flag} must be a finite number >= 0, got {v}")
        if not 0 < self.quorum_share <= 1:
            raise ConfigError(f"--quorum-share must be in (0, 1] (1: all-or-nothing), got {self.quorum_share}")
        check_int_at_least("max_late_rounds", self.max_late_rounds, 0)
        return counts, OuterConfig(grace=self.grace).grace_seconds()  # train's --grace, read as train reads it


@dataclass(frozen=True)
class Timing:
    """One method's barriers: a round's fault-free wall time, its compute, the lateness it absorbs."""

    period: float
    compute: float
    slack: float = 0.0
    span: int = 1  # barriers per outer round: a Streaming fragment's contribution is due again P barriers later


def method_timing(method: str, step_time: float, cu: float, inner_steps: int, fragments: int, tau: int,
                  k: int) -> Timing:
    """The barriers of each method: dp every step, DiLoCo every H, Streaming every H/P, eager every H."""
    if method == "dp":
        return Timing(step_time / cu, step_time)
    if method == "streaming":
        compute = inner_steps * step_time / fragments
        return Timing(compute / cu, compute, tau * step_time, fragments)
    compute = inner_steps * step_time
    slack = k * compute if method in ("delayed", "eager") else 0.0
    return Timing(compute / cu, compute, slack)


@dataclass(frozen=True)
class Faults:
    """Failure and stall rates of every worker."""

    mtbf_s: float = math.inf
    restart_s: float = 0.0
    stall_rate: float = 0.0  # per second of compute
    stall_s: float = 0.0


#: Per round with an event: worker -> (delay in seconds, the time into the round it failed at, or None).
Events = dict[int, dict[int, tuple[float, float | None]]]


def draw_events(faults: Faults, workers: int, rounds: int, period: float, seed: int) -> Events:
    """Stalls and failures as Poisson events over workers x rounds, each round ``period`` long."""
    rng = np.random.default_rng(seed)
    exposure = workers * rounds * period
    events: Events = {}
    n_stall = int(rng.poisson(exposure * faults.stall_rate))
    for r, w in zip(rng.integers(rounds, size=n_stall).tolist(), rng.integers(workers, size=n_stall).tolist(),
                    strict=True):
        delay, fail = events.setdefault(r, {}).get(w, (0.0, None))
        events[r][w] = (delay + faults.stall_s, fail)
    n_fail = int(rng.poisson(exposure / faults.mtbf_s)) if math.isfinite(faults.mtbf_s) else 0
    for r, w, u in zip(rng.integers(rounds, size=n_fail).tolist(), rng.integers(workers, size=n_fail).tolist(),
                       rng.random(n_fail).tolist(), strict=True):
        delay, fail = events.setdefault(r, {}).get(w, (0.0, None))
        events[r][w] = (delay, u * period if fail is None else fail)
    return events


@dataclass
class Outcome:
    """What a simulated run merged and lost, in seconds of worker time."""

    goodput: float
    wall: float
    good: float
    late_merged: int = 0  # contributions merged one or more rounds after their own
    dropped: int = 0  # contributions staler than the bound (each one a log line in training)
    graces: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"goodput": self.goodput, "wall_s": self.wall, "late_merged": self.late_merged,
                "dropped": self.dropped}


def play_rounds(events: Events, workers: int, rounds: int, t: Timing, restart_s: float, quorum: int,
                grace: float | None, max_late: int) -> Outcome:
    """Play the rounds, closing each exchange by the rules of docs/algorithms.md section 12; count the merged compute.

    ``quorum == workers`` is all-or-nothing: everyone waits, a failed worker redoes its round. Below it a round closes
    at min(last arrival, Q-th arrival + grace); a late contribution is merged when it arrives (at most ``max_late``
    rounds late, else dropped) and its worker runs a shorter round; a failed worker loses its round's work."""
    share = t.compute / t.period  # compute per second of a round's wall time
    late: dict[int, tuple[float, float, int]] = {}  # worker -> (free at, into the next round; pending; age)
    spreads: deque[float] = deque(maxlen=GRACE_WINDOW)  # auto grace: the first exchanges are all-or-nothing
    out = Outcome(0.0, 0.0, 0.0)
    done = 0
    for r in [*sorted(events), rounds]:  # each round with an event, then the end of the run
        quiet = r - done  # rounds before this one with no event and, once the late ones are played, no one late
        while late and quiet > 0:
            _round(out, {}, late, workers, t, share, restart_s, quorum, grace, max_late, spreads)
            quiet -= 1
        out.wall += quiet * t.period
        out.good += quiet * workers * t.compute
        if r == rounds:
            break
        spreads.extend([0.0] * min(quiet, GRACE_WINDOW))
        _round(out, events[r], late, workers, t, share, restart_s, quorum, grace, max_late, spreads)
        done = r + 1
    out.goodput = out.good / (workers * out.wall) if out.wall > 0 else 0.0
    return out


def _round(out: Outcome, ev: dict[int, tuple[float, float | None]], late: dict[int, tuple[float, float, int]],
           workers: int, t: Timing, share: float, restart_s: float, quorum: int, grace: float | None,
           max_late: int, spreads: deque[float]) -> None:
    """One exchange: the arrivals of the workers with an event or still late, its close, what it merges."""
    aon = quorum >= workers
    arrive: dict[int, float] = {}  # finite arrival times of the special workers
    work: dict[int, float] = {}  # compute in their contribution of this round
    back: dict[int, float] = {}  # failed workers: when they can compute again (from this round's start)
    for w in set(ev) | set(late):
        delay, fail = ev.get(w, (0.0, None))
        free, _, _ = late.get(w, (0.0, 0.0, 0))
        if aon:  # nobody is ever late: a failed worker restarts and redoes its round while everyone waits
            lost = fail + restart_s if fail is not None else 0.0
            arrive[w], work[w] = t.period + max(0.0, delay + lost - t.slack), t.compute
        elif fail is not None:  # its round's work is lost; back restart_s later, into a shorter window
            back[w] = max(free, fail) + restart_s
        elif free < t.period:  # catches up: a shorter round, ending when the others' does
            arrive[w], work[w] = t.period + max(0.0, delay - t.slack), (t.period - free) * share
        else:
            back[w] = free + delay  # still finishing its late contribution
    normal = workers - len(arrive) - len(back)
    times = sorted(arrive.values())
    last = max(times[-1] if times else t.period, t.period)
    if aon or normal + len(times) <= quorum:
        close = last
    else:
        q = quorum - normal  # the Q-th arrival: normal workers arrive at t.period, first
        qth = t.period if q <= 0 else times[q - 1]
        half = math.ceil(quorum / 2) - normal
        measured = len(spreads) == GRACE_WINDOW
        spreads.append(qth - (t.period if half <= 0 else times[half - 1]))
        if grace is None and not measured:
            close = last
        else:
            g = grace if grace is not None else auto_grace(spreads, t.compute)
            out.graces.append(g)
            close = min(last, qth + g)
    out.wall += close
    out.good += normal * t.compute
    for w in set(ev) | set(late):
        free, pending, age = late.pop(w, (0.0, 0.0, 0))
        failed = ev.get(w, (0.0, None))[1] is not None
        if pending and free < t.period:  # a late contribution that arrived during this round: merged at its close
            out.good += pending
            out.late_merged += 1
            pending = 0.0
        if w in back:
            if pending and (failed or age + 1 > max_late * t.span):  # lost in the failure, or too stale: dropped
                out.dropped += 1
                pending = 0.0
            late[w] = (max(0.0, back[w] - close), pending, age + 1 if pending else 0)
        elif arrive[w] <= close:
            out.good += work[w]
        elif max_late < 1:  # missed its round, and no lateness is allowed
            out.dropped += 1
            late[w] = (arrive[w] - close, 0.0, 0)
        else:  # missed this round: merged into its next one
            late[w] = (arrive[w] - close, work[w], 1)
    for w in [w for w, (free, pending, _) in late.items() if free <= 0 and not pending]:
        del late[w]


def format_goodput(rep: dict[str, Any]) -> str:
    """The goodput tables as text, with the published figures and their assumptions under them."""
    s = rep["settings"]
    lines = [f"goodput: MTBF {s['mtbf_hours']:g} h per worker, restart {s['restart_seconds']:g} s, "
             f"{s['stalls_per_hour']:g} stalls of {s['stall_seconds']:g} s per worker-hour; quorum "
             f"{s['quorum_share']:g} of M, grace {s['grace']}, at most {s['max_late_rounds']} round(s) late; "
             f"{s['run_hours']:g} h, seed {s['seed']}"]
    for table in rep["goodput"]:
        m = table["model"]
        lines += ["", f"{m['name']}: step {m['step_time']:g} s, H={s['inner_steps']}, P={table['fragments']}, "
                      f"tau={s['overlap_steps']}, k={s['eager_rounds']}",
                  f"{'M':>6} {'method':<10} {'CU':>6} {'all-or-nothing':>15} {'quorum':>8} {'Q':>6} "
                  f"{'late':>7} {'dropped':>7}"]
        for r in table["rows"]:
            q = r["quorum_exchange"]
            lines.append(f"{r['workers']:>6} {r['method']:<10} {r['cu']:>6.3f} {r['all_or_nothing']['goodput']:>15.3f} "
                         f"{q['goodput']:>8.3f} {r['quorum']:>6} {q['late_merged']:>7} {q['dropped']:>7}")
    pub = rep["published"]
    lines += ["", f"published ({pub['source']}, {pub['chips']:.2g} chips): "
              + ", ".join(f"{k} {v:.0%}" for k, v in pub["goodput"].items()),
              f"their assumptions: {pub['assumptions']}"]
    return "\n".join(lines)


def goodput_report(cfg: GoodputConfig, s: Settings) -> dict[str, Any]:
    """Goodput of every (model, M, method) of the resolved simulate settings, all-or-nothing against quorum: the first
    row of each method at H, the first tau and k, its fault-free CU at the first --bandwidth-gbps (1 without one)."""
    c = s.cfg
    rows: dict[str, Variant] = {}
    for v in s.variants:  # the first row of each method, a Streaming row with overlap before one without
        first = rows.get(v.method)
        if first is None or (v.method == "streaming" and not first.overlap_steps and v.overlap_steps
                             and v.bits == first.bits):
            rows[v.method] = v
    stream, eager = rows.get("streaming"), rows.get("eager", rows.get("delayed"))
    tau = stream.overlap_steps if stream is not None else 0
    k = eager.eager_rounds if eager is not None else 1
    counts, grace = cfg.check()
    faults = Faults(cfg.mtbf_hours * 3600, cfg.restart_seconds, cfg.stalls_per_hour / 3600, cfg.stall_seconds)
    link = s.bandwidths[0] if s.bandwidths and not math.isinf(s.bandwidths[0]) else None
    tables = []
    for model in s.models:
        P = s.fragments_for(model)
        table = []
        for M in counts:
            Q = math.ceil(cfg.quorum_share * M)
            for method, v in rows.items():
                cu = 1.0
                if link is not None:
                    tr = traffic(model, v, M, c.inner_steps, P, c.codec_block, s.scale_bytes, c.transport,
                                 c.fragment_pattern)
                    cu = float(simulate(model, v, tr, link, c.latency_ms, c.inner_steps).cu[0])
                t = method_timing(method, model.step_time, cu, c.inner_steps, P, tau, k)
                rounds = max(1, round(cfg.run_hours * 3600 / t.period))
                events = draw_events(faults, M, rounds, t.period, cfg.seed)
                aon = play_rounds(events, M, rounds, t, faults.restart_s, M, grace, cfg.max_late_rounds)
                quo = play_rounds(events, M, rounds, t, faults.restart_s, Q, grace, cfg.max_late_rounds)
                row = {"workers": M, "method": method, "quorum": Q, "rounds": rounds, "round_s": t.period,
                       "cu": t.compute / t.period, "all_or_nothing": aon.as_dict(), "quorum_exchange": quo.as_dict()}
                if quo.graces:
                    row["quorum_exchange"]["grace_s_median"] = statistics.median(quo.graces)
                table.append(row)
        tables.append({"model": asdict(model), "fragments": P, "rows": table})
    return {"goodput": tables, "settings": {f: getattr(cfg, f) for f in (
        "mtbf_hours", "restart_seconds", "stalls_per_hour", "stall_seconds", "quorum_share", "grace",
        "max_late_rounds", "run_hours", "seed")} | {"inner_steps": c.inner_steps, "overlap_steps": tau,
                                                    "eager_rounds": k}, "published": PUBLISHED}
