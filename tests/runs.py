"""Runs of the trainer for the tests: a launch from this process, or a whole run in it.

``launch_here`` calls :func:`eagerloco.launch.launch` (what ``eagerloco launch`` runs after parsing
its flags) in a thread of the test process: the ranks are real processes, the launcher is not one
more (it would import torch once more, seconds on 2 cores). ``train_here`` runs ``eagerloco train``
in this process, for runs that need no process of their own. Both answer like ``subprocess.run``.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from subprocess import CompletedProcess
from typing import Any

from eagerloco.cli import main
from eagerloco.launch import launch

# What a launched rank or an earlier launch may have left in this process's environment.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER", "EAGERLOCO_REJOIN", "EAGERLOCO_FAULT_KILL")


@contextlib.contextmanager
def environment(extra: dict[str, str] | None) -> Iterator[None]:
    """os.environ without the torchrun variables, plus extra, for the duration (the ranks inherit it)."""
    saved = dict(os.environ)
    for k in DIST_ENV:
        os.environ.pop(k, None)
    os.environ.update(extra or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch_here(argv: Sequence[str], workers: int, ranks_per_worker: int = 1, env: dict[str, str] | None = None,
                timeout: float = 240.0, **kwargs: object) -> CompletedProcess:
    """launch(argv, workers, ranks_per_worker, **kwargs) with the ranks' output (prefixed "[rank N] ")
    as stdout; a launch still running after timeout fails the test instead of stalling the suite."""
    buf = io.StringIO()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["rc"] = launch(list(argv), workers, ranks_per_worker, out=buf, **kwargs)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e

    with environment(env):
        t = threading.Thread(target=run, name="launch", daemon=True)
        t.start()
        t.join(timeout)
    assert not t.is_alive(), f"launch() did not return within {timeout} s:\n{buf.getvalue()[-4000:]}"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return CompletedProcess(["launch", *argv], int(box["rc"]), buf.getvalue(), "")  # type: ignore[call-overload]


def train_here(argv: Sequence[str]) -> CompletedProcess:
    """`eagerloco train ARGV` in this process (one thread, as every test), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with environment(None), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["train", *argv])
    return CompletedProcess(["train", *argv], rc, out.getvalue(), err.getvalue())


class Interrupted(Exception):
    """Stands for the process dying right after a checkpoint was published."""


def stop_after_checkpoint(monkeypatch: Any, step: int, run: Callable[[], object]) -> None:
    """Call ``run`` (a training run in this process) and stop it right after it publishes the checkpoint of
    ``step``, as if the process died there; raises unless it got that far. The patch is undone afterwards
    (``monkeypatch.undo()``: every patch of the test)."""
    import pytest

    from eagerloco import checkpoint as ckpt

    publish = ckpt.publish

    def publish_then_stop(root: Any, at: int, *args: Any, **kwargs: Any) -> Any:
        path = publish(root, at, *args, **kwargs)
        if at == step:
            raise Interrupted
        return path

    monkeypatch.setattr(ckpt, "publish", publish_then_stop)
    try:
        with pytest.raises(Interrupted):
            run()
    finally:
        monkeypatch.undo()
