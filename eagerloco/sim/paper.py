"""The papers' accounting as a preset, their published tables as data, and ours beside them.

Reference tables live in ``eagerloco/sim/reference/*.json``, each naming the paper and table it
comes from. :func:`compare` simulates every reference row with the papers' assumptions
(:data:`PAPER_ASSUMPTIONS`) on the papers' bandwidth grid, numpy.logspace(-1, 3, 50), and returns
ours beside theirs per cell. Nothing here is fitted to the tables: the only free setting is the
MFU reading (``mfu``), applied to every row alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from eagerloco.sim.engine import simulate
from eagerloco.sim.model import PRESETS, ModelSpec, SimError, Variant, fragment_count, traffic
from eagerloco.sim.search import least_bandwidth

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
REFERENCE_FILES = ("streaming_diloco_table4.json", "eager_table5.json")

#: MFU at which the presets' step times (0.1 / 0.8 / 4.9 s) are stated (the tables' captions).
PRESET_MFU = 0.6
PAPER_WORKERS = 2
PAPER_BITS = 16  # outer gradients (and data-parallel gradients) not quantized: bf16
PAPER_LOW_BITS = 4  # FP4 exchange: 4 bits a value, no scale bytes (Table 1's 400x = H * 16 / 4)
PAPER_FRAGMENT_LAYERS = 3
PAPER_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)

PAPER_ASSUMPTIONS: tuple[str, ...] = (
    "outer gradients not quantized are 16-bit, data-parallel gradients too",
    "FP4 is 4 bits a value with no scale bytes (Table 1's 400x = H x 16 / 4)",
    f"M = {PAPER_WORKERS} workers, ring all-reduce: 2(M-1)/M of the payload per worker",
    "no latency",
    "step times 0.1 / 0.8 / 4.9 s for 1B / 10B / 100B at 60% MFU, scaled by 0.6 / --mfu",
    f"fragments of {PAPER_FRAGMENT_LAYERS} layers, H = 100 unless a row says otherwise",
    "bandwidth grid numpy.logspace(-1, 3, 50) Gbit/s",
)


def paper_grid() -> np.ndarray:
    """The papers' bandwidth grid: 50 log-spaced points from 0.1 to 1000 Gbit/s."""
    return np.logspace(-1, 3, 50)


