"""Compute-utilization simulator: how much of a run's wall clock each method spends computing.

Shares :mod:`eagerloco.schedule` with training, so the simulated schedule is the one that runs; the ``simulate``
subcommand is :mod:`eagerloco.sim.cli`. Nothing here imports torch.
"""

from eagerloco.sim.engine import SimResult, simulate
from eagerloco.sim.model import PRESETS, ModelSpec, SimError, Variant, default_variants, traffic
from eagerloco.sim.search import bandwidth_grid, least_bandwidth

__all__ = [
    "PRESETS",
    "ModelSpec",
    "SimError",
    "SimResult",
    "Variant",
    "bandwidth_grid",
    "default_variants",
    "least_bandwidth",
    "simulate",
    "traffic",
]
