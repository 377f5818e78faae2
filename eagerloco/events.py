"""Points of a run that code outside the loop can watch: each completed inner step, each evaluation (the
project's fault injection kills a worker at a known step through these).
"""

from __future__ import annotations

from collections.abc import Callable

StepWatcher = Callable[[int, int], None]
EvalWatcher = Callable[[int], None]
_step_watchers: list[StepWatcher] = []
_eval_watchers: list[EvalWatcher] = []


def on_inner_step(fn: StepWatcher) -> Callable[[], None]:
    """Call ``fn(worker, step)`` after each inner step of a worker of this process; returns what stops the calls."""
    _step_watchers.append(fn)
    return lambda: _step_watchers.remove(fn) if fn in _step_watchers else None


def on_evaluation(fn: EvalWatcher) -> Callable[[], None]:
    """Call ``fn(step)`` on the evaluating process after each evaluation; returns what stops the calls."""
    _eval_watchers.append(fn)
    return lambda: _eval_watchers.remove(fn) if fn in _eval_watchers else None


def inner_step_done(worker: int, step: int) -> None:
    """Announce that ``worker`` (of this process) completed inner step ``step``."""
    for fn in list(_step_watchers):
        fn(worker, step)


def evaluation_done(step: int) -> None:
    """Announce, on the evaluating process, that the evaluation at ``step`` is done."""
    for fn in list(_eval_watchers):
        fn(step)