def paper_model(name: str, mfu: float = PRESET_MFU) -> ModelSpec:
    """A preset with its step time read at the given MFU (the presets are stated at 60%).

    Raises:
        SimError: unknown preset or MFU outside (0, 1].
    """
    if name not in PRESETS:
        raise SimError(f"--model: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    if not 0 < mfu <= 1:
        raise SimError(f"--mfu must be in (0, 1], got {mfu}")
    model = PRESETS[name]
    if mfu == PRESET_MFU:
        return model
    return replace(model, step_time=model.step_time * PRESET_MFU / mfu)


@dataclass(frozen=True)
class ReferenceRow:
    """One published row: the method's settings and the Gbit/s it needs per target."""

    source: str  # "<table>, arXiv <id>"
    model: str
    key: str
    label: str
    variant: Variant
    inner_steps: int
    gbps: tuple[float, ...]


def load_reference(names: tuple[str, ...] = REFERENCE_FILES) -> list[ReferenceRow]:
    """Every row of the shipped reference tables, in file order."""
    rows = []
    for name in names:
        doc = json.loads((REFERENCE_DIR / name).read_text())
        source = f"{doc['table']}, arXiv {doc['arxiv']}"
        for r in doc["rows"]:
            v = Variant(
                r["key"], r["label"], r["method"], int(r["bits"]), bool(r["fragmented"]),
                int(r["overlap_steps"]), int(r["eager_rounds"]),
            )
            rows.append(ReferenceRow(source, r["model"], r["key"], r["label"], v, int(r["inner_steps"]),
                                     tuple(float(x) for x in r["gbps"])))
    return rows


def nearest_grid_index(grid: np.ndarray, value: float) -> int:
    """Index of the grid point nearest to value in log scale (printed values are rounded)."""
    return int(np.argmin(np.abs(np.log(grid) - math.log(value))))


def simulate_row(
    row: ReferenceRow,
    mfu: float = PRESET_MFU,
    cold_rounds: int | None = None,
    pattern: str = "strided",
    grid: np.ndarray | None = None,
) -> list[float | None]:
    """Least grid bandwidth reaching each paper target for one reference row, with the paper's accounting."""
    grid = paper_grid() if grid is None else grid
    model = paper_model(row.model, mfu)
    P = fragment_count(model.layers, PAPER_FRAGMENT_LAYERS)
    tr = traffic(model, row.variant, PAPER_WORKERS, row.inner_steps, P, scale_bytes=0, pattern=pattern)
    cu = simulate(model, row.variant, tr, grid, 0.0, row.inner_steps, cold_rounds=cold_rounds).cu
    return [least_bandwidth(grid, cu, t) for t in PAPER_TARGETS]


def compare(
    mfu: float = PRESET_MFU, cold_rounds: int | None = None, pattern: str = "strided"
) -> dict[str, Any]:
    """Ours beside the papers' for every reference row and target, with per-cell ratios.

    Each cell holds the paper's value, ours (None: not reached on the grid), ours / paper, and
    the distance in grid points between ours and the grid point nearest the paper's printed value
    (0: the same point, within the grid's 1.21x; 1 or 2: within 1.46x).

    Returns:
        {"settings", "rows": [...], "summary": {source: {model: counts}}}.
    """
    grid = paper_grid()
    rows, summary = [], {}
    for ref in load_reference():
        ours = simulate_row(ref, mfu, cold_rounds, pattern, grid)
        cells = []
        for target, paper, mine in zip(PAPER_TARGETS, ref.gbps, ours, strict=True):
            j = nearest_grid_index(grid, paper)
            steps = None if mine is None else nearest_grid_index(grid, mine) - j
            cells.append({"target": target, "paper": paper, "ours": mine,
                          "ratio": None if mine is None else mine / float(grid[j]), "grid_steps": steps})
        rows.append({"source": ref.source, "model": ref.model, "key": ref.key, "label": ref.label,
                     "inner_steps": ref.inner_steps, "cells": cells})
        s = summary.setdefault(ref.source, {}).setdefault(ref.model, {"cells": 0, "same_point": 0, "within_1_5x": 0})
        for c in cells:
            s["cells"] += 1
            if c["grid_steps"] is not None:
                s["same_point"] += c["grid_steps"] == 0
                s["within_1_5x"] += c["ratio"] is not None and max(c["ratio"], 1 / c["ratio"]) <= 1.5
    settings = {"mfu": mfu, "cold_rounds": cold_rounds, "pattern": pattern, "assumptions": list(PAPER_ASSUMPTIONS)}
    return {"settings": settings, "rows": rows, "summary": summary}


def format_compare(report: dict[str, Any], markdown: bool = False) -> str:
    """The side-by-side table: per row and target, paper / ours and the ratio."""
    st = report["settings"]
    head = ["source", "model", "row", "H"] + [f"{100 * t:g}%" for t in PAPER_TARGETS]
    lines = []
    body = []
    for r in report["rows"]:
        cells = []
        for c in r["cells"]:
            ours = "-" if c["ours"] is None else f"{c['ours']:.3g}"
            ratio = "" if c["ratio"] is None else f" ({c['ratio']:.2f}x)"
            cells.append(f"{c['paper']:g} / {ours}{ratio}")
        body.append([r["source"], r["model"], r["label"], str(r["inner_steps"])] + cells)
    mode = f"cold start, {st['cold_rounds']} rounds" if st["cold_rounds"] else "steady state"
    lines.append(f"paper / ours Gbit/s (ours / paper), MFU {st['mfu']:g}, {mode}, {st['pattern']} fragments")
    if markdown:
        lines.append("")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(b) + " |" for b in body]
    else:
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        for n, x in enumerate([head, *body]):
            lines.append("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    for source, models in report["summary"].items():
        parts = [f"{m}: {s['same_point']}/{s['cells']} same grid point, {s['within_1_5x']}/{s['cells']} within 1.5x"
                 for m, s in models.items()]
        lines.append(f"{source}: " + "; ".join(parts))
    return "\n".join(lines)
