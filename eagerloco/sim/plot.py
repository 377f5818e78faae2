"""PNG figures of compute utilization against bandwidth, on matplotlib's Agg canvas (no pyplot, no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eagerloco.extras import require

#: What the missing-matplotlib message names.
PLOT_NEEDS = "eagerloco simulate --plot"


def plot_cu(path: Path, title: str, grid: np.ndarray, curves: Sequence[tuple[str, np.ndarray]],
            targets: Sequence[float] = ()) -> Path:
    """Draw one line per method (log x axis) with the targets as dotted guides; returns the path."""
    agg = require("matplotlib.backends.backend_agg", PLOT_NEEDS)
    fig = require("matplotlib.figure", PLOT_NEEDS).Figure(figsize=(8, 5), dpi=100)
    agg.FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    styles = ("-", "--", "-.", ":")  # methods with identical curves (e.g. eager and delayed) stay visible
    for i, (label, cu) in enumerate(curves):
        ax.plot(grid, cu, label=label, linewidth=1.6, linestyle=styles[i % len(styles)])
    for t in targets:
        ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_ylim(0.0, 1.02)
    ax.set_xlim(float(grid[0]), float(grid[-1]))
    ax.set_xlabel("bandwidth (Gbit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
