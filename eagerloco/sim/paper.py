"""The papers' accounting as a preset of ``eagerloco simulate --paper``; their published tables, and ours beside
them, are the lab's (:mod:`eagerloco.lab.sim_reference`)."""

from __future__ import annotations

import numpy as np

#: MFU at which the presets' step times (0.1 / 0.8 / 4.9 s) are stated (the tables' captions).
PRESET_MFU = 0.6
PAPER_WORKERS = 2
PAPER_FRAGMENT_LAYERS = 3

PAPER_ASSUMPTIONS: tuple[str, ...] = (
    "outer gradients not quantized are 16-bit, data-parallel gradients too",
    "FP4 is 4 bits a value with no scale bytes (Table 1's 400x = H x 16 / 4)",
    f"M = {PAPER_WORKERS} workers, ring all-reduce: 2(M-1)/M of the payload per worker",
    "no latency",
    "step times 0.1 / 0.8 / 4.9 s for 1B / 10B / 100B at 60% MFU (Table 4's caption; the paper's Table 1, "
    "Data-Parallel 109 h with 1 Gbit/s for 0.67 h of compute, fits these), scaled by 0.6 / --mfu",
    f"fragments of {PAPER_FRAGMENT_LAYERS} layers, H = 100 unless a row says otherwise",
    "bandwidth grid numpy.logspace(-1, 3, 50) Gbit/s",
    "--compare-reference reads a published cell as the last grid point still below the target (one under "
    "the least reaching it): the paper's Table 1 gives its 1B overlapped-FP4 row 0.88 h with 1 Gbit/s for "
    "0.67 h of compute (utilization 0.76) where Table 4 prints 0.9 Gbit/s for 80%",
)


def paper_grid() -> np.ndarray:
    """The papers' bandwidth grid: 50 log-spaced points from 0.1 to 1000 Gbit/s."""
    return np.logspace(-1, 3, 50)
