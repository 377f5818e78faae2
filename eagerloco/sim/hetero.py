"""Workers of unequal speed in the simulator (``--worker-speeds``): each worker's compute utilization with a
fixed H and with adaptive steps (docs/algorithms.md section 11).

A round lasts as long as its slowest compute plus what the link adds: the one-worker engine, run at the pacing
step time max_m(H_m t_m) / H, gives the wall time per tick W, and worker m's utilization is H_m t_m / H over W.
The paced worker's overlap of exchange and backward stands for every worker's (an approximation for the others).
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
    """Each worker's compute utilization per bandwidth lane, {mode: array (lanes, workers)} (dp: fixed only).

    ``model``'s step time is the fastest worker's, ``speeds`` each worker's relative speed; the rest as
    :func:`eagerloco.sim.engine.simulate`."""
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
