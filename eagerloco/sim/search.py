"""The least bandwidth that reaches a compute-utilization target, on a log-spaced grid scanned whole (the engine
is vectorized over bandwidth, so a scan costs what a bisection would and assumes nothing).
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
    """The first grid value whose utilization (``cu``, one per grid value) meets the target, or None."""
    ok = meets(cu, target)
    if not ok.any():
        return None
    return float(grid[int(np.argmax(ok))])

