"""The simulator beside the papers' published tables: their rows as data, ours cell by cell (``eagerloco simulate
--paper --compare-reference``).

The tables live in ``eagerloco/lab/reference/*.json``. Nothing is fitted to them; why a published cell is read as
the last grid point still below its target (:data:`PAPER_READING`) is told in docs/guides/simulator.md, from the
Streaming DiLoCo paper's own Table 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from eagerloco.config import ConfigError
from eagerloco.sim.engine import simulate
from eagerloco.sim.model import PRESETS, ModelSpec, Variant, fragment_count, traffic
from eagerloco.sim.paper import PAPER_ASSUMPTIONS, PAPER_FRAGMENT_LAYERS, PAPER_WORKERS, PRESET_MFU, paper_grid
from eagerloco.sim.search import least_bandwidth, meets
from eagerloco.units import text_table

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
REFERENCE_FILES = ("streaming_diloco_table4.json", "eager_table5.json")
PAPER_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)


def last_below(grid: np.ndarray, cu: np.ndarray, target: float) -> float | None:
    """The grid value just below the least one meeting the target (the first, if it does), or None: the papers'
    reading."""
    ok = meets(cu, target)
    if not ok.any():
        return None
    return float(grid[max(int(np.argmax(ok)) - 1, 0)])


#: How a published cell is read off the grid: "last-below" (the last grid point still under the
#: target, as the papers' Table 1 shows their tables print) or "reached" (the least one reaching it).
READINGS = {"last-below": last_below, "reached": least_bandwidth}
PAPER_READING = "last-below"


def paper_model(name: str, mfu: float = PRESET_MFU) -> ModelSpec:
    """A preset with its step time read at ``mfu`` (the presets are stated at 60%); ConfigError for a bad name or
    MFU."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {mfu}")
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


def row_cu(
    row: ReferenceRow,
    mfu: float = PRESET_MFU,
    cold_rounds: int | None = None,
    pattern: str = "strided",
    grid: np.ndarray | None = None,
) -> np.ndarray:
    """Compute utilization of one reference row at each grid bandwidth, with the paper's accounting."""
    grid = paper_grid() if grid is None else grid
    model = paper_model(row.model, mfu)
    P = fragment_count(model.layers, PAPER_FRAGMENT_LAYERS)
    tr = traffic(model, row.variant, PAPER_WORKERS, row.inner_steps, P, scale_bytes=0, pattern=pattern)
    return simulate(model, row.variant, tr, grid, 0.0, row.inner_steps, cold_rounds=cold_rounds).cu


def simulate_row(
    row: ReferenceRow,
    mfu: float = PRESET_MFU,
    cold_rounds: int | None = None,
    pattern: str = "strided",
    grid: np.ndarray | None = None,
    reading: str = "reached",
) -> list[float | None]:
    """Grid bandwidth per paper target for one reference row, read as ``reading`` says; ConfigError for another
    reading."""
    if reading not in READINGS:
        raise ConfigError(f"reading must be one of {', '.join(READINGS)}, got {reading!r}")
    grid = paper_grid() if grid is None else grid
    cu = row_cu(row, mfu, cold_rounds, pattern, grid)
    return [READINGS[reading](grid, cu, t) for t in PAPER_TARGETS]


def _summarize(summary: dict[str, Any], source: str, model: str, reads: list[dict[str, Any]]) -> None:
    """Add one row's cells (each with "grid_steps" and "ratio") to the per-source, per-model counts."""
    s = summary.setdefault(source, {}).setdefault(model, {"cells": 0, "same_point": 0, "within_1_5x": 0})
    for c in reads:
        s["cells"] += 1
        if c["grid_steps"] is not None:
            s["same_point"] += c["grid_steps"] == 0
            s["within_1_5x"] += max(c["ratio"], 1 / c["ratio"]) <= 1.5


def compare(
    mfu: float = PRESET_MFU,
    cold_rounds: int | None = None,
    pattern: str = "strided",
) -> dict[str, Any]:
    """Ours beside the papers' for every reference row and target, read as :data:`PAPER_READING` and the other way.

    A cell: the paper's value, ours (None: not reached), ours / paper, and how many grid points ours lies from the
    one nearest the paper's (0: the same point); under "other", the same for the other reading."""
    reading = PAPER_READING
    other = next(r for r in READINGS if r != reading)
    grid = paper_grid()
    rows, summary, summary_other = [], {}, {}
    for ref in load_reference():
        cu = row_cu(ref, mfu, cold_rounds, pattern, grid)
        cells = []
        for target, paper in zip(PAPER_TARGETS, ref.gbps, strict=True):
            j = nearest_grid_index(grid, paper)
            read = {}
            for name in (reading, other):
                mine = READINGS[name](grid, cu, target)
                read[name] = {"ours": mine, "ratio": None if mine is None else mine / float(grid[j]),
                              "grid_steps": None if mine is None else nearest_grid_index(grid, mine) - j}
            cells.append({"target": target, "paper": paper, **read[reading], "other": read[other]})
        rows.append({"source": ref.source, "model": ref.model, "key": ref.key, "label": ref.label,
                     "inner_steps": ref.inner_steps, "cells": cells})
        _summarize(summary, ref.source, ref.model, cells)
        _summarize(summary_other, ref.source, ref.model, [c["other"] for c in cells])
    settings = {"mfu": mfu, "cold_rounds": cold_rounds, "pattern": pattern, "reading": reading,
                "other_reading": other, "assumptions": list(PAPER_ASSUMPTIONS)}
    return {"settings": settings, "rows": rows, "summary": summary, "summary_other": summary_other}


def format_compare(report: dict[str, Any]) -> str:
    """The side-by-side table: per row and target, paper / ours and the ratio."""
    st = report["settings"]
    head = ["source", "model", "row", "H"] + [f"{100 * t:g}%" for t in PAPER_TARGETS]
    body = []
    for r in report["rows"]:
        cells = []
        for c in r["cells"]:
            ours = "-" if c["ours"] is None else f"{c['ours']:.3g}"
            ratio = "" if c["ratio"] is None else f" ({c['ratio']:.2f}x)"
            cells.append(f"{c['paper']:g} / {ours}{ratio}")
        body.append([r["source"], r["model"], r["label"], str(r["inner_steps"])] + cells)
    mode = f"cold start, {st['cold_rounds']} rounds" if st["cold_rounds"] else "steady state"
    lines = [f"paper / ours Gbit/s (ours / paper), MFU {st['mfu']:g}, {mode}, {st['pattern']} fragments, "
             f"cells read as {st['reading']}", text_table(head, body, right=()), ""]
    for key, name in (("summary", st["reading"]), ("summary_other", st["other_reading"])):
        for source, models in report[key].items():
            parts = [f"{m}: {s['same_point']}/{s['cells']} same grid point, {s['within_1_5x']}/{s['cells']} "
                     "within 1.5x" for m, s in models.items()]
            lines.append(f"{source}, read as {name}: " + "; ".join(parts))
    return "\n".join(lines)


def compare_text(mfu: float, cold_rounds: int | None, pattern: str) -> tuple[dict[str, Any], str]:
    """``eagerloco simulate --paper --compare-reference``: the report of :func:`compare` and its table."""
    report = compare(mfu, cold_rounds, pattern)
    return report, format_compare(report)
