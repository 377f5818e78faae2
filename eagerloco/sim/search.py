"""The least bandwidth that reaches a compute-utilization target, on a log-spaced grid.

The whole grid is simulated at once (the engine is vectorized over bandwidth), so a scan costs
no more than a bisection would and needs no assumption beyond what it checks: the answer is the
first grid value whose utilization meets the target. :func:`last_below` reads the same scan the
way the papers' tables print it (one grid point lower; see :mod:`eagerloco.sim.paper`).
"""

from __future__ import annotations

import math

import numpy as np

#: Relative slack when comparing a utilization with a target: a schedule that hides every
#: transfer computes exactly 1.0 only up to float rounding of sums of step times.
CU_RTOL = 1e-12


def bandwidth_grid(bw_min: float, bw_max: float, per_decade: int) -> np.ndarray:
    """Log-spaced bandwidths (Gbit/s) from bw_min to bw_max, per_decade points per factor of 10."""
    decades = math.log10(bw_max) - math.log10(bw_min)
    n = max(2, int(math.ceil(decades * per_decade - 1e-9)) + 1)
    return np.logspace(math.log10(bw_min), math.log10(bw_max), n)


def meets(cu: np.ndarray | float, target: float) -> np.ndarray:
    return np.asarray(cu) >= target * (1.0 - CU_RTOL)


def least_bandwidth(grid: np.ndarray, cu: np.ndarray, target: float) -> float | None:
    """The least grid value whose utilization meets the target, or None if none does.

    cu must be the utilization at each grid value (non-decreasing in bandwidth); the first grid
    index that meets the target is returned even if a later one were to dip, so the result is
    always "the least grid value that meets the target".
    """
    ok = meets(cu, target)
    if not ok.any():
        return None
    return float(grid[int(np.argmax(ok))])


def last_below(grid: np.ndarray, cu: np.ndarray, target: float) -> float | None:
    """The grid value just below the least one that meets the target, or None if none meets it.

    The last bandwidth of the scan whose utilization is still under the target; the first grid
    value itself when it already meets the target (nothing lies below it on the grid).
    """
    ok = meets(cu, target)
    if not ok.any():
        return None
    return float(grid[max(int(np.argmax(ok)) - 1, 0)])
