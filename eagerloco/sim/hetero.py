"""Workers of unequal speed in the simulator (``--worker-speeds``): each worker's compute utilization with a
fixed H and with adaptive steps (section 11 of docs/algorithms.md).

Every exchange waits for its slowest contributor, so a round lasts as long as the longest compute of it, plus
what the link adds. The one-worker engine (:func:`eagerloco.sim.engine.simulate`), run at the step time that
paces the round, max_m(H_m t_m) / H, gives the wall time per tick W (a tick: an inner step of the fastest
worker); worker m's utilization is its own compute per tick, H_m t_m / H, over W. With a fixed H every H_m is
H: the slowest worker paces the round and the others idle for the rest. With adaptive steps H_m =
max(1, round(H r_m / r_max)) and every worker's round lasts about H t_fastest, up to the rounding of H_m.
The engine overlaps an exchange with the paced worker's backward: for the workers that compute less than the
pace this is an approximation (they launch a little earlier than simulated).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from eagerloco.schedule import round_lengths
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import ModelSpec, Traffic, Variant

#: The two ways of sizing rounds, as the report names them.
MODES = ("fixed", "adaptive")


def per_worker_cu(model: ModelSpec, variant: Variant, traffic: Traffic, lanes: np.ndarray, speeds: list[float],
                  latency_ms: float, inner_steps: int, warmup_rounds: int, rounds: int,
                  cold_rounds: int | None) -> dict[str, np.ndarray]:
    """Each worker's compute utilization at each bandwidth lane, by mode (fixed H, adaptive steps; dp, with no
    rounds, has the fixed one only).

    Args:
        model: its step time is the fastest worker's.
        speeds: each worker's relative speed.
        The rest: as :func:`eagerloco.sim.engine.simulate`.

    Returns:
        {mode: array of shape (lanes, workers)}.
    """
    h = inner_steps
    fastest = max(speeds)
    times = [model.step_time * fastest / r for r in speeds]  # each worker's seconds per inner step
    out: dict[str, np.ndarray] = {}
    for mode in MODES if variant.method != "dp" else MODES[:1]:
        lengths = [h] * len(speeds) if mode == "fixed" else round_lengths(h, speeds)
        compute = np.array([n * t / h for n, t in zip(lengths, times, strict=True)])  # compute per tick
        paced = replace(model, step_time=float(compute.max()))
        res = simulate(paced, variant, traffic, lanes, latency_ms, h, warmup_rounds, rounds, cold_rounds)
        out[mode] = compute[None, :] / np.asarray(res.wall_per_step)[:, None]
    return out


__all__ = ["MODES", "per_worker_cu"]
