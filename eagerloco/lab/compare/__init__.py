"""`eagerloco compare`: a grid of methods on the same data, model, seed and budget, with its report.

:mod:`.grid` holds the grids as data, :mod:`.runner` plans and trains the runs, :mod:`.report`
writes the table and plots, :mod:`.cli` is the command. :mod:`.demo` is `eagerloco demo`, at the
settings :mod:`.reference` ships from the committed seeded comparison.
"""

from eagerloco.lab.compare.cli import add_parser, run
from eagerloco.lab.compare.grid import (
    ALL_GRID,
    ENTRIES,
    PAPER_GRID,
    SWEEP_GRID,
    GridEntry,
    resolve_grid,
    tolerated_steps,
    tolerated_text,
)
from eagerloco.lab.compare.runner import plan_runs, run_plans

__all__ = [
    "ALL_GRID",
    "ENTRIES",
    "PAPER_GRID",
    "SWEEP_GRID",
    "GridEntry",
    "add_parser",
    "plan_runs",
    "resolve_grid",
    "run",
    "run_plans",
    "tolerated_steps",
    "tolerated_text",
]
