"""Event simulation of one worker's compute and its link, block by block, vectorized over bandwidths."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagerloco.schedule import SyncEvent, apply_delay, sync_events
from eagerloco.sim.model import ModelSpec, Traffic, Variant


@dataclass
class SimResult:
    """Compute utilization per bandwidth lane, measured over the steady-state or cold-start window."""

    cu: np.ndarray  # compute time / wall time
    wall_per_step: np.ndarray  # seconds of wall clock per inner step


@dataclass(frozen=True)
class StepGraph:
    """The node timing of one inner step: every node (forward, activation or weight gradient) costs one unit."""

    layers: int
    step_time: float

    @property
    def unit(self) -> float:
        """Seconds per node: a step has L forward, L - 1 activation-gradient and L weight-gradient nodes."""
        return self.step_time / (3 * self.layers - 1)

    @property
    def backward_time(self) -> float:
        return (2 * self.layers - 1) * self.unit

    def weight_grad_done(self, layer: int) -> float:
        """Seconds from the end of the forward until block ``layer``'s weight gradient exists (0-based)."""
        nodes = 2 * (self.layers - layer) - (1 if layer == 0 else 0)
        return nodes * self.unit


def seconds(nbytes: float, bandwidths: np.ndarray) -> np.ndarray:
    """Seconds to carry nbytes at each bandwidth (Gbit/s; inf carries in no time)."""
    with np.errstate(divide="ignore"):
        return np.where(np.isinf(bandwidths), 0.0, nbytes * 8.0 / (bandwidths * 1e9))


def exchanges(variant: Variant, traffic: Traffic, inner_steps: int, total_steps: int) -> list[SyncEvent]:
    """Every exchange of a run of total_steps inner steps, in launch order; its ``fragment``: the transfer of the
    period it carries (dp: a block's gradients, every step)."""
    if variant.method == "dp":
        n = len(traffic.transfers)
        return [SyncEvent(i, s, s, s) for s in range(1, total_steps + 1) for i in range(n)]
    return list(sync_events(variant.method, inner_steps, len(traffic.transfers), variant.overlap_steps,
                            variant.eager_rounds, total_steps))


