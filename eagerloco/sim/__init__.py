"""Compute-utilization simulator: how much of a run's wall clock each method spends computing.

Shares :mod:`eagerloco.schedule` with training, so the simulated schedule is the one that runs.
Modules: ``model`` (presets, rows, payload sizes, fragments), ``engine`` (per-block event
simulation, vectorized over bandwidth), ``search`` (least bandwidth per target), ``paper`` (the
papers' accounting and their tables as reference data), ``plan`` (cheapest settings for a target),
``advice`` (the plan as commands to copy, its assumptions and measured costs), ``config`` (the
flags as a dataclass, checked and resolved into what is simulated), ``tables`` (the default mode:
every row on the grid), ``report`` (text and JSON output), ``plot`` (PNG figures), ``goodput``
(goodput under failures and stalls, all-or-nothing rounds against quorum exchanges), ``cli`` (the
``simulate`` subcommand: ``add_parser`` and ``run``). Nothing here imports torch.
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
