"""`eagerloco compare`: a grid of methods on the same data, model, seed and budget, with its report; and
`eagerloco demo` (:mod:`.demo`).
"""

from eagerloco.lab.compare.cli import add_parser
from eagerloco.lab.compare.grid import (
    ALL_GRID,
    ENTRIES,
    PAPER_GRID,
    SWEEP_GRID,
    resolve_grid,
    tolerated_steps,
    tolerated_text,
)
from eagerloco.lab.compare.runner import plan_runs

__all__ = [
    "ALL_GRID",
    "ENTRIES",
    "PAPER_GRID",
    "SWEEP_GRID",
    "add_parser",
    "plan_runs",
    "resolve_grid",
    "tolerated_steps",
    "tolerated_text",
]