def run_schedule(graph: StepGraph, traffic: Traffic, schedule: list[SyncEvent], bandwidths: np.ndarray,
                 latency_s: float, total_steps: int, mark_step: int) -> tuple[np.ndarray, np.ndarray]:
    """Simulate total_steps inner steps; returns the wall clock at the end of mark_step and of the last step.

    The graph of the Streaming DiLoCo paper (arXiv 2501.18512, section 3.1; docs/guides/simulator.md): per block a
    forward node, then the backward from the last block in two parts (activation, weight gradients; block 0 has no
    activation-gradient node), every node ``step_time / (3L - 1)``; one first-come-first-served link, latency charged
    on an exchange's first block share. A block's share goes on the link when its weight gradient of the launch step
    exists and gates only its forward in the step after the apply step. Every finish time is a max/plus of durations,
    so one numpy lane per bandwidth runs them all; steps with no launch or gate are skipped in bulk."""
    L, u = graph.layers, graph.unit
    t = graph.step_time
    # One lane (a plan's candidates, one bandwidth each) runs on Python floats: numpy's per-call cost on a
    # one-element array is tens of times a float operation's, and the loops below run once per block share (tens
    # of thousands for a large model's schedule). The arithmetic is the same IEEE doubles either way.
    one = bandwidths.size == 1
    mx = max if one else np.maximum
    share: list[Any] = [seconds(b / len(ls), bandwidths)
                        for b, ls in zip(traffic.transfers, traffic.layers, strict=True)]
    if one:
        share = [float(d[0]) for d in share]
    first_share = [d + latency_s for d in share]  # an exchange's first block share carries its latency
    grad_done = [graph.weight_grad_done(layer) for layer in range(L)]
    backward = graph.backward_time
    launch_at: dict[int, list[int]] = defaultdict(list)
    gate_at: dict[int, list[int]] = defaultdict(list)
    for n, ex in enumerate(schedule):
        launch_at[ex.launch_step].append(n)
        if ex.apply_step + 1 <= total_steps:  # the forward of the step after the apply step waits
            gate_at[ex.apply_step + 1].append(n)
    now: Any = 0.0 if one else np.zeros_like(bandwidths, dtype=float)  # end of the last simulated step
    link_free: Any = now
    at_mark = now
    finish: dict[tuple[int, int], Any] = {}
    prev = 0
    for s in sorted(set(launch_at) | set(gate_at) | {mark_step, total_steps}):
        if s < 1 or s > total_steps:
            continue
        now = now + (s - prev - 1) * t  # plain steps prev+1 .. s-1
        gates: dict[int, Any] = {}
        for n in gate_at.get(s, ()):
            for layer in traffic.layers[schedule[n].fragment]:
                done = finish.pop((n, layer))
                gates[layer] = mx(gates[layer], done) if layer in gates else done
        cursor, last = now, -1  # cursor: end of the forward node of block `last`
        for layer in sorted(gates):
            cursor = mx(cursor + (layer - last - 1) * u, gates[layer]) + u
            last = layer
        forward_end = cursor + (L - 1 - last) * u
        # In the order their weight gradients finish: the last block first, exchanges in launch order.
        started: set[int] = set()
        order = sorted((-layer, m) for m in launch_at.get(s, ()) for layer in traffic.layers[schedule[m].fragment])
        for neg_layer, n in order:
            index = schedule[n].fragment
            if n in started:
                extra = share[index]
            else:
                extra = first_share[index]
                started.add(n)
            link_free = finish[(n, -neg_layer)] = mx(forward_end + grad_done[-neg_layer], link_free) + extra
        now = forward_end + backward
        if s == mark_step:
            at_mark = now
        prev = s
    return np.full_like(bandwidths, at_mark, dtype=float), np.full_like(bandwidths, now, dtype=float)


def simulate(model: ModelSpec, variant: Variant, traffic: Traffic, bandwidths: np.ndarray | float,
             latency_ms: float = 0.0, inner_steps: int = 100, warmup_rounds: int = 8, rounds: int = 32,
             cold_rounds: int | None = None) -> SimResult:
    """Compute utilization of one variant at each bandwidth (Gbit/s, inf allowed; ``traffic``: :func:`model.traffic`).

    The steady state (``rounds`` measured after ``warmup_rounds`` plus the k rounds of delay, never above what the
    link's busy time allows), or with ``cold_rounds`` a run of that many rounds from step 0, exchanges still in flight
    at its end not waited for."""
    bw = np.atleast_1d(np.asarray(bandwidths, dtype=float))
    graph = StepGraph(model.layers, model.step_time)
    latency_s = latency_ms / 1e3
    H = inner_steps
    if variant.method == "dp":
        # The forward of block 0 waits for block 0's all-reduce, the last one queued, so every step
        # starts with an idle link: steps 2, 3, ... are identical. A cold start differs only in step 1.
        total, mark = 3, 1
    elif cold_rounds is not None:
        total, mark = cold_rounds * H, 0
    else:
        delay = apply_delay(variant.method, H, variant.overlap_steps, variant.eager_rounds)
        warm = warmup_rounds + math.ceil(delay / H)
        total, mark = (warm + rounds) * H, warm * H
    schedule = exchanges(variant, traffic, H, total)
    at_mark, end = run_schedule(graph, traffic, schedule, bw, latency_s, total, mark)
    wall = (end - at_mark) / (total - mark)
    if cold_rounds is None or variant.method == "dp":
        # The link carries every byte of a period whatever the schedule, so no steady state is faster
        # than its busy time: the exact long-run rate once a backlog grows without bound, which a
        # finite window approaches only slowly (k rounds of slack take many rounds to use up).
        busy = sum(seconds(b, bw) + latency_s for b in traffic.transfers) / traffic.period_steps
        wall = np.maximum(wall, busy)
    return SimResult(model.step_time / wall, wall)
