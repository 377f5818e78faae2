"""Event simulation of one worker's compute and its link, vectorized over many bandwidths.

Model of time (ALGORITHMS.md sections 8 and 9):
- compute is one sequential stream; an inner step takes ``step_time`` (forward 1/3, backward 2/3,
  spread evenly over the blocks);
- the link carries one transfer at a time, first come first served; a transfer takes
  ``LinkConfig.transfer_seconds(bytes)`` (one latency plus bytes over bandwidth) and starts when it
  is launched or when the link frees up, whichever is later (queued transfers wait). The latency
  is charged once per exchange and holds the link, a simplification of a ring's 2(M-1) hops;
- compute blocks only when an exchange must be applied and has not landed.

Outer methods follow :func:`eagerloco.schedule.sync_events` (fragment offsets, launch and apply
steps, hence each method's tolerated window), so the simulator and the training loop share one
schedule. Data-parallel is simulated per block: block l's gradient all-reduce is launched when its
backward finishes and overlaps the backward of the blocks below; the next step starts once every
all-reduce has landed and the step's compute is done.

Every quantity is an element-wise max/plus of transfer durations, so each finish time is
non-decreasing in every duration, and the simulation runs on numpy arrays holding one lane per
bandwidth: a whole grid costs about as much as one bandwidth.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from eagerloco.config import LinkConfig
from eagerloco.schedule import apply_delay, sync_events
from eagerloco.sim.model import ModelSpec, Traffic, Variant


@dataclass
class SimResult:
    """Compute utilization per bandwidth lane, measured over the steady-state window."""

    cu: np.ndarray  # compute time / wall time
    wall_per_step: np.ndarray  # seconds of wall clock per inner step
    measured_steps: int


def durations(nbytes: float, bandwidths: np.ndarray, latency_ms: float) -> np.ndarray:
    """Seconds per transfer for every bandwidth lane; a transfer of nothing takes no time."""
    if nbytes <= 0:
        return np.zeros_like(bandwidths, dtype=float)
    link = LinkConfig(bandwidth_gbps=bandwidths, latency_ms=latency_ms)  # type: ignore[arg-type]
    return np.asarray(link.transfer_seconds(nbytes), dtype=float) + np.zeros_like(bandwidths, dtype=float)


def simulate_dp(
    model: ModelSpec, traffic: Traffic, bandwidths: np.ndarray, latency_ms: float, steps: int = 3
) -> SimResult:
    """Data-parallel at block granularity: each block's all-reduce overlaps the rest of the backward.

    Each step ends with the link idle (the next forward needs every block's averaged gradient), so
    the run is periodic from the first step; the last steps - 1 steps are measured.
    """
    t = model.step_time
    fwd = t / 3.0
    bwd_block = (2.0 * t / 3.0) / model.layers
    durs = [durations(b, bandwidths, latency_ms) for b in traffic.transfers]
    now = np.zeros_like(bandwidths, dtype=float)
    start_measure = now
    for step in range(steps):
        if step == 1:
            start_measure = now.copy()
        start = now
        link_free = start
        for j, d in enumerate(durs):  # backward runs from the last block to the first
            grad_ready = start + fwd + (j + 1) * bwd_block
            link_free = np.maximum(grad_ready, link_free) + d
        now = np.maximum(start + t, link_free)
    measured = steps - 1
    wall = (now - start_measure) / measured
    return SimResult(t / wall, wall, measured)


def simulate_outer(
    model: ModelSpec,
    variant: Variant,
    traffic: Traffic,
    bandwidths: np.ndarray,
    latency_ms: float,
    inner_steps: int,
    warmup_rounds: int = 8,
    rounds: int = 32,
) -> SimResult:
    """DiLoCo, Streaming (with tau overlap), naive delayed and eager: one step at a time in effect.

    At each step that launches exchanges they are queued on the link in fragment order; then the
    worker waits for every exchange whose apply step (launch + the method's delay) is this step.
    Compute utilization is measured over the last ``rounds`` rounds, after ``warmup_rounds`` rounds
    (plus the method's k rounds) of start-up, and never exceeds what the link's busy time per round
    allows, so a backlog that grows without bound lowers the result instead of hiding in the slack
    of the first rounds.
    """
    t = model.step_time
    H = inner_steps
    P = len(traffic.transfers)
    warm = warmup_rounds + apply_delay(variant.method, H, variant.overlap_steps, variant.eager_rounds) // H
    total = (warm + rounds) * H
    durs = [durations(b, bandwidths, latency_ms) for b in traffic.transfers]
    events = list(sync_events(variant.method, H, P, variant.overlap_steps, variant.eager_rounds, total))
    launches: dict[int, list[int]] = defaultdict(list)
    applies: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        launches[e.launch_step].append(i)
        if e.apply_step <= total:
            applies[e.apply_step].append(i)
    mark = warm * H
    now = np.zeros_like(bandwidths, dtype=float)
    link_free = now
    start_measure = now
    finish: dict[int, np.ndarray] = {}
    prev = 0
    for s in sorted(set(launches) | set(applies) | {mark, total}):
        now = now + (s - prev) * t  # inner steps prev+1 .. s
        prev = s
        for i in launches.get(s, ()):
            link_free = np.maximum(now, link_free) + durs[events[i].fragment]
            finish[i] = link_free
        for i in applies.get(s, ()):
            now = np.maximum(now, finish.pop(i))
        if s == mark:
            start_measure = now
    measured = total - mark
    # The link carries every byte of a round whatever the schedule, so no run can be faster than
    # its busy time: this is the exact long-run rate once a backlog grows without bound, which a
    # finite window approaches only slowly (k rounds of slack take many rounds to use up).
    link_bound = sum(durs) / H
    wall = np.maximum((now - start_measure) / measured, link_bound)
    return SimResult(t / wall, wall, measured)


def simulate(
    model: ModelSpec,
    variant: Variant,
    traffic: Traffic,
    bandwidths: np.ndarray | float,
    latency_ms: float = 0.0,
    inner_steps: int = 100,
    warmup_rounds: int = 8,
    rounds: int = 32,
) -> SimResult:
    """Compute utilization of one variant at each bandwidth (Gbit/s, inf allowed)."""
    bw = np.atleast_1d(np.asarray(bandwidths, dtype=float))
    if variant.method == "dp":
        return simulate_dp(model, traffic, bw, latency_ms)
    return simulate_outer(model, variant, traffic, bw, latency_ms, inner_steps, warmup_rounds, rounds)
